"""Attention kernels: a plain PyTorch reference (the specification) and faster paths.

All kernels take jagged per-head tensors q_THd, k_THd, v_THd (T tokens, H heads) and a
`JaggedLayout`, and return the jagged per-head output [T, H, d_v]. Masks (i = query,
j = key, both indices within one row, `hist` = the row's history length):

    visible(i, j) = j <= i and (j < hist or j == i)

which is plain causal when a row has no candidates, and target-aware otherwise: candidates
(i >= hist) see the whole history and themselves, never each other.

HSTU pointwise attention:  out_i = sum_j visible(i, j) * SiLU(alpha q_i.k_j + rab(i, j)) / n_i * v_j
                           rab(i, j) = pos_w[pos_i - pos_j] + ts_w[bucket(ts_q(i) - ts(j))]
Transformer attention:     out_i = softmax_j over visible (q_i.k_j / sqrt(d_qk)) v_j

ts_q is `layout.query_timestamps_T` (a token's own time, or the next event's time under
TowerConfig.time_bias_query="next"), ts the keys' own `layout.timestamps_T`.

`KERNELS[(kind, name)]` is the registry the blocks look up:

    ("hstu", "reference")          padded [B, H, N, N], plain PyTorch: the specification
    ("hstu", "chunked")            length buckets; on CPU in fp32 and bf16 (converted to fp32
                                   around them) the one-pass native kernels of csrc/hstu_tile.c
                                   (hstu_op.py), no [N, N] tile; else query blocks of tiles in
                                   PyTorch, recomputed in backward (float64; CUDA without Triton)
    ("hstu", "triton")             Triton kernels on the jagged tokens (triton_hstu.py): CUDA, or
                                   CPU under TRITON_INTERPRET=1; "chunked" on CUDA tensors runs it
                                   when Triton is installed
    ("transformer", "reference")   padded softmax attention, plain PyTorch
    ("transformer", "sdpa")        length buckets + scaled_dot_product_attention
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import fused as _fused
from . import hstu_op, triton_hstu
from .bias import time_buckets, time_thresholds
from .jagged import JaggedLayout, LengthBucket


@dataclass(frozen=True)
class HSTUAttentionParams:
    alpha: float
    """Multiplier of q.k (1 or d_qk^-0.5)."""
    normalizer: str
    """"max_seq_len", "num_keys" or "none"."""
    max_seq_len: int
    num_time_buckets: int
    time_bucket_divisor: float
    bucket_min_fill: float
    block_elems: int
    fused: bool = True
    """Chunked kernel: use the compiled fused tile (fused.py) for fp32/bf16 CPU tensors."""


def relative_bias(pos_q: torch.Tensor, ts_q: torch.Tensor, pos_k: torch.Tensor, ts_k: torch.Tensor,
                  ts_w: torch.Tensor | None, pos_w: torch.Tensor | None,
                  p: HSTUAttentionParams) -> torch.Tensor | None:
    """rab for broadcastable query/key positions and timestamps; None when both biases are off.

    Only non-negative relative positions occur under the masks, so `pos_w` has max_seq_len
    entries; masked pairs (negative distances) are clamped to 0 and later zeroed by the mask.
    """
    rab = None
    if pos_w is not None:
        rab = pos_w[(pos_q - pos_k).clamp(0, p.max_seq_len - 1)]
    if ts_w is not None:
        t = ts_w[time_buckets(ts_q - ts_k, p.num_time_buckets, p.time_bucket_divisor)]
        rab = t if rab is None else rab + t
    return rab


def _visible(i: torch.Tensor, j: torch.Tensor, hist: torch.Tensor) -> torch.Tensor:
    return (j <= i) & ((j < hist) | (j == i))


def _inv_n(i: torch.Tensor, hist: torch.Tensor, p: HSTUAttentionParams,
           dtype: torch.dtype = torch.float32) -> torch.Tensor | float:
    if p.normalizer == "max_seq_len":
        return 1.0 / p.max_seq_len
    if p.normalizer == "num_keys":
        return 1.0 / (torch.minimum(i, hist) + 1).to(dtype)
    return 1.0


# ----------------------------------------------------------------------------------------
# HSTU reference: pad the whole batch to [B, N], materialize [B, H, N, N].


def _pad(x_TX: torch.Tensor, layout: JaggedLayout) -> torch.Tensor:
    B, N = layout.batch_size, layout.max_len
    out = x_TX.new_zeros((B * N,) + x_TX.shape[1:])
    out = out.index_put((layout.padded_index(),), x_TX)
    return out.view((B, N) + x_TX.shape[1:])


def hstu_attention_reference(q_THd, k_THd, v_THd, layout: JaggedLayout, ts_w, pos_w,
                             p: HSTUAttentionParams) -> torch.Tensor:
    if layout.num_tokens == 0:
        return v_THd.new_zeros(v_THd.shape)
    B, N = layout.batch_size, layout.max_len
    q, k, v = _pad(q_THd, layout), _pad(k_THd, layout), _pad(v_THd, layout)
    pos, ts = _pad(layout.positions_T, layout), _pad(layout.timestamps_T, layout)
    qts = _pad(layout.query_timestamps_T, layout)
    s_BHNN = torch.einsum("bnhd,bmhd->bhnm", q, k) * p.alpha
    rab = relative_bias(pos[:, :, None], qts[:, :, None], pos[:, None, :], ts[:, None, :], ts_w, pos_w, p)
    if rab is not None:
        s_BHNN = s_BHNN + rab[:, None]
    ar = torch.arange(N, device=q.device)
    i, j = ar[None, :, None], ar[None, None, :]
    hist = layout.history_lengths_B[:, None, None]
    mask_BNN = _visible(i, j, hist) & (j < layout.lengths_B[:, None, None])
    # In the scores' dtype: a bool mask times 1 / n is float32, which would round the
    # normalizer of a float64 reference.
    dtype = torch.promote_types(s_BHNN.dtype, torch.float32)
    scale_BNN = mask_BNN.to(dtype) * _inv_n(i, hist, p, dtype)
    a_BHNN = F.silu(s_BHNN) * scale_BNN[:, None]
    out = torch.einsum("bhnm,bmhd->bnhd", a_BHNN.to(v.dtype), v)
    return out.reshape((B * N,) + out.shape[2:])[layout.padded_index()]


# ----------------------------------------------------------------------------------------
# HSTU chunked: length buckets x query blocks, recomputing tiles in backward (flash-style),
# so peak float memory is one [G, H, q_block, keys] tile instead of [B, H, N, N].
#
# Work per tile is kept to a few passes over the [G, H, q_block, keys] logits:
# - the mask is folded into the additive bias as a huge negative number: SiLU(-1e30) and its
#   derivative are exactly 0, so masked pairs contribute exactly nothing;
# - the normalizer 1/n scales the small [.., q_block, d_v] output (and dO), not the tile;
# - the time-gap bucket of every (query, key) pair is computed once per call as uint8 and
#   shared by all layers (1 byte per pair instead of recomputing logs per layer and pass);
# - rows without candidates share one [q_block, keys] position+mask tile (Toeplitz).

_MASKED = -1e30


def _time_index(bucket: LengthBucket, p: HSTUAttentionParams) -> torch.Tensor:
    """uint8 [G, N, N] time-gap bucket per pair, cached on the bucket for all layers."""
    idx = getattr(bucket, "_time_index", None)
    if idx is None:
        G, N = bucket.num_rows, bucket.max_len
        ts, qts = bucket.timestamps_GN, bucket.query_timestamps_GN
        idx = torch.empty(G, N, N, dtype=torch.uint8, device=ts.device)
        step = max(1, 2_000_000 // max(1, G * N))
        for r0 in range(0, N, step):
            r1 = min(N, r0 + step)
            dt = qts[:, r0:r1, None] - ts[:, None, :]
            idx[:, r0:r1] = time_buckets(dt, p.num_time_buckets, p.time_bucket_divisor).to(torch.uint8)
        bucket._time_index = idx
    return idx


def _bias_tile(bucket, ts_w, pos_w, i0, i1, p):
    """Additive fp32 bias (rab, with masked pairs at -1e30) of queries [i0, i1) vs keys [0, i1).

    Returns (bias [G or 1, bq, K], position index [G or 1, bq, K] or None, time index or None).
    """
    dev = bucket.positions_GN.device
    # At least fp32: the mask value (-1e30) has no fp16 form (a tower cast with .half()).
    dtype = torch.float32 if pos_w is None else torch.promote_types(pos_w.dtype, torch.float32)
    pos_w = None if pos_w is None else pos_w.to(dtype)
    if not bucket.has_targets:
        i = torch.arange(i0, i1, device=dev)[:, None]
        d = (i - torch.arange(i1, device=dev)[None, :])[None]
        pos_idx = d.clamp(0, p.max_seq_len - 1) if pos_w is not None else None
        bias = pos_w[pos_idx] if pos_w is not None else torch.zeros(d.shape, dtype=dtype, device=dev)
        bias = bias.masked_fill(d < 0, _MASKED)
    else:
        pq, pk = bucket.positions_GN[:, i0:i1, None], bucket.positions_GN[:, None, :i1]
        pos_idx = (pq - pk).clamp(0, p.max_seq_len - 1) if pos_w is not None else None
        i = torch.arange(i0, i1, device=dev)[None, :, None]
        j = torch.arange(i1, device=dev)[None, None, :]
        vis = _visible(i, j, bucket.history_lengths_G[:, None, None])
        bias = pos_w[pos_idx] if pos_w is not None else torch.zeros(vis.shape, dtype=dtype, device=dev)
        bias = bias.masked_fill(~vis, _MASKED)
    t_idx = None
    if ts_w is not None:
        t_idx = _time_index(bucket, p)[:, i0:i1, :i1].long()
        bias = ts_w[t_idx] + bias
    return bias, pos_idx, t_idx


def _inv_n_GN(bucket, p, dtype=torch.float32):
    if p.normalizer == "num_keys":
        i = torch.arange(bucket.max_len, device=bucket.positions_GN.device)[None, :]
        return 1.0 / (torch.minimum(i, bucket.history_lengths_G[:, None]) + 1).to(dtype)
    return _inv_n(None, None, p)


def _logits(q_blk, k, bias, p):
    """fp32 (or wider) alpha * q.k + bias."""
    s = torch.matmul(q_blk, k.transpose(-1, -2))
    if p.alpha != 1.0:
        s.mul_(p.alpha)
    return torch.add(s, bias[:, None])  # promotes a bf16 product to fp32 in the same pass


def _fused_time_index(bucket: LengthBucket, p: HSTUAttentionParams) -> torch.Tensor:
    """uint8 [G, N, N] time buckets, computed once per tower call (cached on the bucket)."""
    idx = getattr(bucket, "_time_index", None)
    if idx is None:
        idx = _fused.time_index(bucket.timestamps_GN, p.num_time_buckets, p.time_bucket_divisor,
                                _own_or(bucket.query_timestamps_GN, bucket.timestamps_GN))
        bucket._time_index = idx
    return idx


def _own_or(query_ts: torch.Tensor, ts: torch.Tensor) -> torch.Tensor | None:
    """Query times for the C tile: None (its NULL, "same as ts") when they are the keys' own."""
    return None if query_ts is ts else query_ts.contiguous()


