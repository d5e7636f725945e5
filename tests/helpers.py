"""Shared test helpers: prompts, transformers' greedy reference, and a step recorder."""
import importlib
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_passes import joint_graph, pad_mm, post_grad
from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dsv4_compile import fp4
from dsv4_compile.passes.report import PassReport
from dsv4_compile.tiny import FAST_COMPILE_OVERRIDES, tiny_model


def compile_model(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """The tiny model in its compile-test shape."""
    return tiny_model(seed=seed, dtype=dtype, device=device, **FAST_COMPILE_OVERRIDES)


def make_prompts(lengths: tuple[int, ...], vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def transformers_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """DeepseekV4ForCausalLM.generate, greedy, eager, with transformers' own cache."""
    device = model.lm_head.weight.device
    ids = torch.tensor([prompt], device=device)
    # An explicit mask: otherwise generate treats prompt tokens equal to pad_token_id as padding.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def transformers_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """One no-cache forward over `tokens`: logits [len(tokens), V] in f32."""
    device = model.lm_head.weight.device
    return model(torch.tensor([tokens], device=device), use_cache=False).logits[0].float()


class StepRecorder:
    """Wraps an engine's step and keeps (input_ids, start_pos, rows, logits) of every call."""

    def __init__(self, step):
        self.step = step
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, input_ids, start_pos, rows):
        logits = self.step(input_ids, start_pos, rows)
        self.calls.append((input_ids.cpu(), start_pos.cpu(), rows.cpu(), logits.float().cpu().clone()))
        return logits


def make_experts(fmt: str, experts: int, hidden: int, inter: int, seed: int) -> dict:
    """Random FP4 experts in the op's layout (quantised from N(0, 0.1) so the math stays O(1))."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    if fmt == "mxfp4":
        (a, b), (c, d) = fp4.quantize_mxfp4(w13), fp4.quantize_mxfp4(w2)
        g13 = g2 = None
    else:
        (a, b, g13), (c, d, g2) = fp4.quantize_nvfp4(w13), fp4.quantize_nvfp4(w2)
    return dict(w13=a, w13_scale=b, w2=c, w2_scale=d, fmt=fmt, w13_global=g13, w2_global=g2)


class PassProbe(CustomGraphPass):
    """A post-grad pass for tests: one dsv4 pass module's `apply`, counting its rewrites and
    recording the call targets left in the graph after it."""

    def __init__(self, pass_module: types.ModuleType, report: PassReport) -> None:
        self.pass_module = pass_module
        self.report = report
        self.rewrites = 0
        self.targets: list = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.rewrites += self.pass_module.apply(graph, self.report)
        self.targets += [n.target for n in graph.nodes if n.op == "call_function"]

    def uuid(self) -> bytes:
        return f"PassProbe({self.pass_module.__name__})".encode()


def expert_blocks_contract(ids: list[int], experts: int, block_m: int):
    """expert_blocks' contract in plain Python, for ids [P] (any values): (groups, blocks) with groups[e]
    the sorted pair indices of expert e (groups[E]: the skipped ones, ids outside [0, E)) and blocks
    the table [(expert, start, end)]: each expert's rows (ascending experts) cut into blocks of
    block_m, then empty blocks (E, 0, 0) up to moe_pairs.block_bound."""
    bucket = [e if 0 <= e < experts else experts for e in ids]
    groups = [[] for _ in range(experts + 1)]
    for pair, e in enumerate(bucket):
        groups[e].append(pair)
    blocks, start = [], 0
    for e in range(experts):
        count = len(groups[e])
        blocks += [(e, start + b, start + count) for b in range(0, count, block_m)]
        start += count
    busy = min(experts, len(ids))
    num_blocks = busy + (len(ids) - busy) // block_m
    blocks += [(experts, 0, 0)] * (num_blocks - len(blocks))
    return groups, blocks


def check_expert_blocks(ids: list[int], experts: int, block_m: int, order, expert, start, end) -> None:
    """expert_blocks' outputs against `expert_blocks_contract`: `order` holds each expert's pairs in
    its row range (in any order within it), then the skipped pairs; the block table exactly."""
    groups, want_blocks = expert_blocks_contract(ids, experts, block_m)
    assert order.dtype == torch.int32 and order.numel() == len(ids)
    row, order = 0, order.tolist()
    for e, group in enumerate(groups):
        assert sorted(order[row:row + len(group)]) == group, f"expert_blocks order, expert {e}"
        row += len(group)
    got = list(zip(expert.tolist(), start.tolist(), end.tolist()))
    assert got == want_blocks, "expert_blocks block table"


def compile_with_probe(fn, pass_module: types.ModuleType, **kwargs):
    """fn compiled by inductor with only `pass_module` as its post-grad pass -> (compiled, report, probe)."""
    report = PassReport()
    probe = PassProbe(pass_module, report)
    compiled = torch.compile(fn, backend="inductor", fullgraph=True,
                             options={"post_grad_custom_post_pass": probe}, **kwargs)
    return compiled, report, probe


class BmmToMmOnCpu:
    """inductor's joint-graph pattern bmm_to_mm (a bmm whose batch is statically 1 becomes
    unsqueeze(mm(squeeze(a, 0), squeeze(b, 0)), 0)), which torch applies to GPU tensors only, made
    to apply to CPU tensors too by patching the device check it calls; `rewrites` counts the bmms
    it rewrote (those whose batch sizes are statically 1, what it checks after the device)."""

    def __init__(self, monkeypatch) -> None:
        self.rewrites = 0
        monkeypatch.setattr(joint_graph, "check_device", self._same_device)

    def _same_device(self, a: torch.Tensor, b: torch.Tensor, device: str = "cuda") -> bool:
        self.rewrites += statically_known_true(a.shape[0] == 1) and statically_known_true(b.shape[0] == 1)
        return a.device.type == b.device.type


class OnlineSoftmaxOnCpu:
    """inductor's post-grad pattern that turns a softmax's amax / sub / exp / sum into
    prepare_softmax_online, which torch applies on CUDA and XPU only (`prepare_softmax_extra_check`),
    made to apply to CPU tensors too by swapping that check in the pattern's registered closure,
    except for softmaxes written in the files of `keep_files` (C++ code generation has no online-softmax
    reduction, so a softmax no dsv4 pass rewrites must stay as it is on CPU); `rewrites` counts the
    softmaxes it turned."""

    def __init__(self, monkeypatch, keep_files: tuple[str, ...] = ()) -> None:
        self.rewrites = 0
        self.keep_files = keep_files
        post_grad.lazy_init()
        cells = [cell for entries in post_grad.pass_patterns[1].patterns.values() for entry in entries
                 for cell in entry.extra_check.__closure__ or ()
                 if cell.cell_contents is post_grad.prepare_softmax_extra_check]
        assert len(cells) == 1, "torch registers the online-softmax pattern differently"
        monkeypatch.setattr(cells[0], "cell_contents", self._accept)

    def _accept(self, match) -> bool:
        written_in = match.kwargs["x"].meta.get("stack_trace") or ""
        if any(f"{name}\"" in written_in for name in self.keep_files):
            return False
        self.rewrites += 1
        return torch._inductor.config.online_softmax


class PadBmmAsInductorOnCuda(CustomGraphPass):
    """inductor's pad_mm rewrite of bmm, which it applies on CUDA only and where a benchmark says
    so: torch's own pattern and replacement, here for every bmm with a dim off the alignment."""

    def __init__(self) -> None:
        self.patterns = PatternMatcherPass()
        self.padded = 0
        register_replacement(pad_mm.bmm_pattern, pad_mm.bmm_replace, [torch.empty(2, 3, 5), torch.empty(2, 5, 7)],
                             fwd_only, self.patterns, extra_check=self._off_alignment)

    def _off_alignment(self, match) -> bool:
        mat1, mat2 = (match.kwargs[name].meta["val"] for name in ("mat1", "mat2"))
        align = pad_mm.get_alignment_size(mat1)
        off = any(pad_mm.get_padded_length(size, align) for size in (*mat1.shape[1:], mat2.shape[2]))
        self.padded += off
        return off

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.patterns.apply(graph)

    def uuid(self) -> bytes:
        return b"PadBmmAsInductorOnCuda"


