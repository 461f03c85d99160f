"""HSTU pointwise attention as Triton kernels (CUDA; on CPU under TRITON_INTERPRET=1).

The same function as `kernels.hstu_attention_reference` (see kernels.py for the masks and
the formula), straight on the jagged tokens: no padding, no length buckets, and the
relative bias computed inside the kernel from positions and timestamps, never stored.

    forward   grid (query blocks, rows, heads): out_i = 1/n_i sum_j vis SiLU(s_ij) v_j,
              s_ij = alpha q_i.k_j + pos_w[pos_i - pos_j] + ts_w[bucket(ts_q(i) - ts(j))]
    backward  grid (key blocks, rows, heads) for dK, dV; grid (query blocks, rows, heads)
              for dQ and the bias gradients. Tiles are recomputed (flash-style): nothing
              [N, N] is kept between the passes.

Bias gradients without atomics: each dQ program sums its tiles' dS into its own row of a
[programs, bins] scratch (a read-modify-write no other program touches), looping over the
bins that occur in the tile; the rows are then summed in a fixed order. The result is the
same on every run, which atomic adds into the shared bins would not give.

The time bucket matches the PyTorch formula exactly: log gives a guess, and the integer
thresholds of `bias.time_thresholds` correct it by one step either way (as the C tile does).

Triton is the optional `[gpu]` extra (`pip install -e ".[test,gpu]"`); `available()` says
whether it imports. The tests run these kernels on CPU under Triton's interpreter.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from .bias import time_thresholds
from .jagged import JaggedLayout

NORMALIZERS = {"max_seq_len": 0, "num_keys": 1, "none": 2}


@functools.cache
def available() -> bool:
    """Triton is installed (the `[gpu]` extra)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels():
    """The kernel module, imported at first use (Triton JIT-compiles per shape on the GPU)."""
    import triton

    from . import _triton_kernels as k

    return triton, k.fwd, k.bwd_kv, k.bwd_q


