"""Decides where a dsv4 op runs: compiled Triton on CUDA, the Triton interpreter on CPU when
TRITON_INTERPRET=1 (CI), and the torch reference otherwise; and the launch limits the kernels share."""
import os

import torch

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis


def triton_runs_on(t: torch.Tensor) -> bool:
    """True when a Triton kernel can launch on the device of `t`."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
