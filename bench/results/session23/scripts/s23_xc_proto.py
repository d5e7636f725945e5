import sys, types, torch, triton
import triton.language as tl
sys.path.insert(0, "bench"); sys.path.insert(0, "tmp_gpu")
import bench_sparse_mla as b
import fp8_groups_proto as P
case = b.Case("t", 2, 1, 64, "topk", "fp8", 512, window=0)
q, kv, ks, idx, _, _, _, sink, scale = b.make_inputs(case, torch.device("cpu"))
out = torch.empty_like(q)
B, T, H, D = q.shape
e4m3 = kv.view(torch.float8_e4m3fn); rope_v = kv.view(torch.bfloat16)[:, 224:]
for h, n, w, st in ([] if len(sys.argv) > 1 else [(16, 64, 4, 1), (16, 64, 8, 3), (16, 32, 8, 3), (16, 32, 4, 3)]):
    args = (q, q.stride(0), q.stride(1), q.stride(2), e4m3, rope_v, ks, kv.stride(0), rope_v.stride(0), ks.stride(0),
            kv.shape[0], idx, idx.stride(0), idx.stride(1), idx.shape[2], sink, out, T, H, 4, 0.1)
    meta = dict(H_BLOCK=h, BLOCK_N=n, G=7, GP=8, NOPE=448, ROPE=64, HEAD_DIM=512, NUM_STAGES=st, DOT_DTYPE=tl.bfloat16,
                IDX_ASM=True, INTERPRETED=False, num_warps=w, num_stages=st)
    launch = types.SimpleNamespace(kernel=P.fp8_groups_fwd, args=args, meta=meta)
    row = []
    for cap in (90, 120):
        try:
            s = b.compiled_stats(launch, cap)
            row.append(f"sm{cap}: shared {s['shared']:6d} regs {s['regs']:3d} spill {s['spill_stores']}/{s['spill_loads']}")
        except Exception as e:
            row.append(f"sm{cap}: FAIL {str(e)[-300:]}")
    print((h, n, w, st), " | ".join(row), flush=True)
if len(sys.argv) > 1:
    h, n, w, st = map(int, sys.argv[1:5])
    args = (q, q.stride(0), q.stride(1), q.stride(2), e4m3, rope_v, ks, kv.stride(0), rope_v.stride(0), ks.stride(0),
            kv.shape[0], idx, idx.stride(0), idx.stride(1), idx.shape[2], sink, out, T, H, 4, 0.1)
    meta = dict(H_BLOCK=h, BLOCK_N=n, G=7, GP=8, NOPE=448, ROPE=64, HEAD_DIM=512, NUM_STAGES=st, DOT_DTYPE=tl.bfloat16,
                IDX_ASM=True, INTERPRETED=False, num_warps=w, num_stages=st)
    k = b.cross_compile(types.SimpleNamespace(kernel=P.fp8_groups_fwd, args=args, meta=meta), 90)
    open("/tmp/proto.ttgir", "w").write(k.asm["ttgir"])