def _one_pass(q, k, v) -> bool:
    """fp32, and bf16 converted to fp32 around them, run the native one-pass kernels
    (the custom ops of hstu_op.py)."""
    return q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.bfloat16)


TIME_INDEX_MAX_LEN = 256
"""The one-pass kernels read time buckets from a uint8 [G, N, N] index found once per tower
call and length bucket (shared by every layer, forward and backward) for buckets of rows up
to this long; longer, each pass finds them itself as runs over the sorted history (a
logarithm and a search per run of keys in one bucket). Measured (2 layers, fp32, 2 threads,
tokens/s of the index over the runs): 1.07-1.10 at 128 x 200 x 50, 0.97 at 50 x 512 x 64,
0.92-0.94 at 25 x 1024, 0.81-0.87 at 8 x 2048: short rows have few keys per run, and long
rows pay a gather per key (and a scatter per key in the backward) for what runs do once."""


def _fused_state(q, k, v, ts_w, pos_w, bucket, p):
    """A tile -> fused.TileArgs factory when the fused C tile applies, else None."""
    if not (p.fused and _fused.supports(q, k, v, ts_w, pos_w)):
        return None
    G, H, N, _ = q.shape
    keep = dict(  # held by the closure so the raw pointers stay valid
        ts=None if ts_w is None else bucket.timestamps_GN.contiguous(),
        qts=None if ts_w is None else _own_or(bucket.query_timestamps_GN, bucket.timestamps_GN),
        tidx=None if ts_w is None else _fused_time_index(bucket, p),
        thr=time_thresholds(p.num_time_buckets, p.time_bucket_divisor),
        ts_w=None if ts_w is None else ts_w.detach().float().contiguous(),
        pos_w=None if pos_w is None else pos_w.detach().float().contiguous(),
        pos=bucket.positions_GN.contiguous(), hist=bucket.history_lengths_G.contiguous(),
        lens=bucket.lengths_G.contiguous())

    def args(i0, i1):
        return _fused.tile_args(G=G, H=H, bq=i1 - i0, K=i1, N=N, i0=i0, P=p.max_seq_len,
                                NB=p.num_time_buckets, alpha=p.alpha,
                                divisor=p.time_bucket_divisor, **keep)
    return args


