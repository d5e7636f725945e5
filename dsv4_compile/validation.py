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


def check_step_inputs(input_ids: object, start_pos: object, rows: object, *, max_batch: int,
                      step_tokens: int, max_context: int, vocab_size: int, device) -> None:
    """Checks a direct call of Engine.step: input_ids [B, T], start_pos [B], rows [B], all int64
    and all on the host (CPU) or all on the engine's device, 1 <= B <= max_batch, 1 <= T <=
    step_tokens, ids in [0, vocab_size), start_pos >= 0 with start_pos + T <= max_context, rows in
    [0, max_batch] (max_batch is the scratch row) and distinct but for the scratch row. Values on a
    GPU cost one host sync to read."""
    import torch

    named = (("input_ids", input_ids), ("start_pos", start_pos), ("rows", rows))
    for name, value in named:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
        if value.dtype != torch.int64:
            raise TypeError(f"{name} must be torch.int64; got {value.dtype}")
    devices = {value.device for _, value in named}
    allowed = dict.fromkeys([torch.device("cpu"), torch.device(device)])
    if len(devices) > 1 or not devices <= set(allowed):
        where = " or all on ".join(str(d) for d in allowed)
        got = ", ".join(f"{name} on {value.device}" for name, value in named)
        raise ValueError(f"input_ids, start_pos and rows must all be on {where}; got {got}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T]; got shape {tuple(input_ids.shape)}")
    batch, tokens = input_ids.shape
    check_int("batch (input_ids.shape[0])", batch, 1, max_batch)
    check_int("tokens per step (input_ids.shape[1])", tokens, 1, step_tokens)
    for name, value in named[1:]:
        if tuple(value.shape) != (batch,):
            raise ValueError(f"{name} must be [B={batch}]; got shape {tuple(value.shape)}")
    # one copy to the host (a sync for GPU values) instead of a reduction kernel per bound
    values = torch.cat([input_ids.reshape(-1), start_pos, rows]).cpu()
    ids_host, pos_host, rows_host = values.split([input_ids.numel(), batch, batch])
    (low_id, high_id), (low_pos, high_pos), (low_row, high_row) = (
        (int(v.min()), int(v.max())) for v in (ids_host, pos_host, rows_host))
    if low_id < 0 or high_id >= vocab_size:
        raise ValueError(f"input_ids must be in [0, {vocab_size}); got values in [{low_id}, {high_id}]")
    if low_pos < 0 or high_pos + tokens > max_context:
        raise ValueError(f"start_pos + T must be in [T, max_context={max_context}]; got start_pos in "
                         f"[{low_pos}, {high_pos}] with T={tokens}")
    if low_row < 0 or high_row > max_batch:
        raise ValueError(f"rows must be in [0, {max_batch}] ({max_batch} is the scratch row); "
                         f"got values in [{low_row}, {high_row}]")
    cache_rows = rows_host[rows_host != max_batch]
    if cache_rows.unique().numel() != cache_rows.numel():
        raise ValueError(f"rows must be distinct (only the scratch row {max_batch} may repeat); "
                         f"got {rows_host.tolist()}")
