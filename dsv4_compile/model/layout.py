"""Static sizes of a serving step: how many requests, tokens and cache slots it holds."""
import dataclasses
import math

INDEX_PAGE_SLOTS = 64  # compressed indexer slots per page of the indexer key cache


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Static sizes shared by every cache of one engine.

    max_batch requests (plus one scratch row that padded requests write to), max_context tokens
    each, and at most step_tokens tokens per request per step (a prefill chunk or a verify).
    """

    max_batch: int
    max_context: int
    step_tokens: int
    sliding_window: int
    csa_rate: int
    hca_rate: int

    @property
    def rows(self) -> int:
        """Cache rows: one per request plus the scratch row (index max_batch)."""
        return self.max_batch + 1

    @property
    def scratch_row(self) -> int:
        return self.max_batch

    @property
    def window_ring(self) -> int:
        """Ring slots of the sliding window: the window plus the tokens of one step."""
        return self.sliding_window + self.step_tokens - 1

    def compressor_ring(self, rate: int, overlap: bool) -> int:
        """Ring slots of a compressor's projected tokens: one window (two when the windows
        overlap) plus the tokens of one step, rounded up to whole windows so that every window
        is one block of `rate` slots."""
        slots = (2 if overlap else 1) * rate + self.step_tokens - 1
        return rate * -(-slots // rate)

    def entries(self, rate: int) -> int:
        """Compressed entries a request can have at max_context."""
        return self.max_context // rate

    @property
    def index_pages(self) -> int:
        """Indexer key pages per request: ceil(max_context / 4 / 64)."""
        return math.ceil(self.entries(self.csa_rate) / INDEX_PAGE_SLOTS)
