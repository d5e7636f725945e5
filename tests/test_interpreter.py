"""The test harness's Triton interpreter (conftest): f32 -> bf16 casts round to nearest even and
bf16 -> f32 casts keep subnormals, as compiled Triton's do, where Triton 3.6's own interpreter
truncates the first and flushes the second."""
import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the interpreter runs only without CUDA (conftest)")


@triton.jit
def _bf16_round_trip(x_ptr, cast_ptr, stored_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(cast_ptr + i, x.to(tl.bfloat16).to(tl.float32), mask=i < n)
    tl.store(stored_ptr + i, x, mask=i < n)  # a bf16 tensor: the store casts


def test_f32_to_bf16_rounds_to_nearest_even():
    gen = torch.Generator().manual_seed(0)
    # random values, exact halfway cases both ways (ties to even), a carry into the exponent,
    # signed zeros, subnormals, infinities and values past bf16's largest
    special = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, 2 - 2.0**-9, -2.2744140625, 0.0, -0.0,
                            1e-40, float("inf"), float("-inf"), 3.4e38])
    x = torch.cat([torch.randn(246, generator=gen) * 10.0 ** torch.randint(-30, 30, (246,), generator=gen),
                   special])
    cast, stored = torch.full_like(x, float("nan")), torch.full(x.shape, float("nan"), dtype=torch.bfloat16)
    _bf16_round_trip[(1,)](x, cast, stored, x.numel(), BLOCK=256)
    want = x.to(torch.bfloat16)
    assert torch.equal(cast.view(torch.int32), want.float().view(torch.int32))  # -0.0 kept apart from 0.0
    assert torch.equal(stored.view(torch.int16), want.view(torch.int16))


def test_the_unpatched_interpreter_truncates_and_flushes():
    """Why conftest patches the casts."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl.truncating_cast
    src = interpreter.TensorHandle(np.array([1 + 2.0**-8 + 2.0**-12], dtype=np.float32), tl.float32)
    bits = original(None, src, tl.bfloat16).data.view(np.uint16)
    assert float(torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)) == 1.0  # nearest: 1 + 2^-7
    subnormal = torch.tensor([1e-40]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    widened = original(None, interpreter.TensorHandle(subnormal, tl.bfloat16), tl.float32).data
    assert float(widened[0]) == 0.0  # exactly: 9.18e-41
