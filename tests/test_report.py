"""engine.report / site_status: expected sites per layer and graph, strict mode, warnings, and
reports that survive an FX-cache hit (on which the passes do not run)."""
import logging

import pytest

import dsv4_compile
from dsv4_compile.tiny import tiny_model

SLIDING, CSA = "sliding_attention", "compressed_sparse_attention"


@pytest.fixture(scope="module")
def model():
    # index_topk 4096 > 2048: the indexer pass must decline the CSA layer and say why.
    return tiny_model(seed=5, num_hidden_layers=2, layer_types=[SLIDING, CSA],
                      mlp_layer_types=["hash_moe", "moe"], hc_sinkhorn_iters=2, index_topk=4096)


def test_unmatched_site_warns_and_strict_raises_also_after_a_cache_hit(model, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    engine = dsv4_compile.optimize(model, max_batch=1, max_context=16384)
    with caplog.at_level(logging.WARNING, logger="dsv4_compile"):
        engine.generate([[1, 2, 3]], 2)
    assert engine.expected_sites() == [("sparse_mla", 0), ("hc_sinkhorn", 0), ("hc_sinkhorn", 0), ("sparse_mla", 1),
                                       ("indexer", 1), ("moe_route", 1), ("hc_sinkhorn", 1), ("hc_sinkhorn", 1)]
    assert [r.matched for r in engine.site_status() if r.pass_name == "hc_sinkhorn"] == [True] * 4
    status = {(r.pass_name, r.layer): r for r in engine.site_status()}
    assert status["sparse_mla", 0].matched and status["sparse_mla", 1].matched
    assert status["moe_route", 1].matched  # the top-k router (layer 0 routes by hash)
    assert not status["indexer", 1].matched and "topk 4096 > 2048" in status["indexer", 1].reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["dsv4: indexer not applied at layer 1 in graph T=1: topk 4096 > 2048"]

    strict = dsv4_compile.optimize(model, max_batch=1, max_context=16384, strict=True)
    with pytest.raises(RuntimeError, match=r"strict=True: 1 expected dsv4 site\(s\) unmatched in graph T=1: "
                                           r"indexer at layer 1: topk 4096 > 2048"):
        strict.generate([[1, 2, 3]], 2)
    # The second engine compiled the same graph: the report came back from the cache side file.
    assert strict.report.count("sparse_mla", "T=1") == 2


def test_a_layer_needs_as_many_matches_as_it_lists():
    """Two expected mHC Sinkhorn sites in one layer: one matched record leaves the other unmatched,
    with the decline's reason."""
    from dsv4_compile.passes.report import PassReport, SiteRecord

    report = PassReport()
    report.extend([SiteRecord("hc_sinkhorn", "attn", True, "", "T=1", 3),
                   SiteRecord("hc_sinkhorn", "ffn", False, "the steps use different eps", "T=1", 3)])
    rows = report.status([("hc_sinkhorn", 3), ("hc_sinkhorn", 3)], "T=1")
    assert [(r.matched, r.reason) for r in rows] == [(True, ""), (False, "the steps use different eps")]
    rows = report.status([("hc_sinkhorn", 3)], "T=1")
    assert [r.matched for r in rows] == [True]
