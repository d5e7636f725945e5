"""The SGLang plugin, against the real sglang==0.5.23 package (its plugin loader and HookRegistry).

A probe pass (this module: PASS_NAME + apply) is put into the plugin's backend; it runs inside
inductor's post-grad stage only when a graph is compiled by the dsv4 backend, and records what
it sees, so the tests can tell which backend compiled a graph.
"""
import importlib
import inspect
import logging
import sys
import types
from collections import defaultdict
from importlib.metadata import entry_points

import pytest
import torch
from torch import nn

# dsv4_compile before sglang: sglang imports transformers' hub-kernels check, which imports any
# top-level `kernels` package; run from the repository root, that is this repository's kernels/,
# and it imports dsv4_compile half-way through transformers' own import (a circular import).
from dsv4_compile.integrations import sglang as plugin
from dsv4_compile.integrations import sglang_moe
from dsv4_compile.passes.manager import PASS_MODULES, PassConfig
from dsv4_compile.tiny import FAST_COMPILE_OVERRIDES, TINY_CONFIG, tiny_model

pytest.importorskip("sglang", reason="needs sglang")

from sglang.kernels.fused_op import BaseFusedOp  # noqa: E402
from sglang.srt import plugins as sglang_plugins  # noqa: E402
from sglang.srt.compilation import torch_compile_decoration  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from test_sglang_moe import sg  # noqa: E402,F401  (fixture: SGLang's modules, imported without torchvision)

pytestmark = pytest.mark.sglang

PASS_NAME = "sglang_plugin_probe"
_PROBE_GRAPHS: list[dict] = []

# One layer of each kind the forward needs (attention + MoE): inductor's CPU codegen time grows
# with the graph, and this only has to show which backend compiled a real DeepSeek-V4 forward.
ONE_LAYER = {**FAST_COMPILE_OVERRIDES, "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
             "mlp_layer_types": ["moe"]}


def apply(graph: torch.fx.Graph, report) -> int:
    """Probe pass: records the integer inputs' shapes and inductor's cudagraphs flag."""
    values = [node.meta.get("val") for node in graph.nodes if node.op == "placeholder"]
    shapes = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor) and not v.is_floating_point()]
    _PROBE_GRAPHS.append({"int_input_shapes": shapes, "cudagraphs": torch._inductor.config.triton.cudagraphs})
    report.record(PASS_NAME, "graph", False, "probe only")
    return 0


class _DoubleOp(BaseFusedOp):
    """A real SGLang fused op, to see patch_model switch it to its compile-safe forward."""

    def forward_native(self, x):
        return 2 * x


class _TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _ConfigMarkedV4(nn.Module):
    """Not a DeepSeek-V4 class, but its config (a transformers DeepseekV4Config) says it is one."""

    def __init__(self):
        super().__init__()
        from transformers import DeepseekV4Config

        self.config = DeepseekV4Config(**TINY_CONFIG)
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, input_ids):
        return self.head(torch.relu(self.embed(input_ids)))


@pytest.fixture
def sglang_state(monkeypatch):
    """A process where SGLang has not loaded plugins yet; everything is restored afterwards."""
    monkeypatch.setattr(sglang_plugins, "_plugins_loaded", False)
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(torch_compile_decoration, "patch_model", torch_compile_decoration.patch_model)
    monkeypatch.setattr(plugin, "active_backend", None)
    # load_plugins() applies the plugin's MoE hooks to these classes too when their modules can be
    # imported (tests/test_sglang_moe.py imports them); put the originals back afterwards.
    for target in (sglang_moe.FP8_CONFIG_TARGET, sglang_moe.HYBRID_CONFIG_TARGET):
        module_name, class_name, method = target.rsplit(".", 2)
        if module_name in sys.modules:
            cls = getattr(sys.modules[module_name], class_name)
            monkeypatch.setattr(cls, method, cls.__dict__[method])
    for name in ("SGLANG_PLUGINS", "SGLANG_PLATFORM", plugin.DISABLE_ENV):
        monkeypatch.delenv(name, raising=False)
    # SGLang's default mode (max-autotune-no-cudagraphs) autotunes GEMM templates: slow on CPU.
    monkeypatch.setenv("SGLANG_TORCH_COMPILE_MODE", "default")
    torch._dynamo.reset()
    _PROBE_GRAPHS.clear()
    with torch._inductor.config.patch(force_disable_caches=True):  # a cache hit skips the probe
        yield
    torch._dynamo.reset()