def compile_for_cuda(arch: int = 90, dtype: str = "bf16", dq: int = 32, dv: int = 32) -> dict[str, int]:
    """Compile the three kernels ahead of time for a CUDA architecture (e.g. 80, 90), down to
    cubin, with no GPU needed (Triton ships ptxas): -> {kernel: cubin bytes}. A kernel that
    would not compile on the GPU fails here. Needs TRITON_INTERPRET unset."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreted():
        raise RuntimeError("compile_for_cuda needs TRITON_INTERPRET unset (the interpreter does not compile)")
    _, *kernels = _kernels()
    ptr = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}[dtype]
    types = dict.fromkeys(("Q", "K", "V", "O", "DO", "DK", "DV_", "DQ_"), ptr)
    types.update(dict.fromkeys(("DTS", "DPOS", "TSW", "POSW"), "*fp32"))
    types.update(dict.fromkeys(("OFFS", "HIST", "POS", "TS", "QTS", "THR"), "*i64"))
    types.update(dict.fromkeys(("alpha", "inv_div", "inv_max"), "fp32"))
    types.update(dict.fromkeys(("H", "DQ", "DV", "P", "NB", "NM"), "i32"))
    const = dict(NORM=1, HAS_TS=True, HAS_POS=True, F32=False, **_blocks(dq, dv))
    sizes = {}
    for fn in kernels:
        sig = {n: "constexpr" if n in const else types[n] for n in inspect.signature(fn.fn).parameters}
        src = ASTSource(fn=fn, signature=sig, constexprs={n: const[n] for n in sig if n in const})
        sizes[fn.fn.__name__] = len(triton.compile(src, target=GPUTarget("cuda", arch, 32)).asm["cubin"])
    return sizes


def _blocks(dq: int, dv: int) -> dict:
    import triton

    return dict(BM=32, BN=32, BDQ=max(16, triton.next_power_of_2(dq)), BDV=max(16, triton.next_power_of_2(dv)))


class _HSTUTritonFn(torch.autograd.Function):
    """Rows with at least one token (hstu_attention_triton returns early on an empty batch)."""

    @staticmethod
    def forward(ctx, q, k, v, ts_w, pos_w, layout: JaggedLayout, p):
        triton, fwd, _, _ = _kernels()
        H, DQ, DV = q.shape[1], q.shape[2], v.shape[2]
        # The arguments on the device and the block sizes, made once and kept for backward.
        args, blocks = _common(layout, ts_w, pos_w, p, q.device), _blocks(DQ, DV)
        out = torch.empty_like(v)
        grid = (triton.cdiv(layout.max_len, blocks["BM"]), layout.batch_size, H)
        fwd[grid](q, k, v, out, *args["tensors"], H, DQ, DV, *args["scalars"], **args["flags"], **blocks)
        ctx.save_for_backward(q, k, v, ts_w, pos_w)
        ctx.layout, ctx.p, ctx.args, ctx.blocks = layout, p, args, blocks
        return out

    @staticmethod
    def backward(ctx, dout):
        triton, _, bwd_kv, bwd_q = _kernels()
        q, k, v, ts_w, pos_w = ctx.saved_tensors
        layout, p, args, blocks = ctx.layout, ctx.p, ctx.args, ctx.blocks
        H, DQ, DV = q.shape[1], q.shape[2], v.shape[2]
        B, dev = layout.batch_size, q.device
        dout = dout.to(v.dtype).contiguous()
        nm = triton.cdiv(layout.max_len, blocks["BM"])
        nn_ = triton.cdiv(layout.max_len, blocks["BN"])
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        programs = B * H * nm
        d_ts = torch.zeros(programs if ts_w is not None else 1, p.num_time_buckets + 1, device=dev)
        d_pos = torch.zeros(programs if pos_w is not None else 1, p.max_seq_len, device=dev)
        bwd_kv[(nn_, B, H)](q, k, v, dout, dk, dv, *args["tensors"], H, DQ, DV, *args["scalars"],
                            **args["flags"], **blocks)
        bwd_q[(nm, B, H)](q, k, v, dout, dq, d_ts, d_pos, *args["tensors"], H, DQ, DV, *args["scalars"],
                          nm, **args["flags"], **blocks)
        g_ts = None if ts_w is None else d_ts.sum(0).to(ts_w.dtype)
        g_pos = None if pos_w is None else d_pos.sum(0).to(pos_w.dtype)
        return dq, dk, dv, g_ts, g_pos, None, None


def _common(layout: JaggedLayout, ts_w, pos_w, p, dev) -> dict:
    """The kernels' shared arguments: row and token tensors, scalars, compile-time flags."""
    thr = time_thresholds(p.num_time_buckets, p.time_bucket_divisor).to(dev)
    dummy = torch.zeros(1, device=dev)
    tensors = (layout.offsets_B1.to(dev), layout.history_lengths_B.to(dev), layout.positions_T.to(dev),
               layout.timestamps_T.to(dev), layout.query_timestamps_T.to(dev),
               dummy if ts_w is None else ts_w.detach().float().contiguous(),
               dummy if pos_w is None else pos_w.detach().float().contiguous(), thr)
    scalars = (float(p.alpha), 1.0 / p.time_bucket_divisor, 1.0 / p.max_seq_len, p.max_seq_len, p.num_time_buckets)
    flags = dict(NORM=NORMALIZERS[p.normalizer], HAS_TS=ts_w is not None, HAS_POS=pos_w is not None,
                 F32=interpreted())
    return {"tensors": tensors, "scalars": scalars, "flags": flags}


def hstu_attention_triton(q_THd, k_THd, v_THd, layout: JaggedLayout, ts_w, pos_w, p) -> torch.Tensor:
    """`kernels.hstu_attention_reference` as Triton kernels on the jagged tokens."""
    if not available():
        raise RuntimeError('the Triton HSTU kernel needs Triton: pip install -e ".[gpu]"')
    if not (q_THd.is_cuda or interpreted()):
        raise RuntimeError("the Triton HSTU kernel runs on CUDA tensors (on CPU only under TRITON_INTERPRET=1); "
                           'use TowerConfig.kernel="chunked" on CPU')
    if q_THd.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton HSTU kernel takes fp32 / bf16 / fp16 tensors, got {q_THd.dtype}")
    if layout.num_tokens == 0:
        return v_THd.new_zeros(v_THd.shape)
    return _HSTUTritonFn.apply(q_THd.contiguous(), k_THd.contiguous(), v_THd.contiguous(), ts_w, pos_w, layout, p)
