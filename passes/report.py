"""The pass report: every site a pass considered, whether it was rewritten, and which expected
sites of a model stayed unmatched."""
import dataclasses
import itertools
import re
from collections import Counter
from dataclasses import dataclass, field

import torch

_LAYER = re.compile(r"(?:layers|attention|routed)\.(\d+)")


@dataclass(frozen=True)
class SiteRecord:
    """One site a pass considered in one compiled graph."""

    pass_name: str
    site: str
    matched: bool
    reason: str = ""
    graph: str = ""
    layer: int | None = None


@dataclass(frozen=True)
class SiteStatus:
    """An expected site (pass, layer) of one graph, and what happened to it."""

    graph: str
    pass_name: str
    layer: int
    matched: bool
    reason: str


def site_layer(node: torch.fx.Node) -> int | None:
    """The model layer a post-grad node came from, read from its nn_module_stack."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        found = _LAYER.search(str(path))
        if found:
            return int(found.group(1))
    return None


@dataclass
class PassReport:
    """Collects SiteRecords; `graph` labels the graph being compiled (e.g. "T=1")."""

    records: list[SiteRecord] = field(default_factory=list)
    graph: str = ""

    def record(self, pass_name: str, site: "str | torch.fx.Node", matched: bool, reason: str = "") -> None:
        """Add one site (a node, or a name) for the graph being compiled."""
        if isinstance(site, torch.fx.Node):
            layer = site_layer(site)
            name = site.name if layer is None else f"layer {layer} ({site.name})"
        else:
            layer, name = None, site
        self.records.append(SiteRecord(pass_name, name, matched, reason, self.graph, layer))

    def extend(self, records: list[SiteRecord]) -> None:
        self.records.extend(records)

    def count(self, pass_name: str, graph: str | None = None) -> int:
        """Number of rewritten sites of `pass_name` (in `graph` if given)."""
        return sum(
            r.matched and r.pass_name == pass_name and (graph is None or r.graph == graph)
            for r in self.records
        )

    def graphs(self) -> list[str]:
        """The labels of the graphs that have records, in order."""
        return list(dict.fromkeys(r.graph for r in self.records))

    def status(self, expected: list[tuple[str, int]], graph: str) -> list[SiteStatus]:
        """For each expected (pass, layer) site of `graph`: matched, or the pass's own reason. A
        (pass, layer) listed n times needs n matched records (e.g. two mHC Sinkhorns per layer)."""
        rows = []
        for (pass_name, layer), needed in Counter(expected).items():
            mine = [r for r in self.records if r.graph == graph and r.pass_name == pass_name and r.layer == layer]
            matched = sum(r.matched for r in mine)
            reasons = sorted({r.reason for r in mine if not r.matched}) or ["the pass found no candidate at this layer"]
            rows += [SiteStatus(graph, pass_name, layer, True, "")] * min(matched, needed)
            rows += [SiteStatus(graph, pass_name, layer, False, "; ".join(reasons))] * max(0, needed - matched)
        return rows

    def format(self) -> str:
        """One line per site: graph, pass, site, matched or the reason it was not."""
        if not self.records:
            return "(no sites: no dsv4 pass is enabled, or no graph was compiled)"
        return "\n".join(
            f"{r.graph or '-'}  {r.pass_name}  {r.site}  " + ("matched" if r.matched else f"NOT matched: {r.reason}")
            for r in self.records)


def records_to_json(records: list[SiteRecord]) -> list[dict]:
    return [dataclasses.asdict(r) for r in records]


def records_from_json(rows: list[dict]) -> list[SiteRecord]:
    return [SiteRecord(**row) for row in rows]


# Inductor may copy the post-grad pass object (config patches are copied), so the pass refers to
# its report by key rather than holding it.
_REPORTS: dict[int, PassReport] = {}
_KEYS = itertools.count()


def register_report(report: PassReport) -> int:
    """A key under which `report` can be found by `report_for`."""
    key = next(_KEYS)
    _REPORTS[key] = report
    return key


def report_for(key: int) -> PassReport:
    """The report registered under `key`."""
    return _REPORTS[key]
