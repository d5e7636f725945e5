"""FX-graph-cache safety: the uuid covers the pass sources and configuration, a second process
with the same configuration hits the cache with the same outputs and report, and a hit never
stands in for a compile whose passes differ."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
import torch
from torch._dynamo.utils import counters
import dsv4_compile
from dsv4_compile.model.hotspots import indexer_topk_full_context
from dsv4_compile.passes.manager import PassConfig

passes = tuple(sys.argv[1].split(",")) if sys.argv[1] else ()
backend = dsv4_compile.Dsv4Backend(PassConfig(passes=passes))
generator = torch.Generator().manual_seed(0)
q = torch.randn(2, 1, 4, 16, generator=generator)
weights = torch.randn(2, 1, 4, generator=generator)
k_pages = torch.randn(9, 64, 16, generator=generator)
page_table = torch.randperm(8, generator=generator).view(2, 4).int()
visible = torch.tensor([[100], [37]])
fn = torch.compile(lambda *a: indexer_topk_full_context(*a, 0.25, 8), backend=backend, fullgraph=True)
idx = fn(q, weights, k_pages, page_table, visible)
print(json.dumps({
    "hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
    "sets": [sorted(row) for row in idx.reshape(2, -1).tolist()],
    "matched": backend.report.count("indexer"),
}))
"""

INDEXER = "dsv4_compile.passes.indexer"


def _compile_in_new_process(cache_dir, passes: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TRITON_INTERPRET": "1"}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, passes], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("inductor_cache")
    return cache_dir, _compile_in_new_process(cache_dir, INDEXER)


def test_second_process_hits_the_cache_with_the_same_outputs_and_report(first):
    cache_dir, cold = first
    assert cold["miss"] >= 1 and cold["hit"] == 0 and cold["matched"] == 1
    warm = _compile_in_new_process(cache_dir, INDEXER)
    assert warm["hit"] >= 1 and warm["miss"] == 0
    assert warm["sets"] == cold["sets"]
    assert warm["matched"] == 1  # restored: the pass did not run on the hit


def test_a_different_pass_configuration_misses_the_cache(first):
    cache_dir, cold = first
    without = _compile_in_new_process(cache_dir, "")
    assert without["hit"] == 0 and without["miss"] >= 1 and without["matched"] == 0
    # And back: the configuration with the pass must not be served the pass-less code.
    again = _compile_in_new_process(cache_dir, INDEXER)
    assert again["matched"] == 1 and again["sets"] == cold["sets"]
