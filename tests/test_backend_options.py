"""Dsv4Backend's inductor options: its defaults reach compile_fx, and mode / options override them."""
import importlib

import pytest
import torch
import torch._inductor.compile_fx

import dsv4_compile
from dsv4_compile.backend import (DECODE_INDUCTOR_OPTIONS, DEFAULT_INDUCTOR_OPTIONS, UNSUPPORTED_INDUCTOR_OPTIONS,
                                  Dsv4Backend, _graph_options)
from dsv4_compile.passes.manager import PassConfig


@pytest.fixture
def captured(monkeypatch):
    """The config_patches each compile_fx call receives (the graph itself runs uncompiled)."""
    calls = []

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        calls.append(dict(config_patches))
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    return calls


def _compile(backend, **kwargs):
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    return backend(gm, [torch.randn(4)], **kwargs)


def test_defaults_are_real_inductor_options():
    config = torch._inductor.config
    for key in {**DEFAULT_INDUCTOR_OPTIONS, **DECODE_INDUCTOR_OPTIONS}:
        section, _, name = key.rpartition(".")
        assert hasattr(getattr(config, section) if section else config, name), key


@pytest.mark.parametrize("kwargs, pointwise", [({}, False), ({"mode": "max-autotune"}, False),
                                               ({"options": {"triton.autotune_pointwise": True}}, True)])
def test_pointwise_autotuning_off_unless_overridden(captured, kwargs, pointwise):
    _compile(Dsv4Backend(PassConfig(passes=())), **kwargs)
    (patches,) = captured
    assert patches["triton.autotune_pointwise"] is pointwise
    assert "post_grad_custom_post_pass" in patches
    if kwargs.get("mode") == "max-autotune":
        assert patches["max_autotune"] is True


@pytest.mark.parametrize("mode", ["max-autotune", "max-autotune-no-cudagraphs"])
def test_mode_loses_coordinate_descent_tuning_with_a_warning(captured, caplog, mode):
    """The modes that imply coordinate descent tuning keep their other options and lose that one,
    as does inductor's global config (the backend's default patch overrides it)."""
    with torch._inductor.config.patch(coordinate_descent_tuning=True):
        _compile(Dsv4Backend(PassConfig(passes=())))
    backend = Dsv4Backend(PassConfig(passes=()))
    with caplog.at_level("WARNING", logger="dsv4_compile"):
        _compile(backend, mode=mode)
        _compile(backend, mode=mode)  # SGLang compiles a graph per batch size: one warning
    default, moded, again = captured
    assert UNSUPPORTED_INDUCTOR_OPTIONS == ("coordinate_descent_tuning",)
    assert default["coordinate_descent_tuning"] is False
    for patches in (moded, again):
        assert patches["coordinate_descent_tuning"] is False and patches["max_autotune"] is True
    warnings = [r.getMessage() for r in caplog.records if "coordinate_descent_tuning" in r.getMessage()]
    assert len(warnings) == 1 and mode in warnings[0]


def test_options_asking_for_coordinate_descent_tuning_raise(captured):
    backend = Dsv4Backend(PassConfig(passes=()))
    with pytest.raises(ValueError, match="coordinate_descent_tuning"):
        _compile(backend, options={"coordinate_descent_tuning": True})
    _compile(backend, options={"coordinate_descent_tuning": False})
    assert len(captured) == 1 and captured[0]["coordinate_descent_tuning"] is False


def test_mode_with_coordinate_descent_tuning_turned_off_by_options_does_not_warn(captured, caplog):
    with caplog.at_level("WARNING", logger="dsv4_compile"):
        _compile(Dsv4Backend(PassConfig(passes=())), mode="max-autotune",
                 options={"coordinate_descent_tuning": False})
    (patches,) = captured
    assert patches["coordinate_descent_tuning"] is False and patches["max_autotune"] is True
    assert "coordinate_descent_tuning" not in caplog.text


def test_module_backend_compiles_with_the_defaults():
    """The options are accepted by the real compile_fx (CPU inductor) and the result is unchanged."""
    x = torch.randn(8)
    compiled = torch.compile(lambda t: torch.sigmoid(t) * 2, backend=dsv4_compile.Dsv4Backend(), fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.sigmoid(x) * 2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("tokens, on_cuda, combo", [(1, True, True), (4, True, False), (1, False, False)])
def test_combo_kernels_for_decode_graphs_on_cuda_only(captured, monkeypatch, tokens, on_cuda, combo):
    """A CUDA graph whose first 2-D integer input is [B, 1] (the step's input_ids at decode) gets
    combo kernels; verify graphs (T=4), CPU graphs and graphs without such an input keep inductor's
    default; `options` override it. (CUDA inputs are simulated: the check reads only their device.)"""
    # the module itself: the package's attribute `backend` is a Dsv4Backend instance
    backend_module = importlib.import_module("dsv4_compile.backend")
    monkeypatch.setattr(backend_module, "_runs_on_cuda", lambda example_inputs: on_cuda)
    gm = torch.fx.symbolic_trace(lambda ids, x: x + ids.sum())
    backend = Dsv4Backend(PassConfig(passes=()))
    backend(gm, [torch.zeros(8, tokens, dtype=torch.int64), torch.randn(4)])
    backend(gm, [torch.zeros(8, 1, dtype=torch.int64), torch.randn(4)], options={"combo_kernels": False})
    _compile(backend)
    decode, overridden, plain = captured
    assert decode.get("combo_kernels", False) is combo
    assert overridden["combo_kernels"] is False
    assert "combo_kernels" not in plain


def test_cpu_and_meta_inputs_do_not_count_as_cuda():
    from dsv4_compile.backend import _runs_on_cuda

    assert not _runs_on_cuda([torch.zeros(2, 1, dtype=torch.int64), 3, torch.randn(4)])
    assert not _runs_on_cuda([torch.empty(2, device="meta")])


@pytest.mark.parametrize("label, on_cuda, decode", [("T=1", True, True), ("T=1", False, False), ("T=4", True, False),
                                                    ("", True, False)])
def test_graph_options_add_decode_options_for_t1_on_cuda(label, on_cuda, decode):
    options = _graph_options(label, on_cuda)
    assert options == ({**DEFAULT_INDUCTOR_OPTIONS, **DECODE_INDUCTOR_OPTIONS} if decode else DEFAULT_INDUCTOR_OPTIONS)


def test_told_label_replaces_the_one_read_from_inputs(captured, monkeypatch):
    """Inside `graph_label` a graph takes the told label, '' included (a [B, 1] integer input is then
    not read as token ids); outside, the label is read from the inputs again."""
    monkeypatch.setattr(importlib.import_module("dsv4_compile.backend"), "_runs_on_cuda", lambda example_inputs: True)
    gm = torch.fx.symbolic_trace(lambda ids, x: x + ids.sum())
    backend = Dsv4Backend(PassConfig(passes=()))
    one_d, two_d = [torch.zeros(8, dtype=torch.int64), torch.randn(4)], [torch.zeros(8, 1, dtype=torch.int64), torch.randn(4)]
    with backend.graph_label("T=1"):
        backend(gm, one_d)
        with backend.graph_label(""):
            backend(gm, two_d)
        backend(gm, one_d)
    backend(gm, two_d)
    labels = [(p["post_grad_custom_post_pass"].graph_label, p.get("combo_kernels", False)) for p in captured]
    assert labels == [("T=1", True), ("", False), ("T=1", True), ("T=1", True)]
