"""Tower benchmarks: `run(quick) -> dict` (called by `genrec bench dense`).

Every comparison is measured side by side in one process (the machine is shared, so
ratios mean more than absolute numbers). All training numbers are forward + backward in
the precision training uses here (`train.precision = "auto"`: fp32 on CPU; bf16 autocast on
a CPU without native bf16 matmuls was measured 5x slower than fp32), or the one in
$GENREC_BENCH_PRECISION, on skewed-length jagged batches; the full-row figures at the
public reference's shapes (`SHAPES`) run in the precision their key names.

Each ratio is the median over rounds in which both sides run in turn (`NAME_spread`: its
median, min, max and rounds); `--quick` runs 5 rounds of smaller batches, the full run 9.

Memory is "activation bytes": the bytes of distinct tensors autograd saves for backward
(counted with saved-tensor hooks), which is what checkpointing and chunking reduce; CPU
PyTorch has no allocator peak counter.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import torch

from . import fused
from .config import TowerConfig
from .precision import autocast
from .tower import build_tower


def _log(msg: str) -> None:
    print(f"[bench dense] {msg}", file=sys.stderr, flush=True)


def _cfg(kind: str, max_len: int, **kw) -> TowerConfig:
    base = dict(kind=kind, embedding_dim=64, num_layers=2, num_heads=2, attention_dim=32,
                linear_dim=32, dropout=0.0, max_seq_len=max_len)
    base.update(kw)
    return TowerConfig(**base)


def _skewed_batch(max_len: int, num_tokens: int, seed: int, mean_frac: float = 0.25):
    """Rows with lengths uniform in [1, 2 * mean_frac * max_len] (mean about mean_frac * max),
    one row at max_len, until about num_tokens tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = [max_len]
    while sum(lengths) < num_tokens:
        lengths.append(int(torch.randint(1, max(2, int(2 * mean_frac * max_len)) + 1, (1,), generator=g)))
    return _rows_batch(lengths, g)


def _full_rows(length: int, rows: int, seed: int, dim: int = 64):
    """`rows` rows of `length` events each (a long-history batch)."""
    return _rows_batch([length] * rows, torch.Generator().manual_seed(seed), dim)


def _rows_batch(lengths: list[int], g: torch.Generator, dim: int = 64):
    """(tokens [T, dim], offsets [B + 1], increasing timestamps [T]) of rows of these lengths."""
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])
    T = int(offsets[-1])
    ts = torch.cumsum(torch.randint(0, 3600, (T,), generator=g), 0)
    return torch.randn(T, dim, generator=g), offsets, ts


def _padded(batch, length: int):
    """The rows of a (tokens, offsets, timestamps) batch padded to `length` with zero tokens
    (timestamps repeat the row's last): what a padded implementation computes on."""
    x, off, ts = batch
    B = off.numel() - 1
    lengths = off[1:] - off[:-1]
    pos = torch.arange(length)
    valid = pos[None, :] < lengths[:, None]                            # [B, length]
    src = torch.where(valid, off[:-1, None] + pos[None, :], off[1:, None] - 1)
    x_pad = torch.where(valid.reshape(-1, 1), x[src.reshape(-1)], 0.0)
    return x_pad, torch.arange(B + 1) * length, ts[src.reshape(-1)]


SL_PROB, SL_MIN = 0.5, 16
"""The stochastic-length setting the bench measures (data.loader.stochastic_length_prob, _min)."""


def _stochastic_length(batch, prob: float, min_len: int, seed: int):
    """The batch with each row longer than min_len cut, with probability prob, to a uniform
    length in [min_len, its length], its most recent events kept: the loader's rule
    (data/loader.py), restated here because the dense floor does not import the data floor."""
    x, offsets, ts = batch
    g = torch.Generator().manual_seed(seed)
    keep = []
    for s, e in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        n = e - s
        if n > min_len and float(torch.rand(1, generator=g)) < prob:
            n = int(torch.randint(min_len, n + 1, (1,), generator=g))
        keep.append(torch.arange(e - n, e))
    idx = torch.cat(keep)
    lengths = torch.tensor([k.numel() for k in keep])
    return x[idx], torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]), ts[idx]


PRECISION = os.environ.get("GENREC_BENCH_PRECISION", "fp32")

SHAPES = (("128x200x50", 128, 200, 50, "fp32"), ("8x2048x64", 8, 2048, 64, "bf16"),
          ("8x2048x64_fp32", 8, 2048, 64, "fp32"))
"""(name, rows, length, D, precision) of the full-row figures `hstu_tokens_per_s_{name}`."""


def _train_step(tower, x, off, ts, precision: str = PRECISION):
    with autocast(precision):
        y = tower(x, off, ts)
    y.float().square().mean().backward()


