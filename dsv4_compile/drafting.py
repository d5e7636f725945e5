"""Draft proposers for speculative decoding without a draft model."""
from typing import Callable

Drafter = Callable[[list[int]], list[int]]

NGRAM_MAX = 3


def ngram_drafts(tokens: list[int], count: int, max_ngram: int = NGRAM_MAX) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the longest suffix n-gram
    (n = max_ngram..1) of `tokens` and propose the up to `count` tokens that followed it."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + count]
    return []


def make_drafter(draft: str | Drafter | None, verify_tokens: int, vocab_size: int) -> Drafter | None:
    """None, "ngram", or a callable (tokens so far -> proposed tokens); a callable's proposals are
    checked: at most verify_tokens ints in [0, vocab_size)."""
    if draft is None:
        return None
    if verify_tokens == 0:
        raise ValueError("draft needs an engine built with verify_tokens >= 1; got verify_tokens=0")
    if draft == "ngram":
        return lambda tokens: ngram_drafts(tokens, verify_tokens)
    if callable(draft):
        def checked(tokens: list[int]) -> list[int]:
            proposal = list(draft(tokens))
            if len(proposal) > verify_tokens:
                raise ValueError(
                    f"a draft may hold at most verify_tokens={verify_tokens} tokens; got {len(proposal)}")
            for token in proposal:
                if isinstance(token, bool) or not isinstance(token, int):
                    raise TypeError(f"a draft's tokens must be ints; got a {type(token).__name__}")
                if not 0 <= token < vocab_size:
                    raise ValueError(f"a draft holds token id {token}; ids must be in [0, {vocab_size})")
            return proposal
        return checked
    raise ValueError(f"draft must be None, 'ngram' or a callable; got {draft!r}")
