"""SGLang plugin: `--enable-torch-compile` compiles DeepSeek-V4 with the dsv4 backend.

SGLang loads `register` from the `sglang.srt.plugins` entry-point group (see pyproject.toml).
It replaces `sglang.srt.compilation.torch_compile_decoration.patch_model`, the context manager
that SGLang's decode CUDA-graph runner enters for every capture size. For DeepSeek-V4 models the
replacement compiles with `Dsv4Backend(cudagraphs=False)` and `dynamic=False`: SGLang captures the
whole step in its own CUDA graph, and each capture size gets its own static graph. Every other
model goes to SGLang's original `patch_model`.

SGLang's forward takes 1-D input_ids [num_tokens], so the backend cannot read tokens per request
from its inputs; the compiled forward tells it the label of the ForwardBatch it is called with
(`sglang_graph_label`). In SGLang 0.5.23 only DecodeCudaGraphRunner._capture_one_stream (and the
subclasses that keep its compile_bs) enters patch_model with enable_compile, and its capture batch
has forward_mode = the runner's capture_forward_mode (DECODE, or TARGET_VERIFY / DLLM_EXTEND for
speculative / dLLM runners) and batch_size = bs, with bs * captured_req_width input tokens.

It also hooks SGLang's MoE quantization-method selection (`sglang_moe`): on sm_120, DeepSeek-V4's
FP4 experts (MXFP4, the MTP draft's included, and NVFP4) run `torch.ops.dsv4.fp4_moe`.

SGLang is imported only inside the functions here, so importing this module never needs it.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from contextlib import AbstractContextManager, contextmanager
from importlib import metadata
from typing import Any, Callable, Iterator

import torch

from dsv4_compile.backend import Dsv4Backend
from dsv4_compile.integrations.sglang_aranges import trace_sglang_aranges
from dsv4_compile.integrations.sglang_moe import register_moe_hooks

log = logging.getLogger("dsv4_compile")

SUPPORTED_SGLANG_VERSION = "0.5.23"
PATCH_MODEL_TARGET = "sglang.srt.compilation.torch_compile_decoration.patch_model"
SGLANG_INDEXER_MODULE = "sglang.srt.layers.attention.dsv4.indexer"
DISABLE_ENV = "DSV4_COMPILE_DISABLE"

# SGLang 0.5.23's DeepSeek-V4 model classes (the list its srt/configs/model_config.py
# is_deepseek_v4 checks); transformers' class has the first name.
DEEPSEEK_V4_CLASS_NAMES = frozenset(
    {"DeepseekV4ForCausalLM", "DeepseekV4ForCausalLMNextN", "DeepseekV4ForCausalLMDSpark"})
DEEPSEEK_V4_MODEL_TYPES = frozenset({"deepseek_v4", "deepseek_v41"})

active_backend: Dsv4Backend | None = None
"""The backend the plugin compiles DeepSeek-V4 with, once `register()` has activated it.
Its `report` lists the sites the dsv4 passes considered in SGLang's graphs."""


def plugin_disabled() -> bool:
    """True when DSV4_COMPILE_DISABLE=1; unset or "0" is False; any other value is a ValueError."""
    value = os.environ.get(DISABLE_ENV)
    if value is None or value == "0":
        return False
    if value == "1":
        return True
    raise ValueError(f"{DISABLE_ENV} must be unset, '0' (plugin on) or '1' (plugin off); got {value!r}")


def _installed_sglang_version() -> str | None:
    """The installed sglang distribution's version, or None when it is not installed."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def is_deepseek_v4(model: torch.nn.Module) -> bool:
    """Whether `model` is a DeepSeek-V4: by its class (or a base class) name, or its config's model_type."""
    if any(cls.__name__ in DEEPSEEK_V4_CLASS_NAMES for cls in type(model).__mro__):
        return True
    return getattr(getattr(model, "config", None), "model_type", None) in DEEPSEEK_V4_MODEL_TYPES


def sglang_graph_label(input_ids: torch.Tensor | None, forward_batch: Any) -> str:
    """The backend label of a graph SGLang captures for `forward_batch` (its ForwardBatch) with
    `input_ids` [num_tokens] int: 'T=1' for a decode batch (ForwardMode.DECODE, one token per
    request), 'T=<n>' for a target-verify batch of n tokens for each request, else ''."""
    if input_ids is None:  # a forward on input embeddings
        return ""
    tokens, requests = input_ids.shape[0], forward_batch.batch_size
    mode = forward_batch.forward_mode
    if mode.is_decode() and tokens == requests:
        return "T=1"
    # A ragged verify capture gives its requests different counts: then tokens != requests * n.
    per_request = getattr(forward_batch.spec_info, "num_tokens_per_req", -1)
    if mode.is_target_verify() and per_request > 0 and tokens == requests * per_request:
        return f"T={per_request}"
    return ""


