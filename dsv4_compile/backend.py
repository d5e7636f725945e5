"""The dsv4 torch.compile backend: inductor with one post-grad CustomGraphPass."""
import hashlib
import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from dsv4_compile.passes.manager import Dsv4PostGradPass, PassConfig, install_lowerings
from dsv4_compile.passes.report import PassReport, records_from_json, records_to_json

log = logging.getLogger("dsv4_compile")


def _graph_label(example_inputs: list[Any]) -> str:
    """'T=<n>' from the first 2-D integer input (the step's input_ids [B, T]), else ''."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point():
            tokens = value.shape[1]
            return f"T={tokens}" if isinstance(tokens, int) else "T=dynamic"
    return ""


def _runs_on_cuda(example_inputs: list[Any]) -> bool:
    """Whether the graph's tensor inputs live on a CUDA device (inductor then emits Triton kernels)."""
    return any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in example_inputs)


def _records_path(gm: torch.fx.GraphModule, example_inputs: list[Any], uuid: bytes) -> Path:
    """Where the pass records of this graph are kept, so that an FX-cache hit (on which the
    passes do not run) still reports what they did when the cached code was made."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    signature = [(tuple(v.shape), str(v.dtype), v.device.type) if isinstance(v, torch.Tensor) else repr(v)
                 for v in example_inputs]
    key = hashlib.sha256(gm.code.encode() + repr(signature).encode() + uuid).hexdigest()
    return Path(cache_dir()) / "dsv4_reports" / f"{key}.json"


# The step's graphs write the KV caches in place. At a graph's first run inductor benchmarks every
# kernel that has several configs, and first saves each argument such a kernel mutates: in pinned
# host memory when a GPU clone would exceed peak-minus-current allocation. With caches of tens of GB
# those saves took ~30 s of the first call (H200, the bench's 4-layer slice at 1M context).
# Pointwise kernels (the cache writes among them) take inductor's single heuristic config instead;
# options={"triton.autotune_pointwise": True} restores inductor's default.
#
# Inductor's coordinate descent tuning (which mode="max-autotune" turns on) also changes inductor's
# decompositions on GPUs: an mm or bmm with a unit dimension becomes a mul + sum, a form the fp4_moe
# pass does not recognise, so the FP4 MoE stays the plain-torch reference. On the H200 the 4-layer
# full-width step then took 127.6 ms instead of 3.98 (131.6 without combo kernels), compiled in
# 251-267 s, and its logits differed by up to 3.5 (the model's own routing; bench/RESULTS.md
# "Fifteenth session"; the missed match reproduces on CPU with those decompositions forced). The
# backend keeps it off, whatever inductor's global config says: a mode that implies it loses it with
# a warning, and `options` asking for it raise.
UNSUPPORTED_INDUCTOR_OPTIONS = ("coordinate_descent_tuning",)
DEFAULT_INDUCTOR_OPTIONS: dict[str, Any] = {"triton.autotune_pointwise": False,
                                            **{option: False for option in UNSUPPORTED_INDUCTOR_OPTIONS}}

# Decode graphs (T=1) launch about a hundred small inductor kernels a step, bound by launch and ramp-up
# rather than bytes. Combo kernels launch data-independent ones as one kernel. Timed paired on the H200
# (4-layer full-width slice, bench/RESULTS.md "Fourteenth" and "Fifteenth session"): B=64 T=1 -86 us
# of 4,071 (against the default without them), B=1 -64 us of 1,260; at B=64 T=4 +35 us of 7,490, so
# verify graphs keep inductor's default. CPU graphs (C++ kernels) keep it too: there the option only
# added compile time (+13 s to a CPU test's 137 s).
DECODE_INDUCTOR_OPTIONS: dict[str, Any] = {"combo_kernels": True}


def _graph_options(label: str, on_cuda: bool) -> dict[str, Any]:
    """The inductor options a graph starts from: DEFAULT_INDUCTOR_OPTIONS, plus
    DECODE_INDUCTOR_OPTIONS for a decode graph (label 'T=1') on a CUDA device."""
    options = dict(DEFAULT_INDUCTOR_OPTIONS)
    if label == "T=1" and on_cuda:
        options.update(DECODE_INDUCTOR_OPTIONS)
    return options


class Dsv4Backend:
    """A callable torch.compile backend.

    `torch.compile(fn, backend=Dsv4Backend())`. It runs inductor's compile_fx with the dsv4
    passes on `post_grad_custom_post_pass`, DEFAULT_INDUCTOR_OPTIONS and, for decode graphs on a
    CUDA device, DECODE_INDUCTOR_OPTIONS (`options` override them; mode="max-autotune" autotunes
    pointwise kernels again); `report` collects the sites they considered. A graph is a decode
    graph when its first 2-D integer input is [B, 1] (the step's input_ids), or when the label told
    with `graph_label` is 'T=1'. UNSUPPORTED_INDUCTOR_OPTIONS stay off: a `mode` that turns one on
    loses it (one warning per backend), and `options` turning one on raise ValueError.
    """

    def __init__(self, config: PassConfig | None = None, report: PassReport | None = None,
                 cudagraphs: bool | None = None) -> None:
        self.config = config or PassConfig()
        self.report = report if report is not None else PassReport()
        self.cudagraphs = cudagraphs
        self._dropped: set[str] = set()  # UNSUPPORTED_INDUCTOR_OPTIONS a mode turned on, warned about once
        self._told_label: str | None = None

    @contextmanager
    def graph_label(self, label: str) -> Iterator[None]:
        """Graphs compiled inside take `label` ('T=<tokens per request>', or '' for none) instead of
        the one read from their inputs: for callers whose inputs have no [B, T] token ids."""
        saved, self._told_label = self._told_label, label
        try:
            yield
        finally:
            self._told_label = saved

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                 mode: str | None = None, options: dict | None = None) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        label = self._told_label if self._told_label is not None else _graph_label(example_inputs)
        patches = _graph_options(label, _runs_on_cuda(example_inputs))
        if mode is not None:
            patches.update(torch._inductor.list_mode_options(mode))
        options = options or {}
        for option in UNSUPPORTED_INDUCTOR_OPTIONS:
            if options.get(option):
                raise ValueError(f"options[{option!r}] must be False with the dsv4 backend: it changes inductor's "
                                 f"mm/bmm decompositions so that the FP4 MoE pass cannot match (see "
                                 f"dsv4_compile.backend.UNSUPPORTED_INDUCTOR_OPTIONS)")
            if patches[option] and option not in options and option not in self._dropped:
                self._dropped.add(option)
                log.warning("dsv4: mode=%r turns on %s, which keeps the FP4 MoE pass from matching; it "
                            "stays off", mode, option)
            patches[option] = False
        patches.update(options)
        if self.cudagraphs is not None:
            patches["triton.cudagraphs"] = self.cudagraphs
        post_grad = Dsv4PostGradPass(self.config, self.report, label)
        patches["post_grad_custom_post_pass"] = post_grad
        install_lowerings()
        before = len(self.report.records)
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
        path = _records_path(gm, example_inputs, post_grad.uuid())
        fresh = self.report.records[before:]
        if fresh:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(records_to_json(fresh)))
        elif path.exists():
            self.report.extend(records_from_json(json.loads(path.read_text())))
        return compiled


backend = Dsv4Backend()
