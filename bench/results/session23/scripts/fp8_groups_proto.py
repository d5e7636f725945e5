"""Prototype: sparse MLA over FP8 rows with the 64-dim scale groups as the batch of 3-D dots.

The e4m3 values go to the dots undecoded (converted to bf16 in the dot operand), and each group's
ue8m0 scale multiplies the group's QK partial sums (over rows) and P before the group's PV dot, so
no dequantised tile is built. One pool, no split-K: compared with the library on the same input.
"""
import torch
import triton
import triton.language as tl

from dsv4_compile.kernels import sparse_mla as sm


@triton.jit
def fp8_groups_fwd(q_ptr, sqb, sqt, sqh, kv_ptr, rope_ptr, exp_ptr, s_row, s_rope_row, s_exp_row, num_rows,
                   idx_ptr, sib, sit, num_idx, sink_ptr, out_ptr, T, H, num_hb, qk_scale_log2,
                   H_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                   NOPE: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_STAGES: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, IDX_ASM: tl.constexpr, INTERPRETED: tl.constexpr):
    pid = tl.program_id(0)
    hb = pid % num_hb
    bt = (pid // num_hb).to(tl.int64)
    b = bt // T
    t = bt % T
    head = hb * H_BLOCK + tl.arange(0, H_BLOCK)
    head_ok = head < H
    g = tl.arange(0, GP)
    c = tl.arange(0, 64)
    qrow = q_ptr + b * sqb + t * sqt + head * sqh
    # q3t [GP, 64, H]: group g's 64 query dims by heads (the B operand of the transposed QK)
    q3t = tl.load(qrow[None, None, :] + (g[:, None, None] * 64 + c[None, :, None]),
                  mask=(g[:, None, None] < G) & head_ok[None, None, :], other=0.0).to(DOT_DTYPE)
    qr = tl.load(qrow[:, None] + NOPE + c[None, :], mask=head_ok[:, None] & (c[None, :] < ROPE),
                 other=0.0).to(DOT_DTYPE)
    acc3 = tl.zeros([GP, H_BLOCK, 64], tl.float32)
    accr = tl.zeros([H_BLOCK, 64], tl.float32)
    m_i = tl.full([H_BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([H_BLOCK], tl.float32)
    idx_row = idx_ptr + b * sib + t * sit
    n_tiles = tl.cdiv(num_idx, BLOCK_N)
    ASM: tl.constexpr = IDX_ASM and not INTERPRETED
    rows, ok = sm._tile_rows(idx_row, 1, 0, num_idx, num_rows, BLOCK_N, ASM)
    for i in tl.range(0, n_tiles, num_stages=NUM_STAGES):
        k8 = tl.load(kv_ptr + rows[None, :, None] * s_row + g[:, None, None] * 64 + c[None, None, :],
                     mask=ok[None, :, None] & (g[:, None, None] < G), other=0.0)
        kr = tl.load(rope_ptr + rows[:, None] * s_rope_row + c[None, :], mask=ok[:, None] & (c[None, :] < ROPE),
                     other=0.0).to(DOT_DTYPE)
        ex = tl.load(exp_ptr + rows[None, :] * s_exp_row + g[:, None], mask=ok[None, :] & (g[:, None] < G),
                     other=127)
        sc = tl.exp2(ex.to(tl.float32) - 127.0)  # [GP, BN]
        kb = k8.to(DOT_DTYPE)
        s3t = tl.dot(kb, q3t)  # [GP, BN, H]
        s = tl.trans(tl.sum(s3t * sc[:, :, None], axis=0)) + tl.dot(qr, tl.trans(kr))
        s = tl.where(ok[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p3 = (p[None, :, :] * sc[:, None, :]).to(DOT_DTYPE)
        acc3 = acc3 * alpha[None, :, None] + tl.dot(p3, kb)
        accr = accr * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), kr)
        m_i = m_new
        rows, ok = sm._tile_rows(idx_row, 1, (i + 1) * BLOCK_N, num_idx, num_rows, BLOCK_N, ASM)
    sink = tl.load(sink_ptr + head, mask=head_ok, other=float("-inf")) * 1.4426950408889634
    m_all = tl.maximum(m_i, sink)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    acc_w = tl.exp2(m_i - m_all)
    denom = l_i * acc_w + tl.exp2(sink - m_all)
    factor = tl.where(denom > 0, acc_w / tl.where(denom > 0, denom, 1.0), 0.0)
    orow = out_ptr + (bt * H + head) * HEAD_DIM
    tl.store(orow[None, :, None] + g[:, None, None] * 64 + c[None, None, :],
             (acc3 * factor[None, :, None]).to(out_ptr.dtype.element_ty),
             mask=head_ok[None, :, None] & (g[:, None, None] < G))
    tl.store(orow[:, None] + NOPE + c[None, :], (accr * factor[:, None]).to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & (c[None, :] < ROPE))


def launch(q, kv, kv_scale, idx, sink, scale, out, h_block=16, block_n=64, warps=4, stages=1, idx_asm=True):
    B, T, H, D = q.shape
    rope = kv.shape[1] - D
    nope = D - rope
    G = nope // 64
    e4m3 = kv.view(torch.float8_e4m3fn)
    rope_v = kv.view(torch.bfloat16)[:, nope // 2:]
    num_hb = triton.cdiv(H, h_block)
    interp = not q.is_cuda
    return fp8_groups_fwd[(B * T * num_hb,)](
        q, q.stride(0), q.stride(1), q.stride(2), e4m3, rope_v, kv_scale, kv.stride(0), rope_v.stride(0),
        kv_scale.stride(0), kv.shape[0], idx, idx.stride(0), idx.stride(1), idx.shape[2], sink, out, T, H, num_hb,
        float(scale) * 1.4426950408889634,
        H_BLOCK=h_block, BLOCK_N=block_n, G=G, GP=triton.next_power_of_2(G), NOPE=nope, ROPE=rope, HEAD_DIM=D,
        NUM_STAGES=stages, DOT_DTYPE=tl.float32 if interp else tl.bfloat16, IDX_ASM=idx_asm,
        INTERPRETED=interp, num_warps=warps, num_stages=stages)