class TargetsBefore(CustomGraphPass):
    """A post-grad pre-pass that records the call targets of the graph the dsv4 passes receive."""

    def __init__(self) -> None:
        self.targets: list = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.targets += [n.target for n in graph.nodes if n.op == "call_function"]

    def uuid(self) -> bytes:
        return b"TargetsBefore"


class StepCounter:
    """Replaces `engine.compiled_step` with itself and counts the compiled steps run."""

    def __init__(self, engine) -> None:
        self.calls = 0
        self._step = engine.compiled_step
        engine.compiled_step = self

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self._step(*args)


LARGE_INDEX_PAGES = 262_400  # x 64 slots x 128 dims = 2.15e9 fp8 elements
LARGE_POOL_ROWS = 4_300_000  # x 512 dims = 2.2e9 bf16 elements


def large_indexer_inputs(heads: int, device: str, gen: torch.Generator) -> tuple:
    """indexer_topk arguments (without topk) whose key cache has more than 2**31 elements: one
    request over its last 40 pages (only those filled), two tokens, lens 40*64 - 1 and 40*64.
    q [1, 2, heads, 128] bf16, weights [1, 2, heads] f32, k_cache fp8 [P, 64, 128], k_scale [P, 64]."""
    used_pages, page, dim = 40, 64, 128
    k_cache = torch.empty(LARGE_INDEX_PAGES, page, dim, dtype=torch.float8_e4m3fn, device=device)
    k_scale = torch.empty(LARGE_INDEX_PAGES, page, device=device)
    used = torch.arange(LARGE_INDEX_PAGES - used_pages, LARGE_INDEX_PAGES, device=device)
    k_cache[used] = torch.randn(used_pages, page, dim, generator=gen, device=device).to(k_cache.dtype)
    k_scale[used] = torch.rand(used_pages, page, generator=gen, device=device) + 0.5
    page_table = used.flip(0).view(1, used_pages).int().contiguous()
    q = torch.randn(1, 2, heads, dim, generator=gen, device=device).to(torch.bfloat16)
    weights = torch.randn(1, 2, heads, generator=gen, device=device) * heads ** -0.5
    lens = torch.tensor([[used_pages * page - 1, used_pages * page]], dtype=torch.int32, device=device)
    return q, weights, k_cache, k_scale, page_table, lens