def _spread(values: list[float]) -> dict:
    # Each ground floor (data/, sparse/, dense/) keeps its own timing helpers: they import
    # nothing from each other, and no shared place sits below them.
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _side_by_side(fns: dict, reps: int) -> dict[str, list[float]]:
    """Seconds per call of each function, `reps` rounds, the functions taking turns within a
    round: a ratio of two sides is then taken round by round, so a burst of load on a shared
    machine slows both sides of the same round rather than one of them. Objects alive before
    are frozen out of the garbage collector, as the trainer does after its set-up (otherwise
    its full collections scan torch's objects: 6% of a 128 x 200 step)."""
    gc.collect()
    gc.freeze()
    for fn in fns.values():
        fn()  # warm-up (also loads the fused tile)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    gc.unfreeze()  # frozen objects are never freed, not even at exit
    return times


def _ratio(out: dict, key: str, numer: list[float], denom: list[float]) -> None:
    """out[key] = median over rounds of numer / denom; out[key + "_spread"] its spread."""
    spread = _spread([a / b for a, b in zip(numer, denom)])
    out[key], out[key + "_spread"] = spread["median"], spread


def _hstu_vs_transformer(out: dict, n: int, num_tokens: int, t: dict) -> None:
    """Tokens/s of each side and their ratio at row length n, from `_side_by_side` times."""
    for side in ("hstu", "transformer"):
        out[f"{side}_tokens_per_s_{n}"] = round(num_tokens / statistics.median(t[side]))
    _ratio(out, f"hstu_vs_transformer_{n}", t["transformer"], t["hstu"])
    _log(f"len {n}: {num_tokens} tokens, HSTU {out[f'hstu_tokens_per_s_{n}']} tok/s, "
         f"Transformer {out[f'transformer_tokens_per_s_{n}']} tok/s")


def _activation_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type == "cpu" and t.untyped_storage().nbytes():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _step_fn(cfg: TowerConfig, batch, precision: str = PRECISION):
    tower = build_tower(cfg)
    x, off, ts = batch
    x = x.clone().requires_grad_()
    return lambda: _train_step(tower, x, off, ts, precision)


def _free_threads() -> int:
    """Intra-op threads to use: on a shared box, OpenMP barriers with a descheduled thread
    make every small op wait a scheduler tick (measured ~100x slower at 2 threads under
    load 7 on 2 cores), so use only the cores other processes leave idle."""
    load = os.getloadavg()[0]
    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) - round(load)))


def run(quick: bool) -> dict:
    if os.environ.get("GENREC_BENCH_DEVICE", "cpu") == "cuda":
        return run_cuda(quick)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("GENREC_BENCH_THREADS", _free_threads())))
    try:
        return _run(quick)
    finally:
        torch.set_num_threads(threads_before)


