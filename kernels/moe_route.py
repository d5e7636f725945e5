"""DeepSeek-V4 expert routing: `dsv4::moe_route` (the whole router, reference-only) and
`dsv4::route_topk` (its selection after the gate GEMM, a Triton kernel; what passes/moe_route.py
puts in compiled graphs).

The math follows transformers' DeepseekV4TopKRouter and DeepseekV4HashRouter (5.17):
  scores  = sqrt(softplus(hidden @ gate_weight^T))
  ids     = topk(scores + bias, top_k)            (top-k router; the bias only selects)
          = tid2eid[input_ids]                     (hash router)
  weights = scores[ids] / (sum(scores[ids]) + 1e-20) * routed_scaling
`moe_route` computes the logits in f32 (transformers uses the module dtype; the two agree for f32
models, and in bf16 only near-ties of the selection can differ). Inductor compiles its GEMM and
the pointwise scores well; the top-k and the weights after it were an aten top-k launch and two
pointwise launches per layer, which `route_topk` does in one launch.
"""
from __future__ import annotations

import math
from numbers import Integral, Real

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv4_compile.kernels._runtime import triton_runs_on

MAX_EXPERTS = 1024  # a row of scores stays in one program's registers
MAX_TOP_K = 16  # the kernel picks the top-k by k passes of a row-wide max
SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROWS_PER_PROGRAM = 4  # rows of scores a program selects for (a [4, E] tile on 4 warps)


def _check(hidden, gate_weight, bias, tid2eid, input_ids, top_k):
    if hidden.ndim != 2 or not hidden.dtype.is_floating_point:
        raise TypeError(f"moe_route: hidden must be [M, K] floating, got {tuple(hidden.shape)} {hidden.dtype}")
    if gate_weight.ndim != 2 or gate_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"moe_route: gate_weight must be [E, K={hidden.shape[1]}], got {tuple(gate_weight.shape)}")
    experts = gate_weight.shape[0]
    if not 1 <= top_k <= experts:
        raise ValueError(f"moe_route: top_k must be in [1, E={experts}], got {top_k}")
    if bias is not None and (tuple(bias.shape) != (experts,) or bias.dtype != torch.float32):
        raise TypeError(f"moe_route: bias must be [E={experts}] float32, got {tuple(bias.shape)} {bias.dtype}")
    if (tid2eid is None) != (input_ids is None):
        raise ValueError("moe_route: tid2eid and input_ids go together (hash routing) or are both None")
    if tid2eid is not None:
        if bias is not None:
            raise ValueError("moe_route: hash routing (tid2eid) takes no correction bias")
        if tid2eid.ndim != 2 or tid2eid.shape[1] != top_k:
            raise ValueError(f"moe_route: tid2eid must be [V, top_k={top_k}], got {tuple(tid2eid.shape)}")
        if tuple(input_ids.shape) != (hidden.shape[0],):
            raise ValueError(f"moe_route: input_ids must be [M={hidden.shape[0]}], got {tuple(input_ids.shape)}")
        for name, t in (("tid2eid", tid2eid), ("input_ids", input_ids)):
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise TypeError(f"moe_route: {name} must be an integer tensor, got {t.dtype}")


def _check_values(tid2eid, input_ids, experts: int, routed_scaling) -> None:
    """routed_scaling finite; eager, outside CUDA-graph capture (a host sync): hash routing's input_ids in
    [0, V) and the rows of tid2eid they pick in [0, E)."""
    if not isinstance(routed_scaling, Real) or not math.isfinite(routed_scaling):
        raise ValueError(f"moe_route: routed_scaling must be a finite float, got {routed_scaling!r}")
    if tid2eid is None or input_ids.numel() == 0 or (input_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    vocab = tid2eid.shape[0]
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"moe_route: input_ids must lie in [0, V={vocab}), got range "
                         f"[{int(input_ids.min())}, {int(input_ids.max())}]")
    picked = tid2eid[input_ids.long()]
    if int(picked.min()) < 0 or int(picked.max()) >= experts:
        raise ValueError(f"moe_route: the tid2eid rows of these input_ids must hold expert ids in [0, E={experts}), "
                         f"got range [{int(picked.min())}, {int(picked.max())}]")


