"""Test set-up: the Triton interpreter on CPU, and the Hypothesis profiles."""
import os

import torch

if not torch.cuda.is_available():
    # triton.jit reads this when the decorator runs, so it must be set before kernels import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