def _block_rows(G: int, H: int, N: int, p: HSTUAttentionParams) -> int:
    return max(16, min(N, p.block_elems // max(1, G * H * N)))


def _scale_rows(x, inv_n, i0, i1):
    if isinstance(inv_n, float):
        return x if inv_n == 1.0 else x * inv_n
    return x * inv_n[:, None, i0:i1, None].to(x.dtype)


def _one_pass_attention(q, k, v, ts_w, pos_w, bucket: LengthBucket, p: HSTUAttentionParams) -> torch.Tensor:
    """fp32 / bf16 on the CPU: the whole attention of a bucket in one native pass each way
    (the backward recomputes the scores), as the custom ops of hstu_op.py."""
    N = q.shape[2]
    timed = ts_w is not None
    with torch.autocast(q.device.type, enabled=False):
        out = hstu_op.attention(
            q, k, v, bucket.timestamps_GN if timed else None,
            _own_or(bucket.query_timestamps_GN, bucket.timestamps_GN) if timed else None,
            _fused_time_index(bucket, p) if timed and N <= TIME_INDEX_MAX_LEN else None,
            ts_w, pos_w, bucket.positions_GN, bucket.history_lengths_G, bucket.lengths_G,
            max_seq_len=p.max_seq_len, num_buckets=p.num_time_buckets, alpha=p.alpha,
            divisor=p.time_bucket_divisor)
        return _scale_rows(out, _inv_n_GN(bucket, p), 0, N).to(v.dtype)


class _HSTUChunkedFn(torch.autograd.Function):
    """Query blocks of [N, N] tiles, recomputed in backward: mixed dtypes through the C tile's
    elementwise pass, float64 and the no-library mode in PyTorch."""

    @staticmethod
    def forward(ctx, q, k, v, ts_w, pos_w, bucket, p):
        with torch.autocast(q.device.type, enabled=False):
            G, H, N, _ = q.shape
            bq = _block_rows(G, H, N, p)
            inv_n = _inv_n_GN(bucket, p, torch.promote_types(q.dtype, torch.float32))
            fused = _fused_state(q, k, v, ts_w, pos_w, bucket, p)
            out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            for i0 in range(0, N, bq):
                i1 = min(N, i0 + bq)
                if fused is not None:
                    s = torch.matmul(q[:, :, i0:i1], k[:, :, :i1].transpose(-1, -2))
                    a = torch.empty(s.shape, dtype=v.dtype)
                    _fused.tile_forward(fused(i0, i1), s, a)
                else:
                    bias, _, _ = _bias_tile(bucket, ts_w, pos_w, i0, i1, p)
                    s = _logits(q[:, :, i0:i1], k[:, :, :i1], bias, p)
                    a = F.silu(s, inplace=True).to(v.dtype)
                out[:, :, i0:i1] = _scale_rows(torch.matmul(a, v[:, :, :i1]), inv_n, i0, i1)
        ctx.save_for_backward(q, k, v, ts_w, pos_w)
        ctx.bucket, ctx.p = bucket, p
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, ts_w, pos_w = ctx.saved_tensors
        bucket, p = ctx.bucket, ctx.p
        with torch.autocast(q.device.type, enabled=False):
            dout = dout.to(v.dtype)
            G, H, N, _ = q.shape
            bq = _block_rows(G, H, N, p)
            inv_n = _inv_n_GN(bucket, p, torch.promote_types(q.dtype, torch.float32))
            fused = _fused_state(q, k, v, ts_w, pos_w, bucket, p)
            if fused is not None:  # the C tile sums bias grads in float64
                d_ts64 = None if ts_w is None else torch.zeros(ts_w.shape, dtype=torch.float64)
                d_pos64 = None if pos_w is None else torch.zeros(pos_w.shape, dtype=torch.float64)
            acc = torch.promote_types(q.dtype, torch.float32)  # accumulate grads in >= fp32
            dq = torch.empty_like(q)
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            d_ts = None if ts_w is None else torch.zeros_like(ts_w, dtype=acc)
            d_pos = None if pos_w is None else torch.zeros_like(pos_w, dtype=acc)
            for i0 in range(0, N, bq):
                i1 = min(N, i0 + bq)
                q_blk, k_blk, v_blk = q[:, :, i0:i1], k[:, :, :i1], v[:, :, :i1]
                do_blk = _scale_rows(dout[:, :, i0:i1], inv_n, i0, i1)
                if fused is not None:
                    s = torch.matmul(q_blk, k_blk.transpose(-1, -2))
                    da = torch.matmul(do_blk, v_blk.transpose(-1, -2))
                    a = torch.empty(s.shape, dtype=v.dtype)
                    ds_c = torch.empty(s.shape, dtype=q.dtype)
                    _fused.tile_backward(fused(i0, i1), s, da, a, ds_c, d_ts64, d_pos64)
                    del s, da
                    dv[:, :, :i1] += torch.matmul(a.transpose(-1, -2), do_blk)
                    del a
                else:
                    bias, pos_idx, t_idx = _bias_tile(bucket, ts_w, pos_w, i0, i1, p)
                    s = _logits(q_blk, k_blk, bias, p)
                    a = F.silu(s).to(v.dtype)
                    dv[:, :, :i1] += torch.matmul(a.transpose(-1, -2), do_blk)
                    del a
                    da = torch.matmul(do_blk, v_blk.transpose(-1, -2)).to(s.dtype)
                    ds = torch.ops.aten.silu_backward(da, s)
                    del da, s
                    ds_c = ds.to(q.dtype)
                dq_blk = torch.matmul(ds_c, k_blk)
                dk_blk = torch.matmul(ds_c.transpose(-1, -2), q_blk)
                if p.alpha != 1.0:
                    dq_blk.mul_(p.alpha)
                    dk_blk.mul_(p.alpha)
                dq[:, :, i0:i1] = dq_blk
                dk[:, :, :i1] += dk_blk
                if fused is None and (d_ts is not None or d_pos is not None):
                    drab = ds.sum(1)  # bias is shared by heads
                    if d_ts is not None:
                        d_ts.index_add_(0, t_idx.flatten(), drab.flatten().to(acc))
                    if d_pos is not None:
                        if pos_idx.shape[0] == 1:
                            drab = drab.sum(0, keepdim=True)
                        d_pos.index_add_(0, pos_idx.flatten(), drab.flatten().to(acc))
            if fused is not None:
                d_ts = None if ts_w is None else d_ts64
                d_pos = None if pos_w is None else d_pos64
        return (dq, dk.to(k.dtype), dv.to(v.dtype),
                None if d_ts is None else d_ts.to(ts_w.dtype),
                None if d_pos is None else d_pos.to(pos_w.dtype), None, None)


def hstu_attention_chunked(q_THd, k_THd, v_THd, layout: JaggedLayout, ts_w, pos_w,
                           p: HSTUAttentionParams) -> torch.Tensor:
    if layout.num_tokens == 0:
        return v_THd.new_zeros(v_THd.shape)
    if q_THd.is_cuda and triton_hstu.available() and q_THd.dtype != torch.float64:
        # On CUDA the C tile does not apply; the PyTorch tile would sum bias gradients with
        # index_add_ (atomics, not deterministic) and sync with the host per bucket.
        return triton_hstu.hstu_attention_triton(q_THd, k_THd, v_THd, layout, ts_w, pos_w, p)
    parts = []
    for bucket, (q, k, v) in _bucketed_qkv(q_THd, k_THd, v_THd, layout, p.bucket_min_fill):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if p.fused and _one_pass(q, k, v) and _fused.supports(q, k, v, ts_w, pos_w):
            parts.append(_one_pass_attention(q, k, v, ts_w, pos_w, bucket, p))
        else:
            parts.append(_HSTUChunkedFn.apply(q, k, v, ts_w, pos_w, bucket, p))
    return _unbucketed(parts, layout)


def _bucketed_qkv(q_THd, k_THd, v_THd, layout: JaggedLayout, min_fill: float):
    """(bucket, (q, k, v) [G, H, N, d] views) per length bucket. Each of the three is gathered
    on its own: gathered as one concatenated tensor, they would be copied together and their
    gradients concatenated back. With one head and one bucket of equal rows, the views are
    the inputs themselves (nothing copied)."""
    T = q_THd.shape[0]
    qkv = (q_THd, k_THd, v_THd)
    gathered = [layout.gather_to_buckets(t.reshape(T, -1), min_fill) for t in qkv]
    for bucket, *parts in zip(layout.buckets(min_fill), *gathered):
        yield bucket, tuple(x.reshape(x.shape[0], x.shape[1], t.shape[1], -1).transpose(1, 2)
                            for x, t in zip(parts, qkv))


def _unbucketed(parts: list[torch.Tensor], layout: JaggedLayout) -> torch.Tensor:
    """Per-bucket outputs [G, H, N, dv] -> jagged [T, H, dv]."""
    H, dv = parts[0].shape[1], parts[0].shape[-1]
    flat = layout.scatter_from_buckets([o.transpose(1, 2).reshape(o.shape[0], o.shape[2], H * dv) for o in parts])
    return flat.view(-1, H, dv)


# ----------------------------------------------------------------------------------------
# Transformer (softmax) attention.


def mha_reference(q_THd, k_THd, v_THd, layout: JaggedLayout, dropout_p: float) -> torch.Tensor:
    if layout.num_tokens == 0:
        return v_THd.new_zeros(v_THd.shape)
    B, N = layout.batch_size, layout.max_len
    q, k, v = _pad(q_THd, layout), _pad(k_THd, layout), _pad(v_THd, layout)
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(q.shape[-1])
    ar = torch.arange(N, device=q.device)
    i, j = ar[None, :, None], ar[None, None, :]
    # Padded queries keep their own (zero) key so no softmax row is empty (NaN grads otherwise).
    mask = _visible(i, j, layout.history_lengths_B[:, None, None]) & ((j < layout.lengths_B[:, None, None]) | (i == j))
    s = s.to(torch.promote_types(s.dtype, torch.float32)).masked_fill(~mask[:, None], float("-inf"))
    a = F.dropout(torch.softmax(s, dim=-1), p=dropout_p)
    out = torch.einsum("bhnm,bmhd->bnhd", a.to(v.dtype), v)
    return out.reshape((B * N,) + out.shape[2:])[layout.padded_index()]


def mha_sdpa(q_THd, k_THd, v_THd, layout: JaggedLayout, dropout_p: float,
             bucket_min_fill: float = 0.75) -> torch.Tensor:
    if layout.num_tokens == 0:
        return v_THd.new_zeros(v_THd.shape)
    parts = []
    for bucket, (q, k, v) in _bucketed_qkv(q_THd, k_THd, v_THd, layout, bucket_min_fill):
        if bucket.has_targets:
            ar = torch.arange(bucket.max_len, device=q.device)
            mask = _visible(ar[None, :, None], ar[None, None, :], bucket.history_lengths_G[:, None, None])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=dropout_p)
        else:
            # Right padding: padded keys come after every valid query, so causal is enough.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        parts.append(out)
    return _unbucketed(parts, layout)


KERNELS: dict[tuple[str, str], Callable[..., torch.Tensor]] = {
    ("hstu", "reference"): hstu_attention_reference,
    ("hstu", "chunked"): hstu_attention_chunked,
    ("hstu", "triton"): triton_hstu.hstu_attention_triton,
    ("transformer", "reference"): mha_reference,
    ("transformer", "sdpa"): mha_sdpa,
}


def hstu_target_attention_fused(q_BHMd, k_BHMd, v_BHMd, cache_k_BHLd, cache_v_BHLd, ts_w, pos_w,
                                history_lengths_B, cache_ts_BL, ts_BM, p: HSTUAttentionParams):
    """Candidates vs cached history with the fused tile, or None when it does not apply.

    Each row is laid out as [L cached history slots, M candidates]; candidates are queries
    L..L+M-1. The tile's mask then gives exactly the target-aware semantics: padded history
    slots (j >= hist) and other candidates are invisible, the candidate sees itself. Only
    candidates are queries here and they are scored at their own time, so the tile's query
    times are the keys' own under either `time_bias_query`.
    """
    if not (p.fused and _fused.supports(q_BHMd, cache_k_BHLd, cache_v_BHLd, ts_w, pos_w)):
        return None
    B, H, M, _ = q_BHMd.shape
    L = cache_k_BHLd.shape[2]
    dtype = cache_k_BHLd.dtype
    keys = torch.cat([cache_k_BHLd, k_BHMd.to(dtype)], dim=2)
    values = torch.cat([cache_v_BHLd, v_BHMd.to(dtype)], dim=2)
    pos = torch.cat([torch.arange(L).expand(B, L), history_lengths_B[:, None].expand(B, M)], 1).contiguous()
    ts = torch.cat([cache_ts_BL, ts_BM], 1).contiguous()
    hist = history_lengths_B.contiguous()
    thr = time_thresholds(p.num_time_buckets, p.time_bucket_divisor)
    ts_w32 = None if ts_w is None else ts_w.detach().float().contiguous()
    pos_w32 = None if pos_w is None else pos_w.detach().float().contiguous()
    args = _fused.tile_args(G=B, H=H, bq=M, K=L + M, N=L + M, i0=L, P=p.max_seq_len,
                            NB=p.num_time_buckets, ts=None if ts_w is None else ts, thr=thr,
                            ts_w=ts_w32, pos_w=pos_w32, pos=pos, hist=hist, alpha=p.alpha,
                            divisor=p.time_bucket_divisor)
    with torch.autocast("cpu", enabled=False):
        if dtype == torch.float32:
            out = _fused.attention_forward(args, q_BHMd.float(), keys, values)
        else:
            s = torch.matmul(q_BHMd.to(dtype), keys.transpose(-1, -2))
            a = torch.empty(s.shape, dtype=dtype)
            _fused.tile_forward(args, s, a)
            out = torch.matmul(a, values)
    if p.normalizer == "max_seq_len":
        return out / p.max_seq_len
    if p.normalizer == "num_keys":
        return out / (history_lengths_B.to(out.dtype) + 1)[:, None, None, None]
    return out
