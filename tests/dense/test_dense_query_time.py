"""TowerConfig.time_bias_query: the HSTU time bias taken at the time of the event being
predicted ("next", the public reference) instead of the query's own time ("own").

The tower is checked against a padded transcription of the HSTU paper's equations written
here, forward and backward, on every kernel path; "own" is checked to be the very same
computation as query times equal to the tokens' own; bad `query_time_B` is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from genrec.dense import TowerConfig, build_tower, fused
from genrec.dense.jagged import make_layout
from genrec.dense.kernels import HSTUAttentionParams, hstu_attention_chunked, hstu_attention_reference

D = 16
LENGTHS = [5, 0, 1, 37, 2, 9]          # an empty row, a length-1 row, one row over a query block
TARGETS = [1, 0, 0, 4, 2, 0]           # row 4 is candidates only (no history event)
HAS_FUSED = fused.library() is not None


def cfg(**kw) -> TowerConfig:
    base = dict(embedding_dim=D, num_layers=2, num_heads=2, attention_dim=8, linear_dim=8,
                max_seq_len=64, num_time_buckets=40, dropout=0.0, attention_block_elems=500,
                time_bias_query="next")
    base.update(kw)
    return TowerConfig(**base)


def tower_for(kernel: str, fused_tile: bool, dtype: torch.dtype, **kw):
    tower = build_tower(cfg(kernel=kernel, **kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the default init makes attention tiny; bigger weights use every term
        for p in tower.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    for layer in tower.layers:
        layer.params = dataclasses.replace(layer.params, fused=fused_tile)
    return tower.to(dtype).eval()


def batch(lengths, seed=0, dtype=torch.float32):
    """Jagged values, per-row sorted timestamps with gaps from seconds to days, and a query
    time (some time after the row's last event) per row."""
    g = torch.Generator().manual_seed(seed)
    off = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    T = int(off[-1])
    x = torch.randn(T, D, generator=g, dtype=dtype)
    gaps = (10 ** (5 * torch.rand(T, generator=g))).long()
    ts = torch.cat([torch.cumsum(gaps[int(off[b]):int(off[b + 1])], 0) for b in range(len(lengths))])
    last = torch.stack([ts[int(off[b + 1]) - 1] if lengths[b] else torch.tensor(0) for b in range(len(lengths))])
    query_time = last + torch.randint(1, 10**5, (len(lengths),), generator=g)
    return x, off, ts, query_time


def _hstu_paper_padded(c: TowerConfig, w: dict, x_TD, off, ts_T, num_targets, query_time, own=False):
    """The HSTU paper's layer on padded rows, query time ts(i + 1) (the reference extends the
    timestamps with the last one duplicated; here the last history event takes query_time
    when given), candidates at their own time:

        U, V, Q, K = split(SiLU(Linear(LN(x))))
        A = SiLU(Q K^T + pos_w[p_i - p_j] + ts_w[bucket(ts_q(i) - ts(j))]) / max_seq_len, masked
        y = x + Linear(Dropout(LN(A V) * U))         (Dropout: the identity, towers in eval)

    The tower's defaults: no input scaling or position embedding, alpha 1, no final norm.
    """
    B, H, dq, dv = len(off) - 1, c.num_heads, c.attention_dim, c.linear_dim
    lengths = (off[1:] - off[:-1]).tolist()
    N = max(lengths)
    hist = [n - (num_targets[b] if num_targets is not None else 0) for b, n in enumerate(lengths)]
    x = x_TD.new_zeros(B, N, D)
    ts_k = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        x[b, :lengths[b]] = x_TD[off[b]:off[b + 1]]
        ts_k[b, :lengths[b]] = ts_T[off[b]:off[b + 1]]
    ts_q = ts_k.clone()
    for b in range(B):
        h = hist[b]
        if h and not own:
            last = query_time[b] if query_time is not None else ts_k[b, h - 1]
            ts_q[b, :h] = torch.cat([ts_k[b, 1:h], last.view(1)])
    ar = torch.arange(N)
    hist_B = torch.tensor(hist)[:, None, None]
    i, j = ar[None, :, None], ar[None, None, :]
    mask = (j <= i) & ((j < hist_B) | (j == i)) & (j < torch.tensor(lengths)[:, None, None])
    pos = torch.minimum(ar[None, :], torch.tensor(hist)[:, None])
    rel = (pos[:, :, None] - pos[:, None, :]).clamp(0, c.max_seq_len - 1)
    dt = ts_q[:, :, None] - ts_k[:, None, :]
    bucket = (torch.log(dt.abs().clamp(min=1)) / c.time_bucket_divisor).long().clamp(0, c.num_time_buckets)
    for layer in range(c.num_layers):
        p = {k.split(".", 2)[2]: v for k, v in w.items() if k.startswith(f"layers.{layer}.")}
        xn = F.layer_norm(x, (D,), p["input_norm.weight"], p["input_norm.bias"], c.layer_norm_eps)
        u, v, q, k = F.silu(xn @ p["uvqk.weight"].T + p["uvqk.bias"]).split([H * dv, H * dv, H * dq, H * dq], -1)
        q, k, v = q.view(B, N, H, dq), k.view(B, N, H, dq), v.view(B, N, H, dv)
        rab = p["pos_w"][rel] + p["ts_w"][bucket]
        a = F.silu(torch.einsum("bihd,bjhd->bhij", q, k) + rab[:, None]) / c.max_seq_len * mask[:, None]
        av = torch.einsum("bhij,bjhd->bihd", a, v).reshape(B, N, H * dv)
        av = F.layer_norm(av, (H * dv,), p["attn_norm.weight"], p["attn_norm.bias"], c.layer_norm_eps)
        x = x + (av * u) @ p["output.weight"].T + p["output.bias"]
    return torch.cat([x[b, :lengths[b]] for b in range(B)])


class _TileCalls:
    """Counts calls into the compiled C kernels (to know which path a tower call took)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("tile_forward", "tile_backward", "time_index", "attention_forward",
                     "attention_backward"):
            monkeypatch.setattr(fused, name, self._counted(getattr(fused, name)))

    def _counted(self, fn):
        def wrapper(*args, **kwargs):
            self.count += 1
            return fn(*args, **kwargs)
        return wrapper


KERNEL_PATHS = [  # (kernel, fused tile, tower dtype): every way an HSTU layer can run
    pytest.param("reference", False, torch.float64, id="reference-f64"),
    pytest.param("chunked", False, torch.float64, id="chunked-f64"),
    pytest.param("chunked", False, torch.float32, id="chunked-pytorch-tile-f32"),
    pytest.param("chunked", True, torch.float32, id="chunked-fused-tile-f32",
                 marks=pytest.mark.skipif(not HAS_FUSED, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")),
]


@pytest.mark.parametrize("kernel,fused_tile,dtype", KERNEL_PATHS)
@pytest.mark.parametrize("with_targets", [False, True])
@pytest.mark.parametrize("with_query_time", [False, True])
def test_next_query_time_matches_the_papers_padded_forward_and_backward(
        kernel, fused_tile, dtype, with_targets, with_query_time, monkeypatch):
    tower = tower_for(kernel, fused_tile, dtype)
    x, off, ts, query_time = batch(LENGTHS, dtype=dtype)
    targets = torch.tensor(TARGETS) if with_targets else None
    query_time = query_time if with_query_time else None
    calls = _TileCalls(monkeypatch)
    x = x.requires_grad_()
    got = tower(x, off, ts, targets, query_time)
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    names = [n for n, _ in tower.named_parameters()]
    got_grads = torch.autograd.grad(got, [x] + list(tower.parameters()), upstream.to(dtype))
    assert (calls.count > 0) == fused_tile  # the path under test is the one that ran

    w = {n: p.detach().double().requires_grad_() for n, p in tower.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    want = _hstu_paper_padded(tower.cfg, w, x64, off, ts, targets, query_time)
    want_grads = torch.autograd.grad(want, [x64] + [w[n] for n in names], upstream)
    with torch.no_grad():
        own = _hstu_paper_padded(tower.cfg, w, x64, off, ts, targets, query_time, own=True)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert (want - own).abs().max() > 1e3 * tol  # the query time moves the outputs: a real check
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    for name, a, b in zip(["x"] + names, got_grads, want_grads):
        # fp32 sums over all pairs in a different order: relative to each tensor's scale
        scale = float(b.abs().max().clamp(min=1))
        torch.testing.assert_close(a.double(), b, rtol=10 * tol, atol=10 * tol * scale, msg=name)


@pytest.mark.parametrize("kernel,fused_tile,dtype", KERNEL_PATHS)
def test_own_query_time_is_next_with_query_times_equal_to_own(kernel, fused_tile, dtype):
    """With every timestamp of a row equal (and query_time_B the same time), ts(i + 1) =
    ts(i), so "next" runs its separate query-time path on the very values "own" uses: the
    results must be bit for bit the same. "own" also ignores query_time_B."""
    x, off, _, _ = batch(LENGTHS, dtype=dtype)
    row_T = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    ts = 1000 * (row_T + 1)
    query_time = 1000 * (torch.arange(len(LENGTHS)) + 1)
    targets = torch.tensor(TARGETS)
    towers = {q: tower_for(kernel, fused_tile, dtype, time_bias_query=q) for q in ("own", "next")}
    towers["next"].load_state_dict(towers["own"].state_dict())
    runs = {"own": ("own", None), "own+qt": ("own", query_time), "next": ("next", query_time),
            "next-qt": ("next", None)}
    results = {}
    for name, (q, qt) in runs.items():
        tower = towers[q]
        xi = x.clone().requires_grad_()
        y = tower(xi, off, ts, targets, qt)
        results[name] = [y] + list(torch.autograd.grad((y * torch.sin(y)).sum(), [xi] + list(tower.parameters())))
    for name in ("own+qt", "next", "next-qt"):
        for a, b in zip(results[name], results["own"]):
            assert torch.equal(a, b), name
    # "own" really ignores query_time_B on ordinary timestamps too.
    _, _, ts2, qt2 = batch(LENGTHS, dtype=dtype)
    own = towers["own"]
    assert torch.equal(own(x, off, ts2, targets, qt2), own(x, off, ts2, targets))


def _kernel_params(fused_tile: bool) -> HSTUAttentionParams:
    return HSTUAttentionParams(alpha=0.5, normalizer="num_keys", max_seq_len=64, num_time_buckets=40,
                               time_bucket_divisor=0.301, bucket_min_fill=0.75, block_elems=300,
                               fused=fused_tile)


def _qkv(T, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, 2, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(3)]


def _run_kernel(fn, q, k, v, layout, ts_w, pos_w, p):
    out = fn(q, k, v, layout, ts_w, pos_w, p)
    return [out] + list(torch.autograd.grad((out * torch.sin(out)).sum(), [q, k, v, ts_w, pos_w]))


@pytest.mark.parametrize("kernel,fused_tile,dtype", KERNEL_PATHS)
def test_kernels_with_explicit_own_query_times_are_bit_identical(kernel, fused_tile, dtype):
    """The layout's query-time tensor set to a copy of the own timestamps (so no kernel can
    take the "same tensor" shortcut) gives exactly the "own" results."""
    _, off, ts, _ = batch(LENGTHS)
    q, k, v = _qkv(sum(LENGTHS), dtype)
    g = torch.Generator().manual_seed(4)
    ts_w = torch.randn(41, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    pos_w = torch.randn(64, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    fn = hstu_attention_reference if kernel == "reference" else hstu_attention_chunked
    p = _kernel_params(fused_tile)
    own = make_layout(off, ts, torch.tensor(TARGETS), 64)
    copied = make_layout(off, ts, torch.tensor(TARGETS), 64)
    copied.query_timestamps_T = ts.clone()
    for a, b in zip(_run_kernel(fn, q, k, v, copied, ts_w, pos_w, p), _run_kernel(fn, q, k, v, own, ts_w, pos_w, p)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fused_tile,dtype", [
    pytest.param(False, torch.float64, id="pytorch-tile-f64"),
    pytest.param(True, torch.float32, id="fused-tile-f32",
                 marks=pytest.mark.skipif(not HAS_FUSED, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")),
])
@pytest.mark.parametrize("with_query_time", [False, True])
def test_chunked_kernel_matches_reference_with_next_query_time(fused_tile, dtype, with_query_time):
    """Skewed lengths: several length buckets and query blocks per bucket, bias grads included."""
    lengths, targets = [5, 0, 1, 37, 3, 9, 1, 0, 22], torch.tensor([1, 0, 1, 3, 0, 2, 0, 0, 22])
    _, off, ts, query_time = batch(lengths, seed=2)
    layout = make_layout(off, ts, targets, 64, time_bias_query="next",
                         query_time_B=query_time if with_query_time else None)
    q, k, v = _qkv(sum(lengths), torch.float64)
    g = torch.Generator().manual_seed(4)
    ts_w = torch.randn(41, generator=g, dtype=torch.float64, requires_grad=True)
    pos_w = torch.randn(64, generator=g, dtype=torch.float64, requires_grad=True)
    want = _run_kernel(hstu_attention_reference, q, k, v, layout, ts_w, pos_w, _kernel_params(False))
    ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, ts_w, pos_w)]
    got = _run_kernel(hstu_attention_chunked, *ins[:3], layout, *ins[3:], _kernel_params(fused_tile))
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


def test_layout_query_times_follow_the_worked_example():
    off, ts, nt = torch.tensor([0, 5, 6]), torch.tensor([100, 160, 200, 210, 210, 50]), torch.tensor([2, 0])
    own = make_layout(off, ts, nt, 64, query_time_B=torch.tensor([300, 90]))
    assert own.query_timestamps_T is own.timestamps_T
    nxt = make_layout(off, ts, nt, 64, time_bias_query="next")
    assert nxt.query_timestamps_T.tolist() == [160, 200, 200, 210, 210, 50]
    nxt = make_layout(off, ts, nt, 64, time_bias_query="next", query_time_B=torch.tensor([300, 90]))
    assert nxt.query_timestamps_T.tolist() == [160, 200, 300, 210, 210, 90]
    (bucket,) = nxt.buckets(0.75)[:1]
    assert bucket.query_timestamps_GN.tolist() == [[160, 200, 300, 210, 210]]
    assert bucket.timestamps_GN.tolist() == [[100, 160, 200, 210, 210]]
    empty = make_layout(torch.tensor([0, 0]), torch.zeros(0, dtype=torch.long), None, 64,
                        time_bias_query="next", query_time_B=torch.tensor([5]))
    assert empty.query_timestamps_T.shape == (0,)
    tower = build_tower(cfg())
    assert tower(torch.zeros(0, D), torch.tensor([0, 0]), torch.zeros(0, dtype=torch.long),
                 None, torch.tensor([5])).shape == (0, D)


@pytest.mark.skipif(not HAS_FUSED, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
def test_fused_tile_reads_query_times_with_and_without_a_time_index():
    """The C tile's query time: its per-pair bucketing (no precomputed index) and the index
    built by `time_index` agree bit for bit, forward and backward, and follow qts, not ts."""
    g = torch.Generator().manual_seed(7)
    G, H, N = 3, 2, 20
    ts = torch.cumsum(torch.randint(0, 10**4, (G, N), generator=g), 1)
    qts = ts + torch.randint(-10**5, 10**5, (G, N), generator=g)
    want_idx = (torch.log((qts[:, :, None] - ts[:, None, :]).abs().clamp(min=1).float()) / 0.301).long().clamp(0, 40)
    assert torch.equal(fused.time_index(ts, 40, 0.301, qts).long(), want_idx)
    assert torch.equal(fused.time_index(ts, 40, 0.301, ts), fused.time_index(ts, 40, 0.301))
    s = torch.randn(G, H, N, N, generator=g)
    da = torch.randn(G, H, N, N, generator=g)
    common = dict(G=G, H=H, bq=N, K=N, N=N, i0=0, P=64, NB=40, ts=ts, thr=fused.time_thresholds(40, 0.301),
                  ts_w=torch.randn(41, generator=g), pos_w=torch.randn(64, generator=g),
                  pos=torch.arange(N).expand(G, N).contiguous(), hist=torch.full((G,), N), alpha=0.7,
                  divisor=0.301)

    def run(**kw):
        args = fused.tile_args(**common, **kw)
        a, a2, ds = torch.empty_like(s), torch.empty_like(s), torch.empty_like(s)
        d_ts, d_pos = torch.zeros(41, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
        fused.tile_forward(args, s, a)
        fused.tile_backward(args, s, da, a2, ds, d_ts, d_pos)
        return [a, a2, ds, d_ts, d_pos]

    per_pair = run(qts=qts)
    indexed = run(qts=qts, tidx=fused.time_index(ts, 40, 0.301, qts))
    for a, b in zip(per_pair, indexed):
        assert torch.equal(a, b)
    own = run()
    assert torch.equal(own[0], run(qts=ts.clone())[0])
    assert not torch.equal(own[0], per_pair[0])


def test_bad_query_time_is_a_clear_error():
    x, off, ts, query_time = batch([3, 2])
    with pytest.raises(ValueError, match="time_bias_query"):
        cfg(time_bias_query="previous")
    for q in ("next", "own"):
        tower = build_tower(cfg(time_bias_query=q))
        for bad in (query_time[:1], torch.cat([query_time, query_time[:1]]), query_time[:, None],
                    query_time[0]):
            with pytest.raises(ValueError, match=r"query_time_B must be int64 \[2\]"):
                tower(x, off, ts, None, bad)
            with pytest.raises(ValueError, match=r"query_time_B must be int64 \[2\]"):
                tower.encode_history(x, off, ts, bad)


@pytest.mark.skipif(not HAS_FUSED, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
def test_one_pass_kernels_skip_padding_rows_and_leave_real_rows_bit_equal():
    """Given row lengths, the one-pass kernels do no work for query rows past them: those
    rows' outputs and dq are zero (a kernel that still ran them would leave attention there),
    while every real row and dk / dv / bias gradients keep the bits of a run told nothing."""
    g = torch.Generator().manual_seed(11)
    G, H, N, dq, dv = 4, 2, 37, 12, 20
    lens = torch.tensor([37, 20, 9, 1])
    ts = torch.cumsum(torch.randint(0, 10**4, (G, N), generator=g), 1)
    q, k = torch.randn(G, H, N, dq, generator=g), torch.randn(G, H, N, dq, generator=g)
    v, dout = torch.randn(G, H, N, dv, generator=g), torch.randn(G, H, N, dv, generator=g)
    pad = torch.arange(N)[None, :] >= lens[:, None]  # [G, N]
    dout[pad[:, None, :, None].expand_as(dout)] = 0  # the tower never sends a gradient to padding
    common = dict(G=G, H=H, bq=N, K=N, N=N, i0=0, P=64, NB=40, ts=ts, thr=fused.time_thresholds(40, 0.301),
                  ts_w=torch.randn(41, generator=g), pos_w=torch.randn(64, generator=g),
                  pos=torch.arange(N).expand(G, N).contiguous(), hist=lens, alpha=0.7, divisor=0.301)

    def run(**kw):
        args = fused.tile_args(**common, **kw)
        d_ts, d_pos = torch.zeros(41, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
        out = fused.attention_forward(args, q, k, v)
        return [out, *fused.attention_backward(args, q, k, v, dout, d_ts, d_pos), d_ts, d_pos]

    told, untold = run(lens=lens), run()
    out, dq_, dk, dv_, d_ts, d_pos = told
    rows = pad[:, None, :].expand(G, H, N)
    assert (out[rows] == 0).all() and (dq_[rows] == 0).all()
    assert (untold[0][rows] != 0).any()  # without lengths the padding rows attend to their history
    assert torch.equal(out[~rows], untold[0][~rows]) and torch.equal(dq_[~rows], untold[1][~rows])
    for a, b in zip(told[2:], untold[2:]):
        assert torch.equal(a, b)
