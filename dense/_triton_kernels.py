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
def _block(X, rows, ok, h, H, D, r):
    """Rows `rows` of head h of a jagged [T, H, D] tensor, [len(rows), len(r)], zero-padded."""
    return tl.load(X + rows[:, None] * (H * D) + h * D + r[None, :], mask=ok[:, None] & (r[None, :] < D), other=0.0)


@triton.jit
def _put(X, rows, ok, h, H, D, r, x):
    tl.store(X + rows[:, None] * (H * D) + h * D + r[None, :], x.to(X.dtype.element_ty),
             mask=ok[:, None] & (r[None, :] < D))


@triton.jit
def _tokens(T, rows, ok):
    return tl.load(T + rows, mask=ok, other=0)


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
        rows_m, ok_m = start + offs_m, offs_m < L
        q = _block(Q, rows_m, ok_m, h, H, DQ, dq_r)
        pos_i, qts_i = _tokens(POS, rows_m, ok_m), _tokens(QTS, rows_m, ok_m)
        acc = tl.zeros((BM, BDV), dtype=tl.float32)
        for j0 in range(0, tl.minimum(L, i0 + BM), BN):
            offs_n = j0 + tl.arange(0, BN)
            rows_n, ok_n = start + offs_n, offs_n < L
            k, v = _block(K, rows_n, ok_n, h, H, DQ, dq_r), _block(V, rows_n, ok_n, h, H, DV, dv_r)
            s, vis, _, _ = _tile(q, k, pos_i, qts_i, offs_m, offs_n, L, hist, _tokens(POS, rows_n, ok_n),
                                 _tokens(TS, rows_n, ok_n), TSW, POSW, THR, alpha, inv_div, P, NB,
                                 HAS_TS, HAS_POS, F32)
            a = tl.where(vis, s * tl.sigmoid(s), 0.0)
            acc += _dot(a.to(v.dtype), v, F32)
        _put(O, rows_m, ok_m, h, H, DV, dv_r, acc * _inv_n(offs_m, hist, inv_max, NORM)[:, None])


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
        rows_n, ok_n = start + offs_n, offs_n < L
        k, v = _block(K, rows_n, ok_n, h, H, DQ, dq_r), _block(V, rows_n, ok_n, h, H, DV, dv_r)
        pos_j, ts_j = _tokens(POS, rows_n, ok_n), _tokens(TS, rows_n, ok_n)
        dk = tl.zeros((BN, BDQ), dtype=tl.float32)
        dv = tl.zeros((BN, BDV), dtype=tl.float32)
        # Queries i >= j0 see these keys; keys that are all candidates only see themselves.
        i_end = L
        if j0 >= hist:
            i_end = tl.minimum(L, j0 + BN)
        for i0 in range((j0 // BM) * BM, i_end, BM):
            offs_m = i0 + tl.arange(0, BM)
            rows_m, ok_m = start + offs_m, offs_m < L
            q, do = _block(Q, rows_m, ok_m, h, H, DQ, dq_r), _block(DO, rows_m, ok_m, h, H, DV, dv_r)
            s, vis, _, _ = _tile(q, k, _tokens(POS, rows_m, ok_m), _tokens(QTS, rows_m, ok_m), offs_m, offs_n, L,
                                 hist, pos_j, ts_j, TSW, POSW, THR, alpha, inv_div, P, NB, HAS_TS, HAS_POS, F32)
            inv_n = _inv_n(offs_m, hist, inv_max, NORM)[:, None]
            sig = tl.sigmoid(s)
            a = tl.where(vis, s * sig * inv_n, 0.0)
            dv += _dot(tl.trans(a.to(do.dtype)), do, F32)
            da = _dot(do, tl.trans(v), F32).to(tl.float32) * inv_n
            ds = tl.where(vis, da * sig * (1.0 + s * (1.0 - sig)), 0.0)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, F32)
        _put(DK, rows_n, ok_n, h, H, DQ, dq_r, dk * alpha)
        _put(DV_, rows_n, ok_n, h, H, DV, dv_r, dv)


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
        rows_m, ok_m = start + offs_m, offs_m < L
        q, do = _block(Q, rows_m, ok_m, h, H, DQ, dq_r), _block(DO, rows_m, ok_m, h, H, DV, dv_r)
        pos_i, qts_i = _tokens(POS, rows_m, ok_m), _tokens(QTS, rows_m, ok_m)
        inv_n = _inv_n(offs_m, hist, inv_max, NORM)[:, None]
        dq = tl.zeros((BM, BDQ), dtype=tl.float32)
        for j0 in range(0, tl.minimum(L, i0 + BM), BN):
            offs_n = j0 + tl.arange(0, BN)
            rows_n, ok_n = start + offs_n, offs_n < L
            k, v = _block(K, rows_n, ok_n, h, H, DQ, dq_r), _block(V, rows_n, ok_n, h, H, DV, dv_r)
            s, vis, rel, bkt = _tile(q, k, pos_i, qts_i, offs_m, offs_n, L, hist, _tokens(POS, rows_n, ok_n),
                                     _tokens(TS, rows_n, ok_n), TSW, POSW, THR, alpha, inv_div, P, NB,
                                     HAS_TS, HAS_POS, F32)
            sig = tl.sigmoid(s)
            da = _dot(do, tl.trans(v), F32).to(tl.float32) * inv_n
            ds = tl.where(vis, da * sig * (1.0 + s * (1.0 - sig)), 0.0)
            dq += _dot(ds.to(k.dtype), k, F32)
            if HAS_POS:  # the bins present in this tile, each summed over the tile
                _bin_sums(DPOS + prog * P, rel, ds, vis, P)
            if HAS_TS:
                _bin_sums(DTS + prog * (NB + 1), bkt, ds, vis, NB + 1)
        _put(DQ_, rows_m, ok_m, h, H, DQ, dq_r, dq * alpha)


@triton.jit
def _bin_sums(OUT, idx, ds, vis, nbins):
    """OUT[r] += sum of ds over the tile's pairs in bin r, for the bins the visible pairs use
    (OUT is this program's own row: a plain read-modify-write, no atomics)."""
    lo = tl.min(tl.where(vis, idx, nbins))
    top = tl.max(tl.where(vis, idx, -1))
    for r in range(lo, top + 1):
        tl.store(OUT + r, tl.load(OUT + r) + tl.sum(tl.where(idx == r, ds, 0.0)))
