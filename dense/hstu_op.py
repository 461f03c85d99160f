"""The one-pass native HSTU attention (csrc/hstu_tile.c through fused.py) as torch.library
custom ops: `genrec::hstu_attention_fwd` and `genrec::hstu_attention_bwd`, with fake
(shape-only) implementations and the backward registered as the forward's autograd.

As ops, the kernels are single nodes to the dispatcher and to torch.compile: a compiled
function that calls `attention` traces it without a graph break (a ctypes call inside an
autograd.Function would break the graph), and AOT autograd finds its backward. The chunked
tower path (kernels.hstu_attention_chunked) calls them for every fp32 / bf16 length bucket
on the CPU.

Inputs of one length bucket: q, k [G, H, N, dq] and v [G, H, N, dv], fp32 or bf16 (widened
to fp32 inside the ops, so autograd keeps the bf16 tensors for the backward); the bias tables
ts_w [num_buckets + 1] and pos_w [max_seq_len] (either may be None: no such bias);
the bucket's keys' times ts [G, N] and queries' times qts [G, N] (None: the keys' own),
an optional uint8 time index tidx [G, N, N] (None: the kernel finds buckets itself),
positions pos [G, N], history lengths hist [G] and row lengths lens [G], all int64. The
output is [G, H, N, dv] fp32, not yet divided by the normalizer.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import fused as _fused
from .bias import time_thresholds


def _check(q: Tensor, k: Tensor, v: Tensor, ts, qts, tidx, ts_w, pos_w, pos, hist, lens, max_seq_len: int,
           num_buckets: int) -> None:
    """The kernels read raw memory: what they would misread is an error here instead."""
    G, H, N, dq = q.shape
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.bfloat16)):
        raise TypeError(f"hstu_attention: q, k, v must share fp32 or bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != (G, H, N, dq) or v.dim() != 4 or v.shape[:3] != (G, H, N):
        raise ValueError(f"hstu_attention: q, k [G, H, N, dq] and v [G, H, N, dv] expected, got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    expected = {"pos": (pos, [G, N], torch.int64), "hist": (hist, [G], torch.int64),
                "lens": (lens, [G], torch.int64), "ts": (ts, [G, N], torch.int64),
                "qts": (qts, [G, N], torch.int64), "tidx": (tidx, [G, N, N], torch.uint8),
                "ts_w": (ts_w, [num_buckets + 1], None), "pos_w": (pos_w, [max_seq_len], None)}
    for name, (t, shape, dtype) in expected.items():
        if t is None:
            continue
        if list(t.shape) != shape or t.device.type != "cpu" or (dtype is not None and t.dtype != dtype):
            raise ValueError(f"hstu_attention: {name} must be {dtype or 'float'} {shape} on the CPU, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    if ts_w is not None and ts is None:
        raise ValueError("hstu_attention: a time bias (ts_w) needs the keys' times ts")
    # Values the kernels index with: a bucket past ts_w, or a length past N, reads (and in
    # the backward adds to) memory outside the tensors. One pass over uint8 [G, N, N]: about
    # 0.1% of a 128 x 200 x 50 step's time.
    if tidx is not None and ts_w is not None and tidx.numel() and int(tidx.max()) > num_buckets:
        raise ValueError(f"hstu_attention: tidx holds bucket {int(tidx.max())}, past ts_w's last ({num_buckets})")
    for name, t in (("hist", hist), ("lens", lens)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > N):
            raise ValueError(f"hstu_attention: {name} must lie in [0, N = {N}], got [{int(t.min())}, {int(t.max())}]")


def _tile_args(q: Tensor, ts, qts, tidx, ts_w, pos_w, pos, hist, lens, max_seq_len: int, num_buckets: int,
               alpha: float, divisor: float) -> tuple:
    """(TileArgs, the tensors its pointers name: keep them alive through the call)."""
    G, H, N, _ = q.shape
    keep = dict(ts=None if ts is None else ts.contiguous(), qts=None if qts is None else qts.contiguous(),
                tidx=None if tidx is None else tidx.contiguous(), thr=time_thresholds(num_buckets, divisor),
                ts_w=None if ts_w is None else ts_w.detach().float().contiguous(),
                pos_w=None if pos_w is None else pos_w.detach().float().contiguous(),
                pos=pos.contiguous(), hist=hist.contiguous(), lens=lens.contiguous())
    args = _fused.tile_args(G=G, H=H, bq=N, K=N, N=N, i0=0, P=max_seq_len, NB=num_buckets, alpha=alpha,
                            divisor=divisor, **keep)
    return args, keep


@torch.library.custom_op("genrec::hstu_attention_fwd", mutates_args=(), device_types="cpu")
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, ts: Optional[Tensor], qts: Optional[Tensor],
                  tidx: Optional[Tensor], ts_w: Optional[Tensor], pos_w: Optional[Tensor], pos: Tensor,
                  hist: Tensor, lens: Tensor, max_seq_len: int, num_buckets: int, alpha: float,
                  divisor: float) -> Tensor:
    _check(q, k, v, ts, qts, tidx, ts_w, pos_w, pos, hist, lens, max_seq_len, num_buckets)
    args, _keep = _tile_args(q, ts, qts, tidx, ts_w, pos_w, pos, hist, lens, max_seq_len, num_buckets, alpha,
                             divisor)
    return _fused.attention_forward(args, q.float(), k.float(), v.float())


@attention_fwd.register_fake
def _(q, k, v, ts, qts, tidx, ts_w, pos_w, pos, hist, lens, max_seq_len, num_buckets, alpha, divisor):
    return q.new_empty((*q.shape[:3], v.shape[-1]), dtype=torch.float32)


@torch.library.custom_op("genrec::hstu_attention_bwd", mutates_args=(), device_types="cpu")
def attention_bwd(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, ts: Optional[Tensor], qts: Optional[Tensor],
                  tidx: Optional[Tensor], ts_w: Optional[Tensor], pos_w: Optional[Tensor], pos: Tensor,
                  hist: Tensor, lens: Tensor, max_seq_len: int, num_buckets: int, alpha: float,
                  divisor: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d_ts_w, d_pos_w): fp32 gradients, the bias gradients summed in float64
    (empty where that bias is absent)."""
    _check(q, k, v, ts, qts, tidx, ts_w, pos_w, pos, hist, lens, max_seq_len, num_buckets)
    args, _keep = _tile_args(q, ts, qts, tidx, ts_w, pos_w, pos, hist, lens, max_seq_len, num_buckets, alpha,
                             divisor)
    d_ts = torch.zeros(0 if ts_w is None else ts_w.shape[0], dtype=torch.float64)
    d_pos = torch.zeros(0 if pos_w is None else pos_w.shape[0], dtype=torch.float64)
    dq, dk, dv = _fused.attention_backward(args, q.float(), k.float(), v.float(), dout.float(),
                                           None if ts_w is None else d_ts, None if pos_w is None else d_pos)
    return dq, dk, dv, d_ts, d_pos