def moe_route_reference(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    top_k: int,
    routed_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [M, K], gate_weight [E, K], bias [E] f32 | None, tid2eid [V, k] int | None,
    input_ids [M] int | None -> (topk_ids [M, k] int32, topk_weights [M, k] f32). Capture-safe."""
    scores = F.softplus(F.linear(hidden.float(), gate_weight.float())).sqrt()
    if tid2eid is None:
        select_bias = scores.new_zeros(scores.shape[1]) if bias is None else bias
        weights, ids = route_topk_reference(scores, select_bias, top_k, 1e-20, routed_scaling)
        return ids.to(torch.int32), weights
    ids = tid2eid[input_ids.long()].long()
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * routed_scaling


@torch.library.custom_op("dsv4::moe_route", mutates_args=())
def moe_route(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    top_k: int,
    routed_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert routing, see the module docstring. Runs the torch reference on every device."""
    _check(hidden, gate_weight, bias, tid2eid, input_ids, top_k)
    _check_values(tid2eid, input_ids, gate_weight.shape[0], routed_scaling)
    return moe_route_reference(hidden, gate_weight, bias, tid2eid, input_ids, top_k, routed_scaling)


@moe_route.register_fake
def _(hidden, gate_weight, bias, tid2eid, input_ids, top_k, routed_scaling):
    shape = (hidden.shape[0], top_k)
    return (hidden.new_empty(shape, dtype=torch.int32), hidden.new_empty(shape, dtype=torch.float32))


# --------------------------------------------------------------------------------------------
# route_topk: the selection after the gate GEMM
# --------------------------------------------------------------------------------------------
def route_topk_reference(scores: torch.Tensor, bias: torch.Tensor, top_k: int, eps: float,
                         scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [M, E] float, bias [E] float -> (weights [M, top_k] scores.dtype, ids [M, top_k]
    int64): ids = topk(scores + bias) (the sum in torch's promoted dtype of the two, as the model
    adds them; a NaN sum ranks below every number, where torch.topk ranks it first), weights =
    scores[ids] / (sum(scores[ids]) + eps) * scaling, computed in f32 and rounded once."""
    select = scores + bias
    select = torch.where(select.isnan(), float("-inf"), select)
    ids = torch.topk(select, top_k, dim=-1, sorted=False).indices
    picked = scores.gather(1, ids).float()
    weights = picked / (picked.sum(dim=-1, keepdim=True) + eps) * scaling
    return weights.to(scores.dtype), ids


@triton.jit
def _route_topk_kernel(s_ptr, bias_ptr, w_ptr, ids_ptr, M, E, stride_s, stride_b, eps, scaling,
                       TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
                       ROWS: tl.constexpr, SEL_DTYPE: tl.constexpr):
    """Rows [p * ROWS, (p + 1) * ROWS) of scores: top-k of scores + bias by TOP_K passes of a
    row-wide max (the lowest expert among equal maxima), then the normalised, scaled weights."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, BLOCK_E)
    row_ok = rows < M
    live = row_ok[:, None] & (e < E)[None, :]
    s = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_s + e[None, :], mask=live, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + e.to(tl.int64) * stride_b, mask=e < E, other=0.0).to(tl.float32)
    select = (s + b[None, :]).to(SEL_DTYPE).to(tl.float32)  # rounded as the model's add rounds
    select = tl.where(select == select, select, -float("inf"))  # NaN never wins (and never repeats)
    avail = live
    slot = tl.arange(0, K_PAD)
    ids = tl.zeros((ROWS, K_PAD), tl.int32)
    picked = tl.zeros((ROWS, K_PAD), tl.float32)
    for j in tl.static_range(TOP_K):
        candidates = tl.where(avail, select, -float("inf"))
        best = tl.max(candidates, axis=1)
        first = tl.min(tl.where(avail & (candidates == best[:, None]), e[None, :], BLOCK_E), axis=1)
        chosen = e[None, :] == first[:, None]
        avail = avail & ~chosen
        ids = tl.where(slot[None, :] == j, first[:, None], ids)
        picked = tl.where(slot[None, :] == j, tl.sum(tl.where(chosen, s, 0.0), axis=1)[:, None], picked)
    total = tl.sum(picked, axis=1)  # the unused K_PAD slots hold 0
    weights = tl.div_rn(picked, total[:, None] + eps) * scaling  # torch's f32 division is correctly rounded
    out = rows[:, None].to(tl.int64) * TOP_K + slot[None, :]
    keep = row_ok[:, None] & (slot < TOP_K)[None, :]
    tl.store(w_ptr + out, weights.to(w_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=keep)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def route_topk_triton(scores: torch.Tensor, bias: torch.Tensor, top_k: int, eps: float, scaling: float, *,
                      weights: torch.Tensor | None = None,
                      ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel on checked arguments (as `route_topk`); `weights` and `ids` may be a
    caller's contiguous [M, top_k] tensors (scores.dtype, int64) to write into."""
    rows, experts = scores.shape
    if weights is None:
        weights = scores.new_empty((rows, top_k))
    if ids is None:
        ids = scores.new_empty((rows, top_k), dtype=torch.int64)
    for name, t, dtype in (("weights", weights, scores.dtype), ("ids", ids, torch.int64)):
        if t.shape != (rows, top_k) or t.dtype != dtype or not t.is_contiguous() or t.device != scores.device:
            raise ValueError(f"route_topk: {name} must be a contiguous [{rows}, {top_k}] {dtype} tensor on "
                             f"{scores.device}, got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
    if rows == 0:
        return weights, ids
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    sel_dtype = torch.promote_types(scores.dtype, bias.dtype)
    _route_topk_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
        scores, bias, weights, ids, rows, experts, scores.stride(0), bias.stride(0), float(eps), float(scaling),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(experts),
        ROWS=ROWS_PER_PROGRAM, SEL_DTYPE=_TL_DTYPES[sel_dtype], num_warps=4)
    return weights, ids


def check_route_topk_args(scores, bias, top_k, eps, scaling) -> None:
    """ValueError / TypeError naming the argument that the op does not take."""
    for name, t in (("scores", scores), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"route_topk: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in SCORE_DTYPES:
            raise TypeError(f"route_topk: {name} must be one of {SCORE_DTYPES}, got {t.dtype}")
    if scores.dim() != 2 or not 1 <= scores.shape[1] <= MAX_EXPERTS:
        raise ValueError(f"route_topk: scores must be [M, E] with 1 <= E <= {MAX_EXPERTS}, got {tuple(scores.shape)}")
    if tuple(bias.shape) != (scores.shape[1],) or bias.device != scores.device:
        raise ValueError(f"route_topk: bias must be [E={scores.shape[1]}] on {scores.device}, "
                         f"got {tuple(bias.shape)} on {bias.device}")
    if isinstance(top_k, bool) or not isinstance(top_k, Integral) or not 1 <= top_k <= min(MAX_TOP_K, scores.shape[1]):
        raise ValueError(f"route_topk: top_k must be an int in [1, min({MAX_TOP_K}, E={scores.shape[1]})], "
                         f"got {top_k!r}")
    for name, value in (("eps", eps), ("scaling", scaling)):
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
            raise ValueError(f"route_topk: {name} must be a finite float, got {value!r}")


@torch.library.custom_op("dsv4::route_topk", mutates_args=())
def route_topk(scores: torch.Tensor, bias: torch.Tensor, top_k: int, eps: float,
               scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k router's selection and weights after its gate GEMM.

    scores [M, E] f32/bf16/f16 (E <= 1024), bias [E] f32/bf16/f16, 1 <= top_k <= min(16, E),
    eps and scaling finite. Returns (weights [M, top_k] scores.dtype, ids [M, top_k] int64), ids in
    no particular order: `route_topk_reference` (ties between equal sums may pick other experts; a
    NaN sum is picked only after every number). Static grid, no host syncs (CUDA-graph safe).
    """
    check_route_topk_args(scores, bias, top_k, eps, scaling)
    if triton_runs_on(scores):
        return route_topk_triton(scores, bias, top_k, eps, scaling)
    return route_topk_reference(scores, bias, top_k, eps, scaling)


@route_topk.register_fake
def _route_topk_fake(scores, bias, top_k, eps, scaling):
    check_route_topk_args(scores, bias, top_k, eps, scaling)
    rows = scores.shape[0]
    return scores.new_empty((rows, top_k)), scores.new_empty((rows, top_k), dtype=torch.int64)
