"""Putting a dsv4 lowering into inductor's lowering table, once."""
from __future__ import annotations

from typing import Callable

from torch._inductor.lowering import lowerings, register_lowering

_installed: dict = {}  # op -> the wrapper register_lowering put in the table


def install_lowering(op, lower: Callable) -> None:
    """Register `lower` as inductor's lowering of `op` (an OpOverload); idempotent, and installs
    again if something replaced it in the table since."""
    current = _installed.get(op)
    if current is not None and lowerings.get(op) is current:
        return
    _installed[op] = register_lowering(op, type_promotion_kind=None)(lower)