def _load_plugins_with_probe():
    sglang_plugins.load_plugins()
    assert plugin.active_backend is not None
    plugin.active_backend.config = PassConfig(passes=(__name__,))
    return plugin.active_backend


def _tp_group():
    # The one attribute patch_model touches on SGLang's GroupCoordinator, which needs
    # torch.distributed set up to build.
    return types.SimpleNamespace(ca_comm=object())


def test_entry_point_is_declared_for_sglangs_plugin_group():
    ours = [ep for ep in entry_points(group=sglang_plugins.GENERAL_PLUGINS_GROUP) if ep.name == "dsv4_compile"]
    assert len(ours) == 1
    assert ours[0].value == "dsv4_compile.integrations.sglang:register"
    assert ours[0].load() is plugin.register


@pytest.mark.parametrize("disable", [None, "0"])
def test_load_plugins_replaces_patch_model_and_stale_imports(sglang_state, monkeypatch, caplog, disable):
    if disable is not None:
        monkeypatch.setenv(plugin.DISABLE_ENV, disable)
    original = torch_compile_decoration.patch_model
    stale = types.ModuleType("sglang_plugin_test_stale_importer")
    exec("from sglang.srt.compilation.torch_compile_decoration import patch_model", stale.__dict__)
    monkeypatch.setitem(sys.modules, stale.__name__, stale)
    caplog.set_level(logging.INFO, logger="dsv4_compile")

    sglang_plugins.load_plugins()

    replaced = torch_compile_decoration.patch_model
    assert replaced is not original
    assert replaced.__wrapped__ is original
    assert stale.patch_model is replaced
    assert isinstance(plugin.active_backend, plugin.Dsv4Backend)
    assert plugin.active_backend.cudagraphs is False
    active = [r.getMessage() for r in caplog.records if r.name == "dsv4_compile" and "active" in r.getMessage()]
    assert len(active) == 1
    assert f"passes: {', '.join(PASS_MODULES) or 'none'};" in active[0]


def test_other_models_keep_sglangs_own_compile(sglang_state):
    backend = _load_plugins_with_probe()
    model = _TinyMLP().eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    tp_group = _tp_group()
    ca_comm = tp_group.ca_comm
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    with torch_compile_decoration.patch_model(model, True, num_tokens=4, tp_group=tp_group) as forward:
        out = forward(x)

    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before + 1  # compiled ...
    assert _PROBE_GRAPHS == [] and backend.report.records == []  # ... but not by the dsv4 backend
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)  # fp32, a few reordered sums
    assert tp_group.ca_comm is ca_comm


@pytest.mark.parametrize("model_factory", [_TinyMLP, _ConfigMarkedV4])
def test_no_compile_yields_the_plain_forward(sglang_state, model_factory):
    _load_plugins_with_probe()
    model = model_factory()
    with torch_compile_decoration.patch_model(model, False, num_tokens=4, tp_group=_tp_group()) as forward:
        assert forward == model.forward
    assert _PROBE_GRAPHS == []


def test_deepseek_v4_detection():
    assert plugin.is_deepseek_v4(tiny_model(**ONE_LAYER))  # transformers DeepseekV4ForCausalLM
    assert plugin.is_deepseek_v4(_ConfigMarkedV4())
    assert not plugin.is_deepseek_v4(_TinyMLP())


def test_deepseek_v4_compiles_through_the_dsv4_backend(sglang_state):
    backend = _load_plugins_with_probe()
    model = tiny_model(**ONE_LAYER)
    fused_op = _DoubleOp()
    model.add_module("sglang_fused_op", fused_op)
    input_ids = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(input_ids=input_ids, use_cache=False).logits
    tp_group = _tp_group()
    ca_comm = tp_group.ca_comm

    with torch_compile_decoration.patch_model(model, True, num_tokens=2, tp_group=tp_group) as forward:
        assert fused_op.is_torch_compile and fused_op._forward_method == fused_op.forward_native
        compiled = forward(input_ids=input_ids, use_cache=False).logits

    assert not fused_op.is_torch_compile
    assert tp_group.ca_comm is ca_comm
    # fp32 on both sides; inductor only reorders reductions (observed error ~1e-6).
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert _PROBE_GRAPHS == [{"int_input_shapes": [(2, 1)], "cudagraphs": False}]
    assert [(r.pass_name, r.graph) for r in backend.report.records] == [(PASS_NAME, "T=1")]


