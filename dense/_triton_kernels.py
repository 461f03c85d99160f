"""The Triton kernels of triton_hstu.py (imported only when they run: Triton is optional).

Definitions only; the launch, the autograd wiring and the documentation of the maths are in
triton_hstu.py.
"""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """a @ b with fp32 accumulation. F32: operands widened first (the interpreter's bf16 dot
    is wrong; widening bf16 values is exact, so only the summation order differs)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _tile(q, k, pos_i, qts_i, offs_m, offs_n, L, hist, pos_j, ts_j, TSW, POSW, THR,
          alpha, inv_div, P, NB, HAS_TS: tl.constexpr, HAS_POS: tl.constexpr, F32: tl.constexpr):
    """Logits s [BM, BN] (fp32, bias included), visibility, and the bias indices."""
    s = _dot(q, tl.trans(k), F32) * alpha
    i, j = offs_m[:, None], offs_n[None, :]
    vis = (j <= i) & ((j < hist) | (j == i)) & (i < L) & (j < L)
    rel = tl.zeros_like(i - j)
    if HAS_POS:
        rel = tl.minimum(tl.maximum(pos_i[:, None] - pos_j[None, :], 0), P - 1)
        s += tl.load(POSW + rel, mask=vis, other=0.0)
    bkt = tl.zeros_like(i - j)
    if HAS_TS:
        x = tl.abs(qts_i[:, None] - ts_j[None, :])
        x = tl.maximum(x, 1)
        b = (tl.log(x.to(tl.float32)) * inv_div).to(tl.int64)
        b = tl.minimum(tl.maximum(b, 0), NB)
        b += (x >= tl.load(THR + b + 1, mask=vis, other=0)).to(tl.int64)
        b -= (x < tl.load(THR + b, mask=vis, other=0)).to(tl.int64)
        bkt = b
        s += tl.load(TSW + bkt, mask=vis, other=0.0)
    return s, vis, rel, bkt

@triton.jit
def _inv_n(offs_m, hist, inv_max, NORM: tl.constexpr):
    if NORM == 0:
        return tl.zeros_like(offs_m.to(tl.float32)) + inv_max
    elif NORM == 1:
        return 1.0 / (tl.minimum(offs_m, hist) + 1).to(tl.float32)
    else:
        return tl.zeros_like(offs_m.to(tl.float32)) + 1.0

@triton.jit
def _row(OFFS, HIST, b):
    start = tl.load(OFFS + b)
    return start, tl.load(OFFS + b + 1) - start, tl.load(HIST + b)

@triton.jit
def fwd(Q, K, V, O, OFFS, HIST, POS, TS, QTS, TSW, POSW, THR, H, DQ, DV, alpha, inv_div, inv_max,
        P, NB, NORM: tl.constexpr, HAS_TS: tl.constexpr, HAS_POS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BDQ: tl.constexpr, BDV: tl.constexpr, F32: tl.constexpr):
    m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, L, hist = _row(OFFS, HIST, b)
    i0 = m * BM
    if i0 < L:
        offs_m = i0 + tl.arange(0, BM)
        dq_r, dv_r = tl.arange(0, BDQ), tl.arange(0, BDV)
        row_m = start + offs_m
        q = tl.load(Q + row_m[:, None] * (H * DQ) + h * DQ + dq_r[None, :],
                    mask=(offs_m[:, None] < L) & (dq_r[None, :] < DQ), other=0.0)
        pos_i = tl.load(POS + row_m, mask=offs_m < L, other=0)
        qts_i = tl.load(QTS + row_m, mask=offs_m < L, other=0)
        acc = tl.zeros((BM, BDV), dtype=tl.float32)
        hi = tl.minimum(L, i0 + BM)
        for j0 in range(0, hi, BN):
            offs_n = j0 + tl.arange(0, BN)
            row_n = start + offs_n
            kv_mask = offs_n[:, None] < L
            k = tl.load(K + row_n[:, None] * (H * DQ) + h * DQ + dq_r[None, :],
                        mask=kv_mask & (dq_r[None, :] < DQ), other=0.0)
            v = tl.load(V + row_n[:, None] * (H * DV) + h * DV + dv_r[None, :],
                        mask=kv_mask & (dv_r[None, :] < DV), other=0.0)
            pos_j = tl.load(POS + row_n, mask=offs_n < L, other=0)
            ts_j = tl.load(TS + row_n, mask=offs_n < L, other=0)
            s, vis, _, _ = _tile(q, k, pos_i, qts_i, offs_m, offs_n, L, hist, pos_j, ts_j, TSW, POSW, THR,
                                 alpha, inv_div, P, NB, HAS_TS, HAS_POS, F32)
            a = tl.where(vis, s * tl.sigmoid(s), 0.0)
            acc += _dot(a.to(v.dtype), v, F32)
        acc = acc * _inv_n(offs_m, hist, inv_max, NORM)[:, None]
        tl.store(O + row_m[:, None] * (H * DV) + h * DV + dv_r[None, :], acc.to(O.dtype.element_ty),
                 mask=(offs_m[:, None] < L) & (dv_r[None, :] < DV))

@triton.jit
def bwd_kv(Q, K, V, DO, DK, DV_, OFFS, HIST, POS, TS, QTS, TSW, POSW, THR, H, DQ, DV, alpha, inv_div,
           inv_max, P, NB, NORM: tl.constexpr, HAS_TS: tl.constexpr, HAS_POS: tl.constexpr,
           BM: tl.constexpr, BN: tl.constexpr, BDQ: tl.constexpr, BDV: tl.constexpr, F32: tl.constexpr):
    n, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, L, hist = _row(OFFS, HIST, b)
    j0 = n * BN
    if j0 < L:
        offs_n = j0 + tl.arange(0, BN)
        dq_r, dv_r = tl.arange(0, BDQ), tl.arange(0, BDV)
        row_n = start + offs_n
        kv_mask = offs_n[:, None] < L
        k = tl.load(K + row_n[:, None] * (H * DQ) + h * DQ + dq_r[None, :],
                    mask=kv_mask & (dq_r[None, :] < DQ), other=0.0)
        v = tl.load(V + row_n[:, None] * (H * DV) + h * DV + dv_r[None, :],
                    mask=kv_mask & (dv_r[None, :] < DV), other=0.0)
        pos_j = tl.load(POS + row_n, mask=offs_n < L, other=0)
        ts_j = tl.load(TS + row_n, mask=offs_n < L, other=0)
        dk = tl.zeros((BN, BDQ), dtype=tl.float32)
        dv = tl.zeros((BN, BDV), dtype=tl.float32)
        # Queries i >= j0 see these keys; keys that are all candidates only see themselves.
        i_end = L
        if j0 >= hist:
            i_end = tl.minimum(L, j0 + BN)
        for i0 in range((j0 // BM) * BM, i_end, BM):
            offs_m = i0 + tl.arange(0, BM)
            row_m = start + offs_m
            q_mask = offs_m[:, None] < L
            q = tl.load(Q + row_m[:, None] * (H * DQ) + h * DQ + dq_r[None, :],
                        mask=q_mask & (dq_r[None, :] < DQ), other=0.0)
            do = tl.load(DO + row_m[:, None] * (H * DV) + h * DV + dv_r[None, :],
                         mask=q_mask & (dv_r[None, :] < DV), other=0.0)
            pos_i = tl.load(POS + row_m, mask=offs_m < L, other=0)
            qts_i = tl.load(QTS + row_m, mask=offs_m < L, other=0)
            s, vis, _, _ = _tile(q, k, pos_i, qts_i, offs_m, offs_n, L, hist, pos_j, ts_j, TSW, POSW, THR,
                                 alpha, inv_div, P, NB, HAS_TS, HAS_POS, F32)
            inv_n = _inv_n(offs_m, hist, inv_max, NORM)[:, None]
            sig = tl.sigmoid(s)
            a = tl.where(vis, s * sig * inv_n, 0.0)
            dv += _dot(tl.trans(a.to(do.dtype)), do, F32)
            da = _dot(do, tl.trans(v), F32).to(tl.float32) * inv_n
            ds = tl.where(vis, da * sig * (1.0 + s * (1.0 - sig)), 0.0)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, F32)
        out_mask = kv_mask
        tl.store(DK + row_n[:, None] * (H * DQ) + h * DQ + dq_r[None, :], (dk * alpha).to(DK.dtype.element_ty),
                 mask=out_mask & (dq_r[None, :] < DQ))
        tl.store(DV_ + row_n[:, None] * (H * DV) + h * DV + dv_r[None, :], dv.to(DV_.dtype.element_ty),
                 mask=out_mask & (dv_r[None, :] < DV))

@triton.jit
def bwd_q(Q, K, V, DO, DQ_, DTS, DPOS, OFFS, HIST, POS, TS, QTS, TSW, POSW, THR, H, DQ, DV, alpha,
          inv_div, inv_max, P, NB, NM, NORM: tl.constexpr, HAS_TS: tl.constexpr, HAS_POS: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BDQ: tl.constexpr, BDV: tl.constexpr, F32: tl.constexpr):
    m, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, L, hist = _row(OFFS, HIST, b)
    i0 = m * BM
    prog = (b * H + h) * NM + m  # this program's own row of the bias-gradient scratch
    if i0 < L:
        offs_m = i0 + tl.arange(0, BM)
        dq_r, dv_r = tl.arange(0, BDQ), tl.arange(0, BDV)
        row_m = start + offs_m
        q_mask = offs_m[:, None] < L
        q = tl.load(Q + row_m[:, None] * (H * DQ) + h * DQ + dq_r[None, :],
                    mask=q_mask & (dq_r[None, :] < DQ), other=0.0)
        do = tl.load(DO + row_m[:, None] * (H * DV) + h * DV + dv_r[None, :],
                     mask=q_mask & (dv_r[None, :] < DV), other=0.0)
        pos_i = tl.load(POS + row_m, mask=offs_m < L, other=0)
        qts_i = tl.load(QTS + row_m, mask=offs_m < L, other=0)
        inv_n = _inv_n(offs_m, hist, inv_max, NORM)[:, None]
        dq = tl.zeros((BM, BDQ), dtype=tl.float32)
        hi = tl.minimum(L, i0 + BM)
        for j0 in range(0, hi, BN):
            offs_n = j0 + tl.arange(0, BN)
            row_n = start + offs_n
            kv_mask = offs_n[:, None] < L
            k = tl.load(K + row_n[:, None] * (H * DQ) + h * DQ + dq_r[None, :],
                        mask=kv_mask & (dq_r[None, :] < DQ), other=0.0)
            v = tl.load(V + row_n[:, None] * (H * DV) + h * DV + dv_r[None, :],
                        mask=kv_mask & (dv_r[None, :] < DV), other=0.0)
            pos_j = tl.load(POS + row_n, mask=offs_n < L, other=0)
            ts_j = tl.load(TS + row_n, mask=offs_n < L, other=0)
            s, vis, rel, bkt = _tile(q, k, pos_i, qts_i, offs_m, offs_n, L, hist, pos_j, ts_j, TSW, POSW,
                                     THR, alpha, inv_div, P, NB, HAS_TS, HAS_POS, F32)
            sig = tl.sigmoid(s)
            da = _dot(do, tl.trans(v), F32).to(tl.float32) * inv_n
            ds = tl.where(vis, da * sig * (1.0 + s * (1.0 - sig)), 0.0)
            dq += _dot(ds.to(k.dtype), k, F32)
            if HAS_POS:  # the bins present in this tile, each summed over the tile
                lo = tl.min(tl.where(vis, rel, P))
                top = tl.max(tl.where(vis, rel, -1))
                for r in range(lo, top + 1):
                    part = tl.sum(tl.where(rel == r, ds, 0.0))
                    tl.store(DPOS + prog * P + r, tl.load(DPOS + prog * P + r) + part)
            if HAS_TS:
                lo = tl.min(tl.where(vis, bkt, NB + 1))
                top = tl.max(tl.where(vis, bkt, -1))
                for r in range(lo, top + 1):
                    part = tl.sum(tl.where(bkt == r, ds, 0.0))
                    w = DTS + prog * (NB + 1) + r
                    tl.store(w, tl.load(w) + part)
        tl.store(DQ_ + row_m[:, None] * (H * DQ) + h * DQ + dq_r[None, :], (dq * alpha).to(DQ_.dtype.element_ty),
                 mask=q_mask & (dq_r[None, :] < DQ))
