"""Engine.step on host inputs: one packed copy to the GPU on a side stream that the step waits for."""
import pytest
import torch

import dsv4_compile
from helpers import compile_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA: the uploads go through pinned memory and a CUDA side stream")


def _engines():
    model = compile_model(seed=4, device="cuda")
    make = lambda: dsv4_compile.optimize(model, max_batch=4, max_context=256, verify_tokens=3, compile=False)  # noqa: E731
    return make(), make()


@torch.no_grad()
def test_queued_host_steps_equal_device_steps():
    """Six steps queued on host inputs, the host tensors overwritten after each call and no host sync
    in between, against the same steps on device inputs in a second engine (its own caches). Odd
    sizes (B*T = 3 and 9) put the packed parts at padded offsets. The side stream sleeps (~5 ms)
    before each copy, so a step that did not wait for it would read its inputs unwritten."""
    engine, reference = _engines()
    engine._upload_stream = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(8)
    got, want = [], []
    for i, (batch, tokens) in enumerate([(3, 1), (3, 3), (4, 1), (1, 4), (3, 1), (2, 4)]):
        ids = torch.randint(0, engine.vocab_size, (batch, tokens), generator=gen)
        start = torch.randint(0, 200, (batch,), generator=gen)
        rows = torch.randperm(4, generator=gen)[:batch]
        want.append(reference.module(ids.cuda(), start.cuda(), rows.cuda()).float())
        with torch.cuda.stream(engine._upload_stream):
            torch.cuda._sleep(10_000_000)
        got.append(engine.step(ids, start, rows).float())
        for host in (ids, start, rows):
            host.fill_(-1 if i % 2 else 0)
    for g, w in zip(got, want, strict=True):
        # the same eager f32 kernels on the same values; only atomics' order may differ (~1e-6)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_upload_returns_the_host_values_in_their_shapes():
    engine, _ = _engines()
    host = [torch.arange(7).view(7, 1), torch.arange(10, 13), torch.arange(20, 29).view(3, 3)]
    uploaded = engine._to_device(*host)
    for h, u in zip(host, uploaded, strict=True):
        assert u.is_cuda and u.is_contiguous() and u.data_ptr() % 16 == 0 and torch.equal(u.cpu(), h)