def test_deepseek_v4_compile_makes_sglang_arange_cache_always_miss(sglang_state, monkeypatch):
    """SGLang's torch indexer keeps its slot aranges in the module dict `_arange_cache`; filled,
    it hides the slot numbers from the indexer pass. Entering patch_model for a DeepSeek-V4
    replaces it with a TracedArangeCache in the (already imported) SGLang indexer module."""
    from sglang_source import SGLANG_INDEXER, sglang_indexer_functions

    from dsv4_compile.integrations.sglang_aranges import TracedArangeCache

    _load_plugins_with_probe()
    indexer_module = sys.modules[sglang_indexer_functions().__globals__["__name__"]]  # SGLang's own source
    monkeypatch.setitem(sys.modules, SGLANG_INDEXER, indexer_module)
    monkeypatch.setattr(indexer_module, "_arange_cache", {("cpu", 64): torch.arange(64)}, raising=False)
    with torch_compile_decoration.patch_model(tiny_model(**ONE_LAYER), True, num_tokens=2, tp_group=_tp_group()):
        assert isinstance(indexer_module._arange_cache, TracedArangeCache)
        assert ("cpu", 64) not in indexer_module._arange_cache


def test_one_static_graph_per_capture_size(sglang_state):
    _load_plugins_with_probe()
    model = _ConfigMarkedV4().eval()
    input_ids = torch.randint(0, 32, (4,), generator=torch.Generator().manual_seed(2))
    for bs in (4, 2):  # SGLang captures from the largest size down, entering patch_model for each
        with torch_compile_decoration.patch_model(model, True, num_tokens=bs, tp_group=_tp_group()) as forward:
            torch.testing.assert_close(forward(input_ids[:bs]), model(input_ids[:bs]), rtol=1e-5, atol=1e-5)
    # dynamic=False: the second size is a new graph with concrete sizes, not a symbolic one.
    assert _PROBE_GRAPHS == [{"int_input_shapes": [(4,)], "cudagraphs": False},
                             {"int_input_shapes": [(2,)], "cudagraphs": False}]
    assert all(type(dim) is int for graph in _PROBE_GRAPHS for shape in graph["int_input_shapes"] for dim in shape)