def _labelled_forward(compiled: Callable, forward: Callable, backend: Dsv4Backend) -> Callable:
    """`compiled` (torch.compile of `forward`), compiling the graphs of a call that passes an SGLang
    ForwardBatch (`forward_batch`, as SGLang's models name it) under its `sglang_graph_label`."""
    signature = inspect.signature(forward)

    @functools.wraps(compiled)
    def labelled(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind_partial(*args, **kwargs).arguments
        if arguments.get("forward_batch") is None:
            return compiled(*args, **kwargs)
        with backend.graph_label(sglang_graph_label(arguments.get("input_ids"), arguments["forward_batch"])):
            return compiled(*args, **kwargs)

    return labelled


@contextmanager
def _compile_with_dsv4(model: torch.nn.Module, num_tokens: int, tp_group: Any,
                       backend: Dsv4Backend) -> Iterator[Callable]:
    """SGLang's patch_model contract for enable_compile=True, compiling with `backend`."""
    from sglang.srt.compilation import torch_compile_decoration

    indexer_module = sys.modules.get(SGLANG_INDEXER_MODULE)  # imported by the model, if it uses it
    if indexer_module is not None:
        trace_sglang_aranges(indexer_module)
    backup_ca_comm = tp_group.ca_comm
    try:
        # SGLang's own switch of its BaseFusedOp modules to their compile-safe forwards.
        torch_compile_decoration._to_torch(model, reverse=False, num_tokens=num_tokens)
        compiled = torch.compile(
            torch.no_grad()(model.forward),
            backend=backend,
            mode=os.environ.get("SGLANG_TORCH_COMPILE_MODE", "max-autotune-no-cudagraphs"),
            dynamic=False,
        )
        yield _labelled_forward(compiled, model.forward, backend)
    finally:
        torch_compile_decoration._to_torch(model, reverse=True, num_tokens=num_tokens)
        tp_group.ca_comm = backup_ca_comm


def make_patch_model(original: Callable[..., AbstractContextManager[Callable]],
                     backend: Dsv4Backend) -> Callable[..., AbstractContextManager[Callable]]:
    """A drop-in for SGLang's `patch_model(model, enable_compile, num_tokens, tp_group)`.

    Returns a context manager yielding the forward to capture: for a DeepSeek-V4 model with
    enable_compile, `model.forward` compiled with `backend`; otherwise whatever `original` yields.
    """

    def patch_model(model: torch.nn.Module, enable_compile: bool, num_tokens: int,
                    tp_group: Any) -> AbstractContextManager[Callable]:
        """DeepSeek-V4 with enable_compile on an NVIDIA GPU: the dsv4 backend; anything else
        (ROCm included: the kernels use NVIDIA PTX): SGLang's patch_model."""
        if enable_compile and torch.version.hip is None and is_deepseek_v4(model):
            return _compile_with_dsv4(model, num_tokens, tp_group, backend)
        return original(model, enable_compile, num_tokens, tp_group)

    return patch_model


def register() -> None:
    """The `sglang.srt.plugins` entry point: registers the patch_model replacement and the FP4
    MoE method hooks with SGLang.

    Registers nothing when DSV4_COMPILE_DISABLE=1, or when sglang is missing or is not 0.5.23
    (it logs why). Raises ValueError only for an unknown DSV4_COMPILE_DISABLE value.
    """
    global active_backend
    if plugin_disabled():
        log.info("dsv4_compile SGLang plugin disabled by %s=1", DISABLE_ENV)
        return
    version = _installed_sglang_version()
    if version != SUPPORTED_SGLANG_VERSION:
        found = "it is not installed" if version is None else f"found {version}"
        log.warning("dsv4_compile SGLang plugin inactive: it needs sglang==%s, %s; "
                    "SGLang's torch.compile is left unchanged", SUPPORTED_SGLANG_VERSION, found)
        return
    try:
        from sglang.srt.compilation import torch_compile_decoration
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError as error:
        log.warning("dsv4_compile SGLang plugin inactive: sglang %s cannot be imported (%s); "
                    "SGLang's torch.compile is left unchanged", version, error)
        return
    backend = Dsv4Backend(cudagraphs=False)
    replacement = make_patch_model(torch_compile_decoration.patch_model, backend)
    HookRegistry.register(PATCH_MODEL_TARGET, replacement, HookType.REPLACE)
    register_moe_hooks()
    active_backend = backend
    passes = ", ".join(backend.config.passes) or "none"
    log.info("dsv4_compile SGLang plugin active: --enable-torch-compile compiles DeepSeek-V4 with "
             "the dsv4 backend (passes: %s; dynamic=False; inductor CUDA graphs off); "
             "DeepSeek-V4 FP4 MoE on sm_120 runs dsv4::fp4_moe", passes)
