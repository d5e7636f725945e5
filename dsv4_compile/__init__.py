"""dsv4_compile: a torch.compile backend for DeepSeek-V4 decode and verify.

Importing the package registers the dsv4 custom ops; nothing else happens at import time.
"""
from dsv4_compile import kernels  # noqa: F401  (registers torch.ops.dsv4.*)
from dsv4_compile.backend import Dsv4Backend, backend
from dsv4_compile.engine import Engine, optimize

__all__ = ["Dsv4Backend", "Engine", "backend", "optimize"]