def test_disable_registers_nothing(sglang_state, monkeypatch, caplog):
    monkeypatch.setenv(plugin.DISABLE_ENV, "1")
    original = torch_compile_decoration.patch_model
    caplog.set_level(logging.INFO, logger="dsv4_compile")

    sglang_plugins.load_plugins()

    assert torch_compile_decoration.patch_model is original
    for target in (plugin.PATCH_MODEL_TARGET, sglang_moe.FP8_CONFIG_TARGET, sglang_moe.HYBRID_CONFIG_TARGET):
        assert target not in HookRegistry._hooks
    assert plugin.active_backend is None
    assert any("disabled by DSV4_COMPILE_DISABLE=1" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value", ["yes", "true", "", "2"])
def test_unknown_disable_value_is_a_configuration_error(sglang_state, monkeypatch, caplog, value):
    monkeypatch.setenv(plugin.DISABLE_ENV, value)
    with pytest.raises(ValueError, match=r"DSV4_COMPILE_DISABLE must be unset, '0' .* or '1' .*got"):
        plugin.register()
    # Through SGLang's loader the error is logged with its traceback and nothing is patched.
    original = torch_compile_decoration.patch_model
    sglang_plugins.load_plugins()
    assert torch_compile_decoration.patch_model is original
    assert any(r.exc_info and isinstance(r.exc_info[1], ValueError) for r in caplog.records)


@pytest.mark.parametrize("version, message", [
    ("0.5.22", "needs sglang==0.5.23, found 0.5.22"),
    (None, "needs sglang==0.5.23, it is not installed"),
])
def test_other_sglang_version_is_left_untouched(sglang_state, monkeypatch, caplog, version, message):
    monkeypatch.setattr(plugin, "_installed_sglang_version", lambda: version)
    original = torch_compile_decoration.patch_model
    caplog.set_level(logging.INFO, logger="dsv4_compile")

    sglang_plugins.load_plugins()

    assert torch_compile_decoration.patch_model is original
    assert plugin.PATCH_MODEL_TARGET not in HookRegistry._hooks
    assert plugin.active_backend is None
    warnings = [r for r in caplog.records if r.name == "dsv4_compile" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and message in warnings[0].getMessage()


def test_rocm_keeps_sglangs_own_compile(monkeypatch):
    """On ROCm (HIP) a DeepSeek-V4 model keeps SGLang's patch_model: the dsv4 kernels use NVIDIA PTX."""
    calls = []
    patch_model = plugin.make_patch_model(lambda *args: calls.append(args) or "sglang's", backend=None)
    model = _ConfigMarkedV4()
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert patch_model(model, True, 4, None) == "sglang's" and len(calls) == 1


class _SGLangForwardV4(nn.Module):
    """A DeepSeek-V4 (by its config) with SGLang's model.forward signature: input_ids [num_tokens],
    positions [num_tokens] and a ForwardBatch."""

    def __init__(self):
        super().__init__()
        from transformers import DeepseekV4Config

        self.config = DeepseekV4Config(**TINY_CONFIG)
        self.embed = nn.Embedding(32, 8)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        return self.embed(input_ids) * positions[:, None]


def _capture_batch(sg, mode, requests, tokens, draft_tokens):
    """A ForwardBatch as SGLang's decode CUDA-graph runner builds one to capture (capture_prepare):
    its capture_forward_mode, batch_size = bs and, for target verify, an EagleVerifyInput."""
    fbi = sg.forward_batch
    spec_info = None if draft_tokens is None else sg.eagle_info.EagleVerifyInput(
        draft_token=None, custom_mask=None, positions=None, retrieve_index=None, retrieve_next_token=None,
        retrieve_next_sibling=None, retrieve_cum_len=None, spec_steps=1, topk=1, draft_token_num=draft_tokens,
        capture_hidden_mode=fbi.CaptureHiddenMode.FULL, seq_lens_sum=None, seq_lens_cpu=None)
    return fbi.ForwardBatch(
        forward_mode=getattr(fbi.ForwardMode, mode), batch_size=requests, input_ids=torch.zeros(tokens, dtype=torch.int64),
        req_pool_indices=torch.zeros(requests, dtype=torch.int64), seq_lens=torch.ones(requests, dtype=torch.int64),
        out_cache_loc=torch.zeros(tokens, dtype=torch.int64), seq_lens_sum=requests, spec_info=spec_info)


@pytest.mark.parametrize("mode, requests, tokens, draft_tokens, label", [
    ("DECODE", 4, 4, None, "T=1"),
    ("TARGET_VERIFY", 2, 8, 4, "T=4"),
    ("TARGET_VERIFY", 3, 8, 4, ""),  # a ragged verify capture: 8 tokens over 3 request slots
    ("DLLM_EXTEND", 2, 8, None, ""),
    ("EXTEND", 8, 8, None, ""),  # one token per request, but not a decode batch
])
def test_sglang_capture_batches_give_the_graph_label(sglang_state, sg, monkeypatch, mode, requests, tokens,
                                                     draft_tokens, label):
    """SGLang's forward has 1-D input_ids; the label comes from its ForwardBatch, and a decode graph
    (T=1) on CUDA gets DECODE_INDUCTOR_OPTIONS. (CUDA is simulated: the backend reads only the
    inputs' device; compile_fx records its options and runs the graph uncompiled.)"""
    compiles = []

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        compiles.append(config_patches)
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    monkeypatch.setattr(importlib.import_module("dsv4_compile.backend"), "_runs_on_cuda", lambda example_inputs: True)
    sglang_plugins.load_plugins()
    model = _SGLangForwardV4()
    batch = _capture_batch(sg, mode, requests, tokens, draft_tokens)
    positions = torch.arange(tokens)
    with torch_compile_decoration.patch_model(model, True, num_tokens=tokens, tp_group=_tp_group()) as forward:
        assert "input_embeds" in inspect.signature(forward).parameters  # SGLang's runner reads it
        out = forward(batch.input_ids, positions, batch)
    torch.testing.assert_close(out, model(batch.input_ids, positions, batch))
    (patches,) = compiles
    assert patches["post_grad_custom_post_pass"].graph_label == label
    assert patches.get("combo_kernels", False) is (label == "T=1")


def test_sglang_graph_label_without_input_ids(sg):
    batch = _capture_batch(sg, "DECODE", 4, 4, None)
    assert plugin.sglang_graph_label(None, batch) == ""
    assert plugin.sglang_graph_label(batch.input_ids, batch) == "T=1"
