"""torch.compile of one engine's step, with its own dynamo cache and room for all its graphs."""
import itertools
import logging
import types
from typing import Callable

import torch
from torch import nn

log = logging.getLogger("dsv4_compile")

_step_ids = itertools.count()


def _step_with_own_code(module: nn.Module) -> Callable[..., torch.Tensor]:
    """A function calling `module` whose code object no other engine shares.

    Dynamo keeps compiled graphs, and counts them against `recompile_limit`, per code object. Compiling
    `module` itself would put every engine of a process on the one `DeepseekV4Step.forward`."""
    def step(input_ids: torch.Tensor, start_pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return module(input_ids, start_pos, rows)

    code = step.__code__.replace(co_name=f"dsv4_step_{next(_step_ids)}")
    return types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)


def compile_step(module: nn.Module, backend: Callable, graphs: int) -> Callable[..., torch.Tensor]:
    """module(input_ids [B, T] int64, start_pos [B] int64, rows [B] int64) -> logits, compiled with
    `backend` as one static graph per (batch bucket, T); `graphs` is how many such graphs it needs.

    Raises the process-wide `torch._dynamo.config.recompile_limit` to `graphs` when it is lower
    (dynamo has no per-function limit) and never lowers it."""
    limit = torch._dynamo.config.recompile_limit
    if limit < graphs:
        log.info("dsv4: raising torch._dynamo.config.recompile_limit from %d to %d (one graph per bucket and T)",
                 limit, graphs)
        torch._dynamo.config.recompile_limit = graphs
    return torch.compile(_step_with_own_code(module), backend=backend, fullgraph=True, dynamic=False)
