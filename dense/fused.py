"""ctypes loader for csrc/hstu_tile.c and csrc/topk_scan.c: the one-pass fp32 HSTU attention
kernels, the fused elementwise part of the chunked (bf16) HSTU tile, serving's one-pass
SiLU(scores + bias) of candidates against a cached history (`bias_silu_`), and the exact
top-k retrieval scan serving runs over its item index (`scan_top_k`).

The library is built by the install command (setup.py: `pip install -e .`) beside this
file, once per instruction set in `BUILDS` (on x86: `_hstu_tile_avx512*.so` and
`_hstu_tile*.so`, AVX2); loading takes the first whose CPU features this CPU has.
GENREC_DENSE_ISA=avx2 chooses the AVX2 build on an AVX-512 CPU (to compare them). Not
built, or built for features this CPU lacks: the first fused call raises an error saying
how to fix it. GENREC_DENSE_FUSED=0 chooses the plain PyTorch tile explicitly (same
results, about a third of the speed), and says so once.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from .bias import time_thresholds

_lib: ctypes.CDLL | None | bool = False  # False: not tried yet


class TileArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("G", "H", "bq", "K", "N", "i0", "P", "NB")] + [
        ("ts", ctypes.c_void_p), ("thr", ctypes.c_void_p), ("ts_w", ctypes.c_void_p),
        ("pos_w", ctypes.c_void_p), ("pos", ctypes.c_void_p), ("hist", ctypes.c_void_p),
        ("alpha", ctypes.c_float), ("inv_divisor", ctypes.c_float), ("tidx", ctypes.c_void_p),
        ("nthreads", ctypes.c_int64), ("qts", ctypes.c_void_p), ("len", ctypes.c_void_p)]


BUILDS = {"x86_64": (("avx512", "_hstu_tile_avx512", ("avx2", "fma", "avx512f", "avx512vl", "avx512bw", "avx512dq")),
                    ("avx2", "_hstu_tile", ("avx2", "fma")))}
"""By machine, best first: (name, library stem, CPU features it is built for; see setup.py).
Other machines have one portable build, `_hstu_tile`."""


class NativeKernelError(RuntimeError):
    """The native HSTU tile is missing or cannot run on this CPU."""


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    except OSError:
        pass
    return set()


def has_native_bf16() -> bool:
    """This CPU multiplies bf16 natively (AVX-512 BF16 or AMX): ATen's bf16 matmuls then run at
    about twice the fp32 rate (2.3-2.6x for the serving path's [512 x 32] x [32 x 1,024]
    products on one thread of an AVX-512 BF16 CPU); without it they are emulated, slower."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def library() -> ctypes.CDLL | None:
    """The loaded native tile; None only when GENREC_DENSE_FUSED=0 chose the PyTorch tile."""
    global _lib
    if _lib is not False:
        return _lib
    if os.environ.get("GENREC_DENSE_FUSED", "1") == "0":
        print("genrec.dense: GENREC_DENSE_FUSED=0: the HSTU tile runs in plain PyTorch (slower)",
              file=sys.stderr, flush=True)
        _lib = None
        return None
    here = Path(__file__).parent
    fix = ("reinstall with the README's install command (`pip install -e .`, which needs a C compiler with "
           "OpenMP), or set GENREC_DENSE_FUSED=0 to run the PyTorch tile instead")
    builds = BUILDS.get(platform.machine(), (("portable", "_hstu_tile", ()),))
    chosen = os.environ.get("GENREC_DENSE_ISA")
    if chosen is not None:
        if chosen not in [name for name, _, _ in builds]:
            raise NativeKernelError(f"GENREC_DENSE_ISA={chosen!r}: this machine's builds are "
                                    f"{[name for name, _, _ in builds]}")
        builds = tuple(b for b in builds if b[0] == chosen)
    flags, found = _cpu_flags(), []
    for name, stem, features in builds:
        path = next(iter(sorted(here.glob(f"{stem}.*so"))), None)
        if path is None:
            continue
        found.append(path)
        missing = [f for f in features if f not in flags]
        if not missing:
            break
    else:
        if not found:
            raise NativeKernelError(f"the native HSTU tile is not built (no {builds[-1][1]}*.so in {here}): {fix}")
        raise NativeKernelError(f"{found[-1]} needs CPU features {missing}, which this CPU lacks: {fix}")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeKernelError(f"cannot load {path}: {e}: {fix}") from None
    lib.isa = name
    lib.hstu_key_block.restype = ctypes.c_int64
    lib.key_block = int(lib.hstu_key_block())
    lib.scan_top_k.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                               ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.hstu_bias_silu.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_void_p, ctypes.c_int64]
    lib.hstu_time_index.argtypes = [ctypes.POINTER(TileArgs), ctypes.c_void_p]
    lib.hstu_tile_fwd.argtypes = [ctypes.POINTER(TileArgs), ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_int]
    lib.hstu_attn_fwd.argtypes = [ctypes.POINTER(TileArgs), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.hstu_attn_bwd.argtypes = [ctypes.POINTER(TileArgs), ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 10
    lib.hstu_tile_bwd.argtypes = [ctypes.POINTER(TileArgs), ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    # The kernels that allocate scratch say whether it could be (dense/csrc/kernel_status.h).
    for kernel in _CHECKED:
        getattr(lib, kernel).restype = ctypes.c_int
    _lib = lib
    return lib


_CHECKED = ("scan_top_k", "hstu_time_index", "hstu_tile_fwd", "hstu_tile_bwd", "hstu_attn_fwd", "hstu_attn_bwd")
NO_MEMORY = 1
"""What a kernel of `_CHECKED` returns when its scratch could not be allocated."""


def _run(kernel: str, *args) -> None:
    """Call a native kernel of `_CHECKED`; MemoryError naming it where its scratch did not fit
    (its outputs are undefined then)."""
    if getattr(library(), kernel)(*args) == NO_MEMORY:
        raise MemoryError(f"native kernel {kernel}: out of memory for its scratch buffers (a smaller batch, "
                          f"shorter rows or fewer threads need less)")


def supports(*tensors: torch.Tensor | None) -> bool:
    """The fused tile handles contiguous CPU fp32/bf16 tensors."""
    return all(t is None or (t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16))
               for t in tensors) and library() is not None


def _bf(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def tile_args(*, G, H, bq, K, N, i0, P, NB, ts, thr, ts_w, pos_w, pos, hist, alpha,
              divisor, tidx=None, qts=None, lens=None) -> TileArgs:
    """`qts`: [G, N] query times of the time bias; None means the same as `ts`. `lens`: [G]
    row lengths, past which query rows are padding the one-pass kernels skip (None: N)."""
    # Every tensor passed here must stay alive (and contiguous) for the duration of the call.
    return TileArgs(G, H, bq, K, N, i0, P, NB, _ptr(ts), _ptr(thr), _ptr(ts_w), _ptr(pos_w),
                    _ptr(pos), _ptr(hist), alpha, 1.0 / divisor, _ptr(tidx),
                    torch.get_num_threads(), _ptr(qts), _ptr(lens))


def time_index(ts_GN: torch.Tensor, num_buckets: int, divisor: float,
               query_ts_GN: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [G, N, N] time bucket of every (query i, key j) pair, of query_ts_GN[g, i] -
    ts_GN[g, j] (query times default to ts_GN); the C twin of bias.time_buckets."""
    G, N = ts_GN.shape
    ts_GN = ts_GN.contiguous()
    if query_ts_GN is not None:
        assert query_ts_GN.shape == ts_GN.shape
        query_ts_GN = query_ts_GN.contiguous()
    thr = time_thresholds(num_buckets, divisor)
    out = torch.empty(G, N, N, dtype=torch.uint8)
    args = tile_args(G=G, H=1, bq=N, K=N, N=N, i0=0, P=1, NB=num_buckets, ts=ts_GN, thr=thr,
                     ts_w=None, pos_w=None, pos=None, hist=None, alpha=1.0, divisor=divisor,
                     qts=query_ts_GN)
    _run("hstu_time_index", ctypes.byref(args), out.data_ptr())
    return out


def tile_forward(args: TileArgs, s: torch.Tensor, a: torch.Tensor) -> None:
    assert s.is_contiguous() and a.is_contiguous()
    _run("hstu_tile_fwd", ctypes.byref(args), s.data_ptr(), _bf(s), a.data_ptr(), _bf(a))


def bias_silu_(s: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """s <- SiLU(s + bias) in place, one native pass: s fp32 / bf16 [G, R, L] (contiguous),
    bias fp32 [G, L] shared by the R rows of each g, or None."""
    assert s.is_contiguous() and s.dtype in (torch.float32, torch.bfloat16) and s.dim() == 3
    G, R, L = s.shape
    if bias is not None:
        bias = bias.float().contiguous()
        assert bias.shape == (G, L)
    library().hstu_bias_silu(G * R, L, R, s.data_ptr(), _bf(s), _ptr(bias), torch.get_num_threads())
    return s


def key_blocks(k: torch.Tensor) -> torch.Tensor:
    """[G, H, K, d] -> [G, H, KP / W, d, W] (W: the library's vector width, 8 or 16 floats;
    KP: K rounded up to W, zero padded): W keys' scores are then one vector instruction per
    feature over contiguous memory."""
    G, H, K, d = k.shape
    w = library().key_block
    kp = (K + w - 1) // w * w
    return F.pad(k, (0, 0, 0, kp - K)).view(G, H, kp // w, w, d).transpose(-1, -2).contiguous()


def attention_forward(args: TileArgs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The whole attention of fp32 queries q [G, H, bq, dq] (rows i0.. of `args`) against
    keys k [G, H, K, dq] and values v [G, H, K, dv] in one native pass, no [N, N] tile:
    [G, H, bq, dv], not yet scaled by the normalizer."""
    G, H, bq, dq = q.shape
    dv = v.shape[-1]
    kb, q, v = key_blocks(k), q.contiguous(), v.contiguous()
    out = torch.empty(G, H, bq, dv, dtype=torch.float32)
    _run("hstu_attn_fwd", ctypes.byref(args), dq, dv, q.data_ptr(), kb.data_ptr(), v.data_ptr(), out.data_ptr())
    return out


def attention_backward(args: TileArgs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                       d_ts: torch.Tensor | None, d_pos: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole attention backward of fp32 q, k [G, H, N, dq], v [G, H, N, dv] in one native
    pass (every row a query, `args` with bq = K = N): (dq, dk, dv) for dout [G, H, N, dv]
    already scaled by the normalizer; adds the bias gradients to the float64 d_ts / d_pos."""
    G, H, N, dq = q.shape
    dv = v.shape[-1]
    kb, vb = key_blocks(k), key_blocks(v)
    q, k, dout = q.contiguous(), k.contiguous(), dout.contiguous()
    dq_out, dk_out = torch.empty(G, H, N, dq), torch.empty(G, H, N, dq)
    dv_out = torch.empty(G, H, N, dv)
    _run("hstu_attn_bwd", ctypes.byref(args), dq, dv, q.data_ptr(), kb.data_ptr(), vb.data_ptr(), k.data_ptr(),
         dout.data_ptr(), dq_out.data_ptr(), dk_out.data_ptr(), dv_out.data_ptr(), _ptr(d_ts), _ptr(d_pos))
    return dq_out, dk_out, dv_out


def tile_backward(args: TileArgs, s, da, a, ds, d_ts, d_pos) -> None:
    assert s.is_contiguous() and da.is_contiguous() and a.is_contiguous() and ds.is_contiguous()
    _run("hstu_tile_bwd", ctypes.byref(args), s.data_ptr(), _bf(s), da.data_ptr(), _bf(da),
         a.data_ptr(), _bf(a), ds.data_ptr(), _bf(ds), _ptr(d_ts), _ptr(d_pos))


def scan_top_k(queries_BD: torch.Tensor, rows_ND: torch.Tensor, scale_N: torch.Tensor | None, k: int,
               mask_BN: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k inner products of fp32 queries [B, D] against an item index in one native
    pass (csrc/topk_scan.c): rows int8 [N, D] with a per-row scale [N] (score = scale_n *
    q . row_n), or fp32 [N, D] with scale None. mask_BN (bool or uint8 [B, N], or None):
    rows each query may return. -> (scores [B, k], row positions [B, k]), best first, ties
    to the lower position; a query with fewer than k rows left is padded with -inf / -1."""
    B, D = queries_BD.shape
    N = rows_ND.shape[0]
    assert rows_ND.shape == (N, D) and rows_ND.is_contiguous() and k >= 1
    assert (scale_N is None) == (rows_ND.dtype == torch.float32) and rows_ND.dtype in (torch.float32, torch.int8)
    q = queries_BD.detach().float().contiguous()
    scale = None if scale_N is None else scale_N.float().contiguous()
    mask = None if mask_BN is None else mask_BN.to(torch.uint8).contiguous()
    assert mask is None or mask.shape == (B, N)
    out_s = torch.full((B, k), float("-inf"))
    out_i = torch.full((B, k), -1, dtype=torch.int64)
    found = torch.zeros(B, dtype=torch.int64)
    _run("scan_top_k", q.data_ptr(), B, D, rows_ND.data_ptr(), int(scale is not None), _ptr(scale), N,
         _ptr(mask), N, k, out_s.data_ptr(), out_i.data_ptr(), found.data_ptr(), torch.get_num_threads())
    return out_s, out_i
