"""The pass report: every site a pass considered, and whether it was rewritten."""
import itertools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SiteRecord:
    """One site a pass considered in one compiled graph."""

    pass_name: str
    site: str
    matched: bool
    reason: str = ""
    graph: str = ""


@dataclass
class PassReport:
    """Collects SiteRecords; `graph` labels the graph being compiled (e.g. "decode T=1")."""

    records: list[SiteRecord] = field(default_factory=list)
    graph: str = ""

    def record(self, pass_name: str, site: str, matched: bool, reason: str = "") -> None:
        """Add one site for the graph being compiled."""
        self.records.append(SiteRecord(pass_name, site, matched, reason, self.graph))

    def format(self) -> str:
        """One line per site: graph, pass, site, matched or the reason it was not."""
        if not self.records:
            return "(no sites: no dsv4 pass is enabled, or no graph was compiled)"
        return "\n".join(
            f"{r.graph or '-'}  {r.pass_name}  {r.site}  " + ("matched" if r.matched else f"NOT matched: {r.reason}")
            for r in self.records)

    def count(self, pass_name: str, graph: str | None = None) -> int:
        """Number of rewritten sites of `pass_name` (in `graph` if given)."""
        return sum(
            r.matched and r.pass_name == pass_name and (graph is None or r.graph == graph)
            for r in self.records
        )


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
