"""The single post-grad CustomGraphPass that runs every dsv4 pass, and its cache key."""
import dataclasses
import importlib
import logging
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .report import PassReport, register_report, report_for

log = logging.getLogger("dsv4_compile")

# Rewrites run in this order; each module exposes PASS_NAME and apply(graph, report) -> int.
PASS_MODULES: tuple[str, ...] = (
    "dsv4_compile.passes.indexer",
    "dsv4_compile.passes.sparse_mla",
    "dsv4_compile.passes.fp4_moe",
    "dsv4_compile.passes.moe_route",
    "dsv4_compile.passes.hc_sinkhorn",
    "dsv4_compile.passes.rms_mm",
    "dsv4_compile.passes.skinny_mm",
    "dsv4_compile.passes.short_bmm",
    "dsv4_compile.passes.weight_stream_mm",
)
# Each module exposes register() -> None, installing its inductor lowerings.
LOWERING_MODULES: tuple[str, ...] = ("dsv4_compile.lowerings.fp4_moe", "dsv4_compile.lowerings.indexer",
                                     "dsv4_compile.lowerings.sparse_mla")

_PACKAGE_DIRS = ("passes", "lowerings", "kernels")


@dataclasses.dataclass(frozen=True)
class PassConfig:
    """What the pass manager applies; part of the FX-cache key."""

    passes: tuple[str, ...] = PASS_MODULES


def _source_files() -> tuple[str, ...]:
    files: list[str] = []
    for name in _PACKAGE_DIRS:
        pkg = importlib.import_module(f"dsv4_compile.{name}")
        files += sorted(str(p) for p in Path(pkg.__path__[0]).glob("*.py"))
    return tuple(files)


class Dsv4PostGradPass(CustomGraphPass):
    """Runs the configured passes on a post-grad graph and records what they did."""

    def __init__(self, config: PassConfig, report: PassReport, graph_label: str = "") -> None:
        self.config = config
        self.report_key = register_report(report)
        self.graph_label = graph_label

    def __call__(self, graph: torch.fx.Graph) -> None:
        report = report_for(self.report_key)
        report.graph = self.graph_label
        for name in self.config.passes:
            module = importlib.import_module(name)
            rewrites = module.apply(graph, report)
            log.debug("dsv4 pass %s: %d rewrite(s) in %s", module.PASS_NAME, rewrites, self.graph_label)
        graph.eliminate_dead_code()

    def uuid(self) -> bytes:
        return get_hash_for_files(_source_files(), extra=repr(self.config))


def install_lowerings() -> None:
    """Installs every lowering module's inductor lowerings (idempotent)."""
    for name in LOWERING_MODULES:
        importlib.import_module(name).register()
