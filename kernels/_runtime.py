"""Decides where a dsv4 op runs: compiled Triton on CUDA, the Triton interpreter on CPU when
TRITON_INTERPRET=1 (CI), and the torch reference otherwise; the launch limits the kernels share;
and programmatic dependent launch (PDL) between an op's own kernels.

PDL (sm_90 and newer): a kernel launched with `launch_pdl` may start its programs before the
kernel before it has finished; it calls `wait_for_producers` before it writes and before it reads
anything an earlier kernel wrote. (One exception: the FP4 MoE's down kernel reads its block table
and first weights before its wait; its docstring says why that is safe.) A kernel lets its own
dependents launch only after its wait (or its ready count, below), or, launched plainly, at its
start. When it does (`gdc_launch_dependents`), they take SM slots as its last programs finish. On the H200 that paid
off before a kernel that reads static data ahead of its wait (the FP4 MoE's down projection reads
its first weights) or before a small grid (the split-K combine), and cost 1-10 us before a grid
whose programs need an even spread over the SMs (the indexer's selection, the sparse MLA tile
after staging; bench/RESULTS.md, twenty-seventh session): those kernels' predecessors do not let
them launch early, and they only save the launch latency.

Ready counts refine the wait where a consumer program needs only some of the producer's programs:
each producer program adds 1 to its count once its stores are issued (`count_done`, a release at GPU
scope), and a consumer program spins until its count is complete (`await_count`, an acquire) instead
of waiting for the whole producer grid. A consumer launched early with PDL starts only once every
producer program has passed its own wait, so every program it spins on is already resident: the spin
cannot starve them of SM slots. The consumer still waits for the producer grid before it ends, so
that kernels after it may rely on both having finished.
"""
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis

# A kernel's PDL constexpr: launched plainly; launched with PDL, it waits for its producers; or it
# waits, then lets its own dependents launch.
PDL_OFF, PDL_WAIT, PDL_WAIT_RELEASE = 0, 1, 2
_OFF, _WAIT_RELEASE = tl.constexpr(PDL_OFF), tl.constexpr(PDL_WAIT_RELEASE)


def _pdl_from_environment() -> bool:
    """DSV4_PDL: unset or 1 takes programmatic dependent launch where the GPU has it, 0 turns it off."""
    value = os.environ.get("DSV4_PDL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"DSV4_PDL must be unset, 0 or 1, got {value!r}")
    return value == "1"


_pdl_wanted = _pdl_from_environment()


def triton_runs_on(t: torch.Tensor) -> bool:
    """True when a Triton kernel can launch on the device of `t`."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def device_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of `t`'s CUDA device, None off CUDA."""
    return tuple(torch.cuda.get_device_capability(t.device)) if t.is_cuda else None


def set_pdl(enabled: bool) -> None:
    """Turns programmatic dependent launch between the ops' kernels on or off for launches from now
    on (benches compare both; a captured CUDA graph keeps what it was captured with)."""
    global _pdl_wanted
    _pdl_wanted = bool(enabled)


def uses_pdl(t: torch.Tensor) -> bool:
    """True when kernels for tensors on `t`'s device take programmatic dependent launch: an NVIDIA
    GPU of compute capability 9.0 or newer (ROCm's capabilities are AMD's own), and PDL not turned off."""
    return (_pdl_wanted and t.is_cuda and torch.version.hip is None
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


def pdl_launch(t: torch.Tensor, release: bool) -> dict:
    """Launch keywords of a kernel that follows one of the op's own kernels on `t`'s device: with
    PDL, `launch_pdl` and its PDL constexpr (PDL_WAIT_RELEASE when `release`: its dependents may
    launch once all its programs have passed their wait); else PDL_OFF."""
    if not uses_pdl(t):
        return {"PDL": PDL_OFF}
    return {"launch_pdl": True, "PDL": PDL_WAIT_RELEASE if release else PDL_WAIT}


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """PDL_WAIT / PDL_WAIT_RELEASE: blocks until the kernels launched before this one have finished
    and their writes are visible; PDL_WAIT_RELEASE then lets the next kernel's programs launch."""
    wait_without_release(PDL)
    release_in_mode(PDL)


@triton.jit
def wait_without_release(PDL: tl.constexpr):
    """The wait of `wait_for_producers` alone (PDL_WAIT or PDL_WAIT_RELEASE)."""
    if PDL != _OFF:
        gdc_wait()


@triton.jit
def release_in_mode(PDL: tl.constexpr):
    """The release of `wait_for_producers` alone (PDL_WAIT_RELEASE), for a kernel that waits later."""
    if PDL == _WAIT_RELEASE:
        gdc_launch_dependents()


@triton.jit
def count_done(count_ptr):
    """Adds 1 to the int32 at count_ptr once every thread of the program has issued its stores
    (barrier, then thread 0's release at GPU scope): a program that sees the count sees the stores."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


@triton.jit
def await_count(count_ptr, TARGET: tl.constexpr, COMPILED: tl.constexpr, RELAXED: tl.constexpr):
    """Spins until the int32 at count_ptr reaches TARGET (`count_done`'s acquire side; Triton turns
    the add of 0 into an acquire load and hands its result to every thread through a barrier).
    Returns whether the count equals TARGET. The interpreter runs grids one after another, so there
    the count is read once, complete unless the producers counted wrong: the caller can then make its
    output show it (the interpreter ignores tl.device_assert).

    RELAXED: once a first acquire finds the count short, spin on volatile loads (from L2) and acquire
    once the count is complete, instead of an acquire load a turn: each acquire load invalidates the
    SM's L1 (`CCTL.IVALL` on sm_90), also for the producer programs that share the SM."""
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    if COMPILED:
        if RELAXED:
            if seen < TARGET:
                while seen < TARGET:
                    _nap(seen)
                    seen = tl.load(count_ptr, volatile=True)
                seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        else:
            while seen < TARGET:
                _nap(seen)
                seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    return seen == TARGET


@triton.jit
def _nap(seen):
    """About 100 ns of sleep between two reads of a count (`seen` orders it after the last read)."""
    tl.inline_asm_elementwise("nanosleep.u32 100; mov.u32 $0, 0;", "=r,r", [seen], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def release_dependents(RELEASE: tl.constexpr):
    """For a first kernel (launched plainly), RELEASE where PDL is on: lets the next kernel's
    programs launch now; they wait for this kernel's end before they read its output."""
    if RELEASE:
        gdc_launch_dependents()
