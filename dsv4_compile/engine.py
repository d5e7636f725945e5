"""optimize(): a compiled static-cache DeepSeek-V4 engine with greedy and speculative generate."""
import logging
from typing import Callable

import torch
from torch import nn

from .backend import Dsv4Backend
from .compiled_step import compile_step
from .drafting import Drafter, make_drafter
from .model.attention import CSA
from .model.fp4_experts import is_fp4, tile_fp4_experts_
from .model.layout import INDEX_PAGE_SLOTS, StepLayout
from .model.step import DeepseekV4Step
from .passes.manager import PASS_MODULES, PassConfig
from .passes.report import PassReport, SiteStatus
from .validation import check_int, check_prompts, check_step_inputs

log = logging.getLogger("dsv4_compile")

DEFAULT_PREFILL_CHUNK = 16


def batch_bucket(batch: int, max_batch: int) -> int:
    """The CUDA-graph capture size a batch is padded to: the next power of two, at most max_batch."""
    bucket = 1
    while bucket < batch:
        bucket *= 2
    return min(bucket, max_batch)


class Engine:
    """A static-cache serving engine around one transformers DeepseekV4ForCausalLM.

    `step(input_ids [B, T] int64, start_pos [B] int64, rows [B] int64) -> logits [B, T, V]` runs
    the compiled step (decode and verify) with its inputs checked, taking them on the host or on
    the engine's device; `compiled_step` is the same without checks or uploads (inputs on the
    device), `module` the same uncompiled (it also runs the prefill chunks). `generate` drives
    them. `report` lists what the dsv4 passes matched.
    """

    def __init__(self, model: nn.Module, *, max_batch: int, max_context: int, verify_tokens: int,
                 strict: bool, compile: bool = True, passes: tuple[str, ...] | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, tile_experts: bool = True) -> None:
        config = model.config
        if tile_experts:
            tile_fp4_experts_(model)
        self.model = model
        self.verify_tokens = verify_tokens
        self.strict = strict
        self.prefill_chunk = prefill_chunk
        self.vocab_size = config.vocab_size
        self.device = model.lm_head.weight.device
        self.layout = StepLayout(
            max_batch=max_batch, max_context=max_context,
            step_tokens=max(prefill_chunk, verify_tokens + 1),
            sliding_window=config.sliding_window,
            csa_rate=config.compress_rates["compressed_sparse_attention"],
            hca_rate=config.compress_rates["heavily_compressed_attention"])
        self.module = DeepseekV4Step(model, self.layout)
        self.report = PassReport()
        self.config = PassConfig() if passes is None else PassConfig(passes=passes)
        self.backend = Dsv4Backend(self.config, self.report, cudagraphs=self.device.type == "cuda")
        self._checked_graphs: set[str] = set()
        self._upload_stream: torch.cuda.Stream | None = None
        # one graph per batch bucket and T: generate takes T = 1 and verify_tokens + 1, step() any T up to
        # step_tokens (each new T compiles a graph; a budget below that would end in a hard failure)
        buckets = len({batch_bucket(b, max_batch) for b in range(1, max_batch + 1)})
        self.compiled_step = compile_step(self.module, self.backend, buckets * self.layout.step_tokens) if compile \
            else self.module

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, start_pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The compiled step with its inputs checked; the logits [B, T, V] are a copy on the
        engine's device, so they outlive the next CUDA-graph replay. `rows` must be distinct but for
        the scratch row (max_batch); the batch runs as its bucket's graph, padded with scratch rows.

        The inputs may be on the host (a serving scheduler's batch): they are checked there and
        copied to the GPU without waiting for it, so the host can queue this step while the GPU
        still runs the last one. Inputs on the engine's GPU cost one host sync to check."""
        layout = self.layout
        check_step_inputs(input_ids, start_pos, rows, max_batch=layout.max_batch, step_tokens=layout.step_tokens,
                          max_context=layout.max_context, vocab_size=self.vocab_size, device=self.device)
        batch = input_ids.shape[0]
        input_ids, start_pos, rows = self._to_device(*self._pad_to_bucket(input_ids, start_pos, rows))
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        logits = self.compiled_step(input_ids, start_pos, rows)[:batch].clone()
        self._check_sites()
        return logits

    def _pad_to_bucket(self, input_ids: torch.Tensor, start_pos: torch.Tensor,
                       rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch padded to its bucket's size (the graph that runs it): id 0 at position 0 in the
        scratch row."""
        pad = batch_bucket(input_ids.shape[0], self.layout.max_batch) - input_ids.shape[0]
        if not pad:
            return input_ids, start_pos, rows
        return (torch.cat([input_ids, input_ids.new_zeros(pad, input_ids.shape[1])]),
                torch.cat([start_pos, start_pos.new_zeros(pad)]),
                torch.cat([rows, rows.new_full((pad,), self.layout.scratch_row)]))

    def _to_device(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's inputs on the engine's device, contiguous (the compiled graphs guard on strides)."""
        host = [t for t in tensors if t.device != self.device]
        if not host:
            return tuple(t.contiguous() for t in tensors)
        if self.device.type != "cuda":
            return tuple(t.to(self.device).contiguous() for t in tensors)
        uploaded = iter(self._upload(host))
        return tuple(t.contiguous() if t.device == self.device else next(uploaded) for t in tensors)

    def _upload(self, host: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of host int64 tensors (check_step_inputs and _run pass nothing else) on the engine's
        GPU, without a host sync: packed into one pinned buffer of their own (the caching host
        allocator keeps it until the transfer has run, so the caller may reuse `host` at once) and
        sent in one copy on a side stream, which the current stream then waits for. The copy's
        latency (several us a transfer, on the H200) thus overlaps the GPU's previous work instead of
        preceding this step's kernels."""
        sizes = [t.numel() for t in host]
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + -(-size // 2) * 2)  # each part at a 16-byte offset
        pinned = torch.empty(starts[-1], dtype=torch.int64, pin_memory=True)
        for t, start, size in zip(host, starts, sizes):
            pinned[start:start + size].copy_(t.reshape(-1))
        current = torch.cuda.current_stream(self.device)
        if self._upload_stream is None:
            self._upload_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._upload_stream):
            packed = pinned.to(self.device, non_blocking=True)
        current.wait_stream(self._upload_stream)
        packed.record_stream(current)  # freed on the side stream: not reused before the step has read it
        return [packed[start:start + size].view(t.shape) for t, start, size in zip(host, starts, sizes)]

    def expected_sites(self) -> list[tuple[str, int]]:
        """(pass, layer) sites every compiled graph should have: sparse MLA in each layer, the
        indexer in each CSA layer, the FP4 MoE in each layer whose experts are FP4, the router's
        top-k in each layer not routed by hash, and the mHC Sinkhorn twice in each layer (attention
        and MoE hyper-connections) when it has at least two rounds (one is left to inductor)."""
        enabled = {name.rsplit(".", 1)[-1] for name in self.config.passes}
        sinkhorns = 2 if self.model.config.hc_sinkhorn_iters >= 2 else 0
        sites = []
        for i, layer in enumerate(self.model.model.layers):
            wanted = {"sparse_mla": 1, "indexer": int(layer.self_attn.layer_type == CSA),
                      "fp4_moe": int(is_fp4(layer.mlp.experts)), "moe_route": int(not layer.mlp.is_hash),
                      "hc_sinkhorn": sinkhorns}
            sites += [(name, i) for name, count in wanted.items() if name in enabled for _ in range(count)]
        return sites

    def site_status(self) -> list[SiteStatus]:
        """Every expected site of every compiled graph: matched, or why not."""
        expected = self.expected_sites()
        return [row for graph in self.report.graphs() for row in self.report.status(expected, graph)]

    def _check_sites(self) -> None:
        """After a compile: raise (strict) or warn once per expected site left unmatched."""
        for graph in self.report.graphs():
            if graph in self._checked_graphs:
                continue
            self._checked_graphs.add(graph)
            missed = [r for r in self.report.status(self.expected_sites(), graph) if not r.matched]
            if missed and self.strict:
                lines = "; ".join(f"{r.pass_name} at layer {r.layer}: {r.reason}" for r in missed)
                raise RuntimeError(f"strict=True: {len(missed)} expected dsv4 site(s) unmatched in graph {graph}: {lines}")
            for r in missed:
                log.warning("dsv4: %s not applied at layer %d in graph %s: %s", r.pass_name, r.layer, graph, r.reason)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *,
                 draft: str | Callable[[list[int]], list[int]] | None = None) -> list[list[int]]:
        """Greedy generation; returns only the new tokens, one list per prompt.

        draft: None (plain decode), "ngram" (prompt lookup), or a callable that proposes draft
        tokens from a request's tokens so far. Drafts are verified with one T = 1 + verify_tokens
        step; the accepted prefix is kept, so the output equals plain greedy decoding.
        """
        check_prompts(prompts, self.layout.max_batch, self.vocab_size)
        prompts = [list(p) for p in prompts]
        check_int("max_new_tokens", max_new_tokens, 0, None)
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.layout.max_context:
            raise ValueError(
                f"prompt length + max_new_tokens must be <= max_context={self.layout.max_context}; "
                f"got {longest} + {max_new_tokens}")
        drafter = make_drafter(draft, self.verify_tokens, self.vocab_size)
        self.last_acceptance: float | None = None
        if max_new_tokens == 0:
            return [[] for _ in prompts]
        tokens = [list(p) for p in prompts]
        new = [[self._prefill(row, p)] for row, p in enumerate(prompts)]
        proposed = accepted = 0
        while min(len(n) for n in new) < max_new_tokens:
            if drafter is None:
                self._decode(tokens, new)
            else:
                p, a = self._verify(tokens, new, drafter)
                proposed, accepted = proposed + p, accepted + a
        if drafter is not None:
            self.last_acceptance = accepted / proposed if proposed else 0.0
            log.info("draft acceptance %.1f%% (%d of %d)", 100 * self.last_acceptance, accepted, proposed)
        return [n[:max_new_tokens] for n in new]

    def _run(self, input_ids: list[list[int]], start_pos: list[int], rows: list[int],
             step: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """Runs `step` (default: the compiled step) on a batch padded to its bucket; returns the
        argmax [B, T] on the host."""
        batch = len(input_ids)
        ids, start, row_ids = self._to_device(*self._pad_to_bucket(*(
            torch.tensor(values, dtype=torch.int64) for values in (input_ids, start_pos, rows))))
        if step is None:
            step = self.compiled_step
            if self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
        logits = step(ids, start, row_ids)
        argmax = logits[:batch].argmax(dim=-1).cpu()
        if step is self.compiled_step:
            self._check_sites()
        return argmax

    def _prefill(self, row: int, prompt: list[int]) -> int:
        """Feeds one prompt into cache row `row` in chunks; returns its first greedy token."""
        chunk = self.prefill_chunk
        for start in range(0, len(prompt), chunk):
            piece = prompt[start:start + chunk]
            argmax = self._run([piece + [0] * (chunk - len(piece))], [start], [row], self.module)
        return int(argmax[0, len(piece) - 1])

    def _decode(self, tokens: list[list[int]], new: list[list[int]]) -> None:
        for t, n in zip(tokens, new):
            t.append(n[-1])
        argmax = self._run([[t[-1]] for t in tokens], [len(t) - 1 for t in tokens], list(range(len(tokens))))
        for n, a in zip(new, argmax):
            n.append(int(a[0]))

    def _verify(self, tokens: list[list[int]], new: list[list[int]], drafter: Drafter) -> tuple[int, int]:
        """One verify step for every request; returns (drafts proposed, drafts accepted)."""
        width = self.verify_tokens + 1
        rows, proposals = [], []
        for t, n in zip(tokens, new):
            t.append(n[-1])
            proposals.append(drafter(list(t))[: width - 1])  # a copy: a drafter may change its list
            rows.append(t[-1:] + proposals[-1] + [0] * (width - 1 - len(proposals[-1])))
        argmax = self._run(rows, [len(t) - 1 for t in tokens], list(range(len(tokens))))
        proposed = accepted = 0
        for t, n, drafts, greedy in zip(tokens, new, proposals, argmax.tolist()):
            keep = 0
            while keep < len(drafts) and drafts[keep] == greedy[keep]:
                keep += 1
            # drafts[:keep] become context; greedy[keep] is the next token to feed.
            t.extend(drafts[:keep])
            n.extend(greedy[:keep + 1])
            proposed, accepted = proposed + len(drafts), accepted + keep
        return proposed, accepted


def optimize(model: nn.Module, *, max_batch: int = 8, max_context: int = 4096, verify_tokens: int = 0,
             strict: bool = False, compile: bool = True, passes: tuple[str, ...] | None = None,
             tile_experts: bool = True) -> Engine:
    """Builds a compiled static-cache engine for a transformers DeepseekV4ForCausalLM.

    max_context must be a multiple of 4 * 64 (the indexer's key pages) and of the HCA rate.
    verify_tokens is the most draft tokens one verify step checks (0: no speculative decoding).
    compile=False runs the same step eagerly (the reference the compiled step is tested against).
    passes: the dsv4 pass modules to apply (default: all, `PASS_MODULES`); () compiles plain inductor.
    tile_experts: move the model's FP4 expert weights to the tiled layout in place (where their
    sizes split into tiles; transformers' FP4 FP8Experts are replaced by Fp4Experts for it; see
    `tile_fp4_experts_`), which the FP4 MoE kernels read faster.

    The engine serves the model's weights as they are at this call: it copies the projections of
    each layer's input into one weight (`FusedLinear`; V4-Flash in bf16: 46-68 MB a layer). Load weights
    before optimize().
    """
    from transformers import DeepseekV4ForCausalLM

    if not isinstance(model, DeepseekV4ForCausalLM):
        raise TypeError(f"model must be a transformers DeepseekV4ForCausalLM; got {type(model).__name__}")
    check_int("max_batch", max_batch, 1, None)
    for name, flag in (("strict", strict), ("compile", compile), ("tile_experts", tile_experts)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool; got {type(flag).__name__}")
    config = model.config
    csa = config.compress_rates["compressed_sparse_attention"]
    hca = config.compress_rates["heavily_compressed_attention"]
    check_int("max_context", max_context, 1, None)
    check_int("verify_tokens", verify_tokens, 0, max_context - 1)  # a verify step's T = 1 + verify_tokens
    for name, multiple in (("4 x 64 indexer slots", csa * INDEX_PAGE_SLOTS), ("the HCA rate", hca)):
        if max_context % multiple:
            raise ValueError(f"max_context must be a multiple of {name} ({multiple}); got {max_context}")
    if config.hidden_act != "silu":
        raise ValueError(f"config.hidden_act must be 'silu'; got {config.hidden_act!r}")
    known = set(PASS_MODULES)
    if passes is not None and (isinstance(passes, str) or not isinstance(passes, (tuple, list, set, frozenset))):
        raise TypeError(f"passes must be a tuple of pass names (or None: all); got {type(passes).__name__}")
    if passes is not None and not set(passes) <= known:
        raise ValueError(f"passes must be a subset of {sorted(known)}; got {sorted(set(passes) - known)}")
    return Engine(model, max_batch=max_batch, max_context=max_context, verify_tokens=verify_tokens,
                  strict=strict, compile=compile, passes=passes, tile_experts=tile_experts)
