"""CPU cross-compile of the fp4_moe mma kernels with PDL (no GPU): PTX must have griddepcontrol and prefetch."""
import inspect, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import dsv4_compile.kernels.fp4_moe as m

def xc(kernel, consts, cap, pdl):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*i32"
        elif n == "LIMIT":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    for n in ("hidden_ptr", "x_ptr"):
        if n in sig: sig[n] = "*i32"
    sig["weights_ptr"] = "*fp32" if "weights_ptr" in sig else None
    sig = {k: v for k, v in sig.items() if v}
    if "pair_out_ptr" in sig: sig["pair_out_ptr"] = "*fp32"
    if "g13_ptr" in sig: sig["g13_ptr"] = "*u8"
    if "g2_ptr" in sig: sig["g2_ptr"] = "*u8"
    if "hidden_ptr" in sig and "x_ptr" in sig: sig["hidden_ptr"] = "*bf16"
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", cap, 32), options={"num_warps": 1, "num_stages": 1, "launch_pdl": pdl})

common = dict(IS_MX=True, GROUP=32, DOT_DTYPE=tl.bfloat16, BLOCK_M=8, BLOCK_N=int(sys.argv[1]) if len(sys.argv) > 1 else 32,
              BLOCK_K=128, NUM_WARPS=1, KPACK=2, PREFETCH=True, PACKED=True, COMPILED=True, TILED=True, K=4096, I=2048)
for cap in (90, 120):
    for steps in (-1, 0, 4, 16):
        d = xc(m._down_mma_kernel, dict(common, PDL_STEPS=steps), cap, steps >= 0)
        g = xc(m._gate_up_mma_kernel, dict(common, PDL_STEPS=steps, TOP_K=6, HAS_LIMIT=True), cap, False)
        p = d.asm["ptx"]
        print(cap, steps, "down: wait", p.count("griddepcontrol.wait"), "prefetch", p.count("prefetch.global.L2"),
              "shared", d.metadata.shared, "| gate_up launch_dependents", g.asm["ptx"].count("griddepcontrol.launch_dependents"))
