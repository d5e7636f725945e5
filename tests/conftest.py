"""Test set-up: the Triton interpreter on CPU, and the Hypothesis profiles."""
import os

import torch

if not torch.cuda.is_available():
    # triton.jit reads this when the decorator runs, so it must be set before kernels import.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _round_bf16_casts_to_nearest_even() -> None:
    """Triton 3.6's interpreter truncates f32 -> bf16 casts (stores of f32 values into bf16 tensors
    among them), where compiled Triton rounds to nearest even, its default `fp_downcast_rounding`,
    and flushes bf16 subnormals to zero when it widens them to f32. Its casts between the two then
    take torch's conversion (rounding as the GPU does) and the exact widening, so that a kernel's
    bf16 results on CPU are the ones the GPU computes (`test_interpreter.py` pins these facts)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            widened = np.ascontiguousarray(src.data, dtype=np.uint16).astype(np.uint32) << 16
            return interpreter.TensorHandle(widened.view(np.float32), tl.float32)
        return truncating_cast(self, src, dst_type)

    cast_impl.truncating_cast = truncating_cast
    interpreter.InterpreterBuilder.cast_impl = cast_impl


if os.environ.get("TRITON_INTERPRET") == "1":
    _round_bf16_casts_to_nearest_even()

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=10, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def fresh_compile():
    """A clean dynamo state and no inductor caches, so that every compile runs the passes."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


@pytest.fixture
def fresh_inductor_cache(tmp_path, monkeypatch):
    """A private inductor cache directory, caches disabled and a clean dynamo state: a cache hit
    would skip the post-grad passes, so every compile of the test runs them."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
