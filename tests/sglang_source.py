"""Run functions of the installed sglang package without importing their module.

Some SGLang modules cannot be imported on a CPU-only torch (their import chain needs a CUDA build
of torchvision). `load_functions` parses the installed module's file, keeps the requested
top-level functions plus the module-level assignments they read, compiles them with the
installed file's path as filename (tracebacks and dynamo point at SGLang's own source) and
executes them in a namespace holding torch. Nothing of SGLang's code is copied into this repo.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import sys
import types
import typing
from pathlib import Path

import torch
import torch.nn.functional as F


def installed_path(module: str) -> Path:
    """The file of `module` in the installed sglang package (without importing it)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)  # the top package only: its subpackages are not run
    if spec is None:
        raise ModuleNotFoundError(f"{top} is not installed")
    path = Path(spec.submodule_search_locations[0]).joinpath(*rest).with_suffix(".py")
    if not path.is_file():
        raise FileNotFoundError(f"{module}: no file {path}")
    return path


def _names_read(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def load_functions(module: str, names: tuple[str, ...], **namespace) -> types.SimpleNamespace:
    """The top-level functions `names` of the installed `module` (and the functions and simple
    module-level assignments they reach), executed with `torch`, `F`, the typing names and
    `namespace` as globals. Returns them as attributes, plus `__globals__` (their namespace)."""
    path = installed_path(module)
    tree = ast.parse(path.read_text(), filename=str(path))
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assigns = {t.id: n for n in tree.body if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Name)}
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in wanted or name in namespace:
            continue
        node = defs.get(name) or assigns.get(name)
        if node is None:
            continue  # a builtin or a name supplied below
        wanted.add(name)
        todo += _names_read(node)
    missing = [n for n in names if n not in defs]
    if missing:
        raise LookupError(f"{path} has no top-level function(s) {missing}")
    future = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    body = future + [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name in wanted)
            or (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id in wanted
                                                  for t in n.targets))]
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec")
    # A registered module object: dynamo looks a function's globals up by module name.
    holder = types.ModuleType("sglang_source__" + module.replace(".", "_"))
    holder.__file__ = str(path)
    sys.modules[holder.__name__] = holder
    scope = holder.__dict__
    scope.update(torch=torch, F=F, **{k: getattr(typing, k) for k in typing.__all__})
    scope.update(namespace)
    exec(code, scope)
    loaded = types.SimpleNamespace(**{n: scope[n] for n in names})
    loaded.__globals__ = scope
    return loaded


SGLANG_INDEXER = "sglang.srt.layers.attention.dsv4.indexer"


@functools.cache
def sglang_indexer_functions() -> types.SimpleNamespace:
    """SGLang 0.5.23's torch indexer fallback: the scorers `fp8_paged_mqa_logits_torch` and
    `fp8_paged_mqa_logits_torch_sm120` (the one SGLang picks on sm_120; scores [T, S] f32) and
    `topk_transform_pytorch_vectorized` (its torch top-k transform to physical slots).
    FP8_DTYPE is e4m3fn (CUDA; the module picks fnuz only on ROCm). Loaded once per process:
    dynamo keys a function's globals by module name, so a second copy would confuse its guards."""
    return load_functions(SGLANG_INDEXER, ("fp8_paged_mqa_logits_torch",
                                           "fp8_paged_mqa_logits_torch_sm120",
                                           "topk_transform_pytorch_vectorized"),
                          FP8_DTYPE=torch.float8_e4m3fn)
