"""Shared test helpers: prompts, transformers' greedy reference, and a step recorder."""
import types

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

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


def compile_with_probe(fn, pass_module: types.ModuleType, **kwargs):
    """fn compiled by inductor with only `pass_module` as its post-grad pass -> (compiled, report, probe)."""
    report = PassReport()
    probe = PassProbe(pass_module, report)
    compiled = torch.compile(fn, backend="inductor", fullgraph=True,
                             options={"post_grad_custom_post_pass": probe}, **kwargs)
    return compiled, report, probe


class StepCounter:
    """Replaces `engine.compiled_step` with itself and counts the compiled steps run."""

    def __init__(self, engine) -> None:
        self.calls = 0
        self._step = engine.compiled_step
        engine.compiled_step = self

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self._step(*args)