def large_sparse_mla_inputs(heads: int, device: str, gen: torch.Generator) -> tuple:
    """sparse_mla arguments whose extra pool has more than 2**31 elements, read in its last 1,024
    rows (only those filled): B=2, T=2, Dh=512 bf16, a 64-row window, 128 extra rows per token
    with -1 holes in one token."""
    head_dim, window = 512, 64
    extra_kv = torch.empty(LARGE_POOL_ROWS, head_dim, dtype=torch.bfloat16, device=device)
    tail = torch.arange(LARGE_POOL_ROWS - 1024, LARGE_POOL_ROWS, device=device)
    extra_kv[tail] = torch.randn(1024, head_dim, generator=gen, device=device).to(torch.bfloat16)
    kv = torch.randn(2 * window, head_dim, generator=gen, device=device).to(torch.bfloat16)
    q = torch.randn(2, 2, heads, head_dim, generator=gen, device=device).to(torch.bfloat16)
    idx = torch.arange(2 * window, device=device).view(2, 1, window).expand(2, 2, window).int().contiguous()
    extra_idx = tail[torch.randint(0, 1024, (2, 2, 128), generator=gen, device=device)].int()
    extra_idx[0, 1, ::3] = -1
    sink = torch.randn(heads, generator=gen, device=device)
    return q, kv, None, idx, extra_kv, None, extra_idx, sink, head_dim ** -0.5


def transformers_fp4_experts(config, scale_fmt: str, seed: int):
    """A transformers FP8Experts module holding FP4 experts for `config` (random N(0, 1) weights
    quantised to MXFP4; scales as e8m0 for scale_fmt "ue8m0", else as f32 powers of two)."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    # transformers 5.17 reads the expert dtype from the config; later releases take an argument.
    if "expert_dtype" in inspect.signature(FP8Experts.__init__).parameters:
        module = FP8Experts(config, scale_fmt=scale_fmt, expert_dtype="fp4")
    else:
        config.expert_dtype = "fp4"
        module = FP8Experts(config, scale_fmt=scale_fmt)
    gen = torch.Generator().manual_seed(seed)
    for proj in ("gate_up_proj", "down_proj"):
        weight = getattr(module, proj)
        dense = torch.randn(weight.shape[:-1] + (2 * weight.shape[-1],), generator=gen)
        packed, scale = fp4.quantize_mxfp4(dense)
        weight.data.copy_(packed.view(torch.int8))
        target = getattr(module, proj + "_scale_inv")
        target.data.copy_(scale.view(target.dtype) if scale_fmt == "ue8m0" else fp4.ue8m0_to_float(scale))
    return module


def run_compiled_script(script: str, module_file: str, timeout: int = 900) -> list[list[str]]:
    """Runs `script` in a fresh process without TRITON_INTERPRET (so Triton compiles instead of
    interpreting; cross-compiling needs no GPU), with this process's modules, from the checkout's
    root. The script's first line must be `module <file>` of the module it tested, which must be
    `module_file` (the copy these tests import); returns its other lines, split on whitespace."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this process's modules, not the cwd's
    done = subprocess.run([sys.executable, "-P", "-c", script], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    first, *rest = done.stdout.splitlines()
    assert first == f"module {module_file}"
    return [line.split() for line in rest]


def bench_module(module: str):
    """bench.<module> from the checkout (bench/__init__.py drops the root from sys.path again)."""
    root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, root)
    try:
        return importlib.import_module(f"bench.{module}")
    finally:
        if root in sys.path:
            sys.path.remove(root)
