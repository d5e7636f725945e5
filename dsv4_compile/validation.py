"""Argument checks that raise clear errors before any work is done."""


def check_int(name: str, value: object, low: int, high: int | None) -> None:
    """Raises TypeError unless `value` is an int, ValueError unless low <= value (<= high)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}; got {value}")


def check_prompts(prompts: object, max_batch: int, vocab_size: int) -> None:
    """prompts: a non-empty list of at most max_batch non-empty lists of ids in [0, vocab_size)."""
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in prompts):
        raise TypeError("prompts must be a list of lists of token ids")
    if not 1 <= len(prompts) <= max_batch:
        raise ValueError(f"the number of prompts (batch) must be in [1, max_batch={max_batch}]; got {len(prompts)}")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompts[{i}] is empty; each prompt needs at least one token")
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int):
                raise TypeError(f"prompts[{i}] holds a {type(token).__name__}; token ids must be ints")
            if not 0 <= token < vocab_size:
                raise ValueError(f"prompts[{i}] holds token id {token}; ids must be in [0, {vocab_size})")
