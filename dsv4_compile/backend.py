"""The dsv4 torch.compile backend: inductor with one post-grad CustomGraphPass."""
from typing import Any, Callable

import torch

from dsv4_compile.passes.manager import Dsv4PostGradPass, PassConfig, install_lowerings
from dsv4_compile.passes.report import PassReport


def _graph_label(example_inputs: list[Any]) -> str:
    """'T=<n>' from the first 2-D integer input (the step's input_ids [B, T]), else ''."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point():
            tokens = value.shape[1]
            return f"T={tokens}" if isinstance(tokens, int) else "T=dynamic"
    return ""


class Dsv4Backend:
    """A callable torch.compile backend.

    `torch.compile(fn, backend=Dsv4Backend())`. It runs inductor's compile_fx with the dsv4
    passes on `post_grad_custom_post_pass`; `report` collects the sites they considered.
    """

    def __init__(self, config: PassConfig | None = None, report: PassReport | None = None,
                 cudagraphs: bool | None = None) -> None:
        self.config = config or PassConfig()
        self.report = report if report is not None else PassReport()
        self.cudagraphs = cudagraphs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                 mode: str | None = None, options: dict | None = None) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        patches: dict[str, Any] = {}
        if mode is not None:
            patches.update(torch._inductor.list_mode_options(mode))
        patches.update(options or {})
        if self.cudagraphs is not None:
            patches["triton.cudagraphs"] = self.cudagraphs
        patches["post_grad_custom_post_pass"] = Dsv4PostGradPass(
            self.config, self.report, _graph_label(example_inputs))
        install_lowerings()
        return compile_fx(gm, example_inputs, config_patches=patches)


backend = Dsv4Backend()