@attention_bwd.register_fake
def _(q, k, v, dout, ts, qts, tidx, ts_w, pos_w, pos, hist, lens, max_seq_len, num_buckets, alpha, divisor):
    def f64(t):
        return q.new_empty((0 if t is None else t.shape[0],), dtype=torch.float64)
    return (q.new_empty(q.shape, dtype=torch.float32), q.new_empty(k.shape, dtype=torch.float32),
            q.new_empty(v.shape, dtype=torch.float32), f64(ts_w), f64(pos_w))


_TENSORS = ("q", "k", "v", "ts", "qts", "tidx", "ts_w", "pos_w", "pos", "hist", "lens")


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[: len(_TENSORS)])
    ctx.consts = inputs[len(_TENSORS):]


def _backward(ctx, dout):
    q, k, v, ts, qts, tidx, ts_w, pos_w, pos, hist, lens = ctx.saved_tensors
    dq, dk, dv, d_ts, d_pos = attention_bwd(q, k, v, dout.float().contiguous(), ts, qts, tidx, ts_w, pos_w, pos,
                                            hist, lens, *ctx.consts)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None if ts_w is None else d_ts.to(ts_w.dtype),
            None if pos_w is None else d_pos.to(pos_w.dtype), None, None, None, None, None, None, None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, ts: Tensor | None, qts: Tensor | None, tidx: Tensor | None,
              ts_w: Tensor | None, pos_w: Tensor | None, pos: Tensor, hist: Tensor, lens: Tensor, *,
              max_seq_len: int, num_buckets: int, alpha: float, divisor: float) -> Tensor:
    """The one-pass HSTU attention of one length bucket, differentiable in q, k, v, ts_w and
    pos_w (see the module docstring for the shapes and dtypes): fp32 [G, H, N, dv],
    unnormalized."""
    return attention_fwd(q, k, v, ts, qts, tidx, ts_w, pos_w, pos, hist, lens, max_seq_len, num_buckets,
                         float(alpha), float(divisor))
