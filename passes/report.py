"""The pass report: every site a pass considered, and whether it was rewritten."""
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

    def count(self, pass_name: str, graph: str | None = None) -> int:
        """Number of rewritten sites of `pass_name` (in `graph` if given)."""
        return sum(
            r.matched and r.pass_name == pass_name and (graph is None or r.graph == graph)
            for r in self.records
        )