def _run(quick: bool) -> dict:
    torch.manual_seed(0)
    reps = 5 if quick else 9
    lib = fused.library()
    out: dict = {"threads": torch.get_num_threads(), "load_average": os.getloadavg()[0],
                 "precision": PRECISION, "kernel_isa": lib.isa if lib is not None else "pytorch"}

    lengths = [256, 1024, 4096] + ([] if quick else [8192])
    for n in lengths:
        tokens = (2 * n if quick else 8 * n)
        batch = _skewed_batch(n, tokens, seed=n)
        t = _side_by_side({"hstu": _step_fn(_cfg("hstu", n), batch),
                           "transformer": _step_fn(_cfg("transformer", n), batch)}, reps)
        _hstu_vs_transformer(out, n, batch[0].shape[0], t)

    # Full-length rows at the shapes of the public reference's measurements (2 layers, 1
    # head, attention and value widths D): 128 x 200 x 50 in fp32, 8 x 2048 x 64 in bf16 and fp32.
    for name, rows, n, d, precision in SHAPES:
        batch = _full_rows(n, rows, seed=n + d, dim=d)
        cfgs = {kind: _cfg(kind, n, embedding_dim=d, num_heads=1, attention_dim=d, linear_dim=d)
                for kind in ("hstu", "transformer")}
        t = _side_by_side({kind: _step_fn(cfg, batch, precision) for kind, cfg in cfgs.items()}, reps)
        for side in ("hstu", "transformer"):
            out[f"{side}_tokens_per_s_{name}"] = round(rows * n / statistics.median(t[side]))
        _log(f"{name} ({precision}): HSTU {out[f'hstu_tokens_per_s_{name}']} tok/s, "
             f"Transformer {out[f'transformer_tokens_per_s_{name}']} tok/s")

    # Jagged vs padded, mean = max/4, on the same batch quick or full (the ratio depends on
    # how many rows the padding spans). Padded: every row padded to the longest, the padding
    # computed as a padded implementation computes it (through every layer, attended and
    # masked); one bucket: the jagged tower with all rows in one length bucket (its kernels
    # skip each row's padding, so this isolates the bucketing).
    n = 1024
    batch = _skewed_batch(n, 16 * n, seed=7)
    t = _side_by_side({"jagged": _step_fn(_cfg("hstu", n), batch),
                       "padded": _step_fn(_cfg("hstu", n), _padded(batch, n)),
                       "one_bucket": _step_fn(_cfg("hstu", n, bucket_min_fill=1e-9), batch)}, reps)
    _ratio(out, "jagged_vs_padded", t["padded"], t["jagged"])
    _ratio(out, "bucketed_vs_one_bucket", t["one_bucket"], t["jagged"])
    _log(f"jagged vs padded {out['jagged_vs_padded']:.2f}x, bucketed vs one bucket {out['bucketed_vs_one_bucket']:.2f}x")

    # Stochastic length (data.loader.stochastic_length_prob): HSTU on full 4,096-event rows,
    # against the same rows cut as the loader cuts them.
    n = 4096
    full = _full_rows(n, 2 if quick else 8, seed=11)
    cut = _stochastic_length(full, SL_PROB, SL_MIN, seed=12)
    t = _side_by_side({"full": _step_fn(_cfg("hstu", n), full), "cut": _step_fn(_cfg("hstu", n), cut)}, reps)
    _ratio(out, f"stochastic_length_speedup_{n}", t["full"], t["cut"])
    out[f"stochastic_length_tokens_kept_{n}"] = cut[0].shape[0] / full[0].shape[0]
    out["stochastic_length_prob"], out["stochastic_length_min"] = SL_PROB, SL_MIN
    _log(f"stochastic length at {n}: {out[f'stochastic_length_speedup_{n}']:.2f}x, "
         f"{out[f'stochastic_length_tokens_kept_{n}']:.2f} of the tokens kept")

    # Activation checkpointing: activation bytes saved for backward, with / without.
    n = 1024
    x, off, ts = _skewed_batch(n, 4 * n, seed=8)
    mem = {}
    for ckpt in (False, True):
        tower = build_tower(_cfg("hstu", n, activation_checkpointing=ckpt, num_layers=4))
        xr = x.clone().requires_grad_()
        mem[ckpt] = _activation_bytes(lambda: _train_step(tower, xr, off, ts))
    out["activation_bytes_no_checkpointing"] = mem[False]
    out["activation_bytes_checkpointing"] = mem[True]
    out["checkpointing_memory_ratio"] = mem[True] / mem[False]
    for kind in ("hstu", "transformer"):
        tower = build_tower(_cfg(kind, n))
        xr = x.clone().requires_grad_()
        out[f"activation_bytes_{kind}_1024"] = _activation_bytes(lambda: _train_step(tower, xr, off, ts))
    _log(f"checkpointing activation bytes ratio {out['checkpointing_memory_ratio']:.3f}")

    _kv_cache(out, quick, reps)
    return out


