"""Attention kernels: a plain PyTorch reference (the specification) and faster paths.

All kernels take jagged per-head tensors q_THd, k_THd, v_THd (T tokens, H heads) and a
`JaggedLayout`, and return the jagged per-head output [T, H, d_v]. Masks (i = query,
j = key, both indices within one row, `hist` = the row's history length):

    visible(i, j) = j <= i and (j < hist or j == i)

which is plain causal when a row has no candidates, and target-aware otherwise: candidates
(i >= hist) see the whole history and themselves, never each other.

HSTU pointwise attention:  out_i = sum_j visible(i, j) * SiLU(alpha q_i.k_j + rab(i, j)) / n_i * v_j
Transformer attention:     out_i = softmax_j over visible (q_i.k_j / sqrt(d_qk)) v_j

`KERNELS[(kind, name)]` is the registry the blocks look up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .jagged import JaggedLayout


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


def time_buckets(dt: torch.Tensor, num_buckets: int, divisor: float) -> torch.Tensor:
    """floor(log(max(|dt|, 1)) / divisor) clamped to [0, num_buckets] (the reference's bucketing)."""
    return (torch.log(dt.abs().clamp(min=1).float()) / divisor).long().clamp(0, num_buckets)


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


def _inv_n(i: torch.Tensor, hist: torch.Tensor, p: HSTUAttentionParams) -> torch.Tensor | float:
    if p.normalizer == "max_seq_len":
        return 1.0 / p.max_seq_len
    if p.normalizer == "num_keys":
        return 1.0 / (torch.minimum(i, hist) + 1).float()
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
    s_BHNN = torch.einsum("bnhd,bmhd->bhnm", q, k) * p.alpha
    rab = relative_bias(pos[:, :, None], ts[:, :, None], pos[:, None, :], ts[:, None, :], ts_w, pos_w, p)
    if rab is not None:
        s_BHNN = s_BHNN + rab[:, None]
    ar = torch.arange(N, device=q.device)
    i, j = ar[None, :, None], ar[None, None, :]
    hist = layout.history_lengths_B[:, None, None]
    mask_BNN = _visible(i, j, hist) & (j < layout.lengths_B[:, None, None])
    scale_BNN = mask_BNN * _inv_n(i, hist, p)
    a_BHNN = F.silu(s_BHNN) * scale_BNN[:, None]
    out = torch.einsum("bhnm,bmhd->bnhd", a_BHNN.to(v.dtype), v)
    return out.reshape((B * N,) + out.shape[2:])[layout.padded_index()]


# ----------------------------------------------------------------------------------------
# HSTU chunked: length buckets x query blocks, recomputing tiles in backward (flash-style),
# so peak memory is one [G, H, q_block, keys] tile instead of [B, H, N, N].


def _tile(q_blk, k, ts_w, pos_w, pos_GN, ts_GN, hist_G, i0, i1, p):
    """Logits (fp32), 0/1*inv_n scale and bias indices of query rows [i0, i1) vs keys [0, i1)."""
    s = torch.matmul(q_blk, k[:, :, :i1].transpose(-1, -2))
    s = s.to(torch.promote_types(s.dtype, torch.float32))  # tile arithmetic in >= fp32
    if p.alpha != 1.0:
        s = s * p.alpha
    rab = relative_bias(pos_GN[:, i0:i1, None], ts_GN[:, i0:i1, None], pos_GN[:, None, :i1],
                        ts_GN[:, None, :i1], ts_w, pos_w, p)
    if rab is not None:
        s = s + rab[:, None]
    dev = q_blk.device
    i = torch.arange(i0, i1, device=dev)[None, :, None]
    j = torch.arange(i1, device=dev)[None, None, :]
    hist = hist_G[:, None, None]
    scale = _visible(i, j, hist).to(s.dtype) * _inv_n(i, hist, p)
    return s, scale[:, None]


def _block_rows(G: int, H: int, N: int, p: HSTUAttentionParams) -> int:
    return max(16, min(N, p.block_elems // max(1, G * H * N)))


class _HSTUChunkedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ts_w, pos_w, pos_GN, ts_GN, hist_G, p):
        with torch.autocast(q.device.type, enabled=False):
            G, H, N, _ = q.shape
            bq = _block_rows(G, H, N, p)
            out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            for i0 in range(0, N, bq):
                i1 = min(N, i0 + bq)
                s, scale = _tile(q[:, :, i0:i1], k, ts_w, pos_w, pos_GN, ts_GN, hist_G, i0, i1, p)
                a = F.silu(s).mul_(scale).to(v.dtype)
                out[:, :, i0:i1] = torch.matmul(a, v[:, :, :i1])
        ctx.save_for_backward(q, k, v, ts_w, pos_w, pos_GN, ts_GN, hist_G)
        ctx.p = p
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, ts_w, pos_w, pos_GN, ts_GN, hist_G = ctx.saved_tensors
        p = ctx.p
        with torch.autocast(q.device.type, enabled=False):
            dout = dout.to(v.dtype)
            G, H, N, _ = q.shape
            bq = _block_rows(G, H, N, p)
            dq = torch.empty_like(q)
            acc = torch.promote_types(q.dtype, torch.float32)  # accumulate grads in >= fp32
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            d_ts = None if ts_w is None else torch.zeros_like(ts_w, dtype=acc)
            d_pos = None if pos_w is None else torch.zeros_like(pos_w, dtype=acc)
            for i0 in range(0, N, bq):
                i1 = min(N, i0 + bq)
                q_blk, do_blk = q[:, :, i0:i1], dout[:, :, i0:i1]
                s, scale = _tile(q_blk, k, ts_w, pos_w, pos_GN, ts_GN, hist_G, i0, i1, p)
                sig = torch.sigmoid(s)
                a = (s * sig).mul_(scale)
                dv[:, :, :i1] += torch.matmul(a.to(v.dtype).transpose(-1, -2), do_blk)
                da = torch.matmul(do_blk, v[:, :, :i1].transpose(-1, -2)).to(s.dtype)
                # d silu(s)/ds = sig * (1 + s * (1 - sig))
                ds = da.mul_(scale).mul_(sig * (1 + s * (1 - sig)))
                ds_c = ds.to(q.dtype)
                dq[:, :, i0:i1] = torch.matmul(ds_c, k[:, :, :i1]) * p.alpha
                dk[:, :, :i1] += torch.matmul(ds_c.transpose(-1, -2), q_blk) * p.alpha
                if d_ts is not None or d_pos is not None:
                    drab = ds.sum(1).flatten()
                    pq, pk = pos_GN[:, i0:i1, None], pos_GN[:, None, :i1]
                    if d_pos is not None:
                        d_pos.index_add_(0, (pq - pk).clamp(0, p.max_seq_len - 1).flatten(), drab)
                    if d_ts is not None:
                        dt = ts_GN[:, i0:i1, None] - ts_GN[:, None, :i1]
                        d_ts.index_add_(0, time_buckets(dt, p.num_time_buckets, p.time_bucket_divisor).flatten(), drab)
        return (dq, dk.to(k.dtype), dv.to(v.dtype),
                None if d_ts is None else d_ts.to(ts_w.dtype),
                None if d_pos is None else d_pos.to(pos_w.dtype), None, None, None, None)


def hstu_attention_chunked(q_THd, k_THd, v_THd, layout: JaggedLayout, ts_w, pos_w,
                           p: HSTUAttentionParams) -> torch.Tensor:
    if layout.num_tokens == 0:
        return v_THd.new_zeros(v_THd.shape)
    dq = q_THd.shape[-1]
    qkv = torch.cat([q_THd, k_THd, v_THd], dim=-1)  # one gather for all three
    parts = []
    for bucket, x in zip(layout.buckets(p.bucket_min_fill), layout.gather_to_buckets(qkv, p.bucket_min_fill)):
        x = x.transpose(1, 2)  # [G, H, N, 2 dq + dv]
        q, k, v = x[..., :dq].contiguous(), x[..., dq:2 * dq].contiguous(), x[..., 2 * dq:].contiguous()
        out = _HSTUChunkedFn.apply(q, k, v, ts_w, pos_w, bucket.positions_GN, bucket.timestamps_GN,
                                   bucket.history_lengths_G, p)
        parts.append(out.transpose(1, 2))
    return layout.scatter_from_buckets(parts)


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
    mask = _visible(i, j, layout.history_lengths_B[:, None, None]) & (j < layout.lengths_B[:, None, None])
    s = s.float().masked_fill(~mask[:, None], float("-inf"))
    a = F.dropout(torch.softmax(s, dim=-1), p=dropout_p)
    out = torch.einsum("bhnm,bmhd->bnhd", a.to(v.dtype), v)
    return out.reshape((B * N,) + out.shape[2:])[layout.padded_index()]


def mha_sdpa(q_THd, k_THd, v_THd, layout: JaggedLayout, dropout_p: float,
             bucket_min_fill: float = 0.75) -> torch.Tensor:
    if layout.num_tokens == 0:
        return v_THd.new_zeros(v_THd.shape)
    dq = q_THd.shape[-1]
    qkv = torch.cat([q_THd, k_THd, v_THd], dim=-1)
    parts = []
    for bucket, x in zip(layout.buckets(bucket_min_fill), layout.gather_to_buckets(qkv, bucket_min_fill)):
        x = x.transpose(1, 2)
        q, k, v = x[..., :dq], x[..., dq:2 * dq], x[..., 2 * dq:]
        if bucket.has_targets:
            ar = torch.arange(bucket.max_len, device=q.device)
            mask = _visible(ar[None, :, None], ar[None, None, :], bucket.history_lengths_G[:, None, None])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=dropout_p)
        else:
            # Right padding: padded keys come after every valid query, so causal is enough.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        parts.append(out.transpose(1, 2))
    return layout.scatter_from_buckets(parts)


KERNELS: dict[tuple[str, str], Callable[..., torch.Tensor]] = {
    ("hstu", "reference"): hstu_attention_reference,
    ("hstu", "chunked"): hstu_attention_chunked,
    ("transformer", "reference"): mha_reference,
    ("transformer", "sdpa"): mha_sdpa,
}