def _kv_cache(out: dict, quick: bool, reps: int) -> None:
    """KV cache (M-FALCON) vs full recompute: 1,000 history events, 16..1,024 candidates.
    Serving encodes the history once per request and scores candidate micro-batches against
    it; without the cache every micro-batch of 256 re-encodes the history with its
    candidates: `kv_cache_speedup_1024` takes that recompute of 256 in the same rounds as
    the 1,024 candidates' encode + score."""
    hist_len = 1000
    counts = [16, 256, 1024] if quick else [16, 64, 256, 1024]
    tower = build_tower(_cfg("hstu", hist_len + max(counts), target_micro_batch=256)).eval()
    g = torch.Generator().manual_seed(9)
    hist = torch.randn(hist_len, 64, generator=g)
    hist_ts = torch.cumsum(torch.randint(0, 3600, (hist_len,), generator=g), 0)
    runs, recomputes = {}, {}
    for c in counts:
        cand = torch.randn(c, 64, generator=g)
        cand_ts = hist_ts[-1] + torch.arange(c)
        full = torch.cat([hist, cand])
        full_ts = torch.cat([hist_ts, cand_ts])

        def recompute(c=c, full=full, full_ts=full_ts):
            with torch.no_grad(), autocast(PRECISION):
                tower(full, torch.tensor([0, hist_len + c]), full_ts, torch.tensor([c]))

        def cached():
            with autocast(PRECISION):
                _, cache = tower.encode_history(hist, torch.tensor([0, hist_len]), hist_ts)
                tower.score_targets(cache, cand, torch.tensor([0, c]), cand_ts)

        with autocast(PRECISION):
            _, cache = tower.encode_history(hist, torch.tensor([0, hist_len]), hist_ts)

        def score_only():
            with autocast(PRECISION):
                tower.score_targets(cache, cand, torch.tensor([0, c]), cand_ts)

        recomputes[c] = recompute
        fns = {"full": recompute, "cached": cached, "score": score_only}
        if c == 1024:
            fns["full_256"] = recomputes[256]
        t = _side_by_side(fns, reps)
        runs[c] = t
        out[f"kv_cache_full_recompute_s_{c}"] = statistics.median(t["full"])
        out[f"kv_cache_encode_plus_score_s_{c}"] = statistics.median(t["cached"])
        out[f"kv_cache_score_only_s_{c}"] = statistics.median(t["score"])
        _log(f"{c} candidates: full {out[f'kv_cache_full_recompute_s_{c}'] * 1e3:.1f} ms, encode+score "
             f"{out[f'kv_cache_encode_plus_score_s_{c}'] * 1e3:.1f} ms, "
             f"score only {out[f'kv_cache_score_only_s_{c}'] * 1e3:.1f} ms")
    c = 1024
    _ratio(out, "kv_cache_speedup_1024", [f * (c // 256) for f in runs[c]["full_256"]], runs[c]["cached"])
    _ratio(out, "kv_cache_speedup_vs_single_forward_1024", runs[c]["full"], runs[c]["cached"])



def run_cuda(quick: bool) -> dict:
    """GENREC_BENCH_DEVICE=cuda (scripts/gpu_bench_dense.sh): HSTU through the Triton kernel
    against the SDPA Transformer, fwd + bwd in bf16 autocast on one GPU, same D, heads and
    layers, skewed jagged batches; plus the Triton kernel's largest deviation from the fp64
    PyTorch reference at a small shape (forward and dq)."""
    from . import triton_hstu
    from .jagged import make_layout
    from .kernels import HSTUAttentionParams, hstu_attention_reference

    if not torch.cuda.is_available():
        raise RuntimeError("GENREC_BENCH_DEVICE=cuda: no CUDA device here")
    if not triton_hstu.available():
        raise RuntimeError('GENREC_BENCH_DEVICE=cuda needs Triton: pip install -e ".[gpu]"')
    dev = torch.device("cuda")
    torch.manual_seed(0)
    reps = 5 if quick else 9
    out: dict = {"device": torch.cuda.get_device_name(dev), "precision": "bf16"}

    def step(kind, n, batch):
        tower = build_tower(_cfg(kind, n)).to(dev)
        x, off, ts = (t.to(dev) for t in batch)
        x.requires_grad_()

        def fn():
            with autocast("bf16", "cuda"):
                y = tower(x, off, ts)
            y.float().square().mean().backward()
            torch.cuda.synchronize()
        return fn

    for n in [1024, 4096] + ([] if quick else [8192]):
        batch = _skewed_batch(n, 8 * n, seed=n)
        t = _side_by_side({"hstu": step("hstu", n, batch), "transformer": step("transformer", n, batch)}, reps)
        _hstu_vs_transformer(out, n, batch[0].shape[0], t)

    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([300, 1, 0, 77, 150])
    off = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    T = int(off[-1])
    ts = torch.cumsum(torch.randint(0, 10**5, (T,), generator=g), 0)
    layout = make_layout(off.to(dev), ts.to(dev), None, 512)
    p = HSTUAttentionParams(alpha=32 ** -0.5, normalizer="max_seq_len", max_seq_len=512, num_time_buckets=128,
                            time_bucket_divisor=0.301, bucket_min_fill=0.75, block_elems=4_000_000)
    q, k, v = (torch.randn(T, 2, 32, generator=g, dtype=torch.float64).to(dev).requires_grad_() for _ in range(3))
    ts_w = (0.1 * torch.randn(129, generator=g, dtype=torch.float64)).to(dev)
    pos_w = (0.1 * torch.randn(512, generator=g, dtype=torch.float64)).to(dev)
    want = hstu_attention_reference(q, k, v, layout, ts_w, pos_w, p)
    (dq_want,) = torch.autograd.grad(want.sum(), q)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    got = triton_hstu.hstu_attention_triton(q32, k32, v32, layout, ts_w.float(), pos_w.float(), p)
    (dq_got,) = torch.autograd.grad(got.sum(), q32)
    out["triton_fp32_max_rel_error_out"] = float((got.double() - want).abs().max() / want.abs().max())
    out["triton_fp32_max_rel_error_dq"] = float((dq_got.double() - dq_want).abs().max() / dq_want.abs().max())
    _log(f"Triton vs fp64 reference: out {out['triton_fp32_max_rel_error_out']:.2e}, "
         f"dq {out['triton_fp32_max_rel_error_dq']:.2e} (relative to the largest value)")
    return out
