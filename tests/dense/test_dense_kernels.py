"""Fast kernels vs the reference (the specification), and the reference vs a per-pair loop."""

from __future__ import annotations

import math
import platform

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
import torch.nn.functional as F

from genrec.dense import fused, kernels
from genrec.dense.jagged import make_layout
from genrec.dense.kernels import (HSTUAttentionParams, hstu_attention_chunked,
                                  hstu_attention_reference, mha_reference, mha_sdpa)

SKEWED = [5, 0, 1, 37, 3, 9, 1, 0, 22]  # includes empty rows and length-1 rows


def jagged(lengths, num_targets=None, H=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    off = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    T = int(off[-1])
    # Timestamps sorted per row except for a few back-in-time events (|dt| is bucketed).
    ts = torch.cumsum(torch.randint(0, 5000, (T,), generator=g), 0) - 100 * (torch.arange(T) % 7 == 3)
    q, k, v = (torch.randn(T, H, d, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    nt = None if num_targets is None else torch.tensor(num_targets)
    return q, k, v, off, ts, nt


def params(normalizer="max_seq_len", block_elems=300, alpha=0.5, fused=True):
    return HSTUAttentionParams(alpha=alpha, normalizer=normalizer, max_seq_len=64, num_time_buckets=12,
                               time_bucket_divisor=0.301, bucket_min_fill=0.75, block_elems=block_elems,
                               fused=fused)


def grads(out, inputs):
    # A nonlinear loss so every output element gets a different upstream gradient.
    return torch.autograd.grad((out * torch.sin(out)).sum(), inputs, allow_unused=True)


@pytest.mark.parametrize("normalizer", ["max_seq_len", "num_keys", "none"])
@pytest.mark.parametrize("num_targets", [None, [1, 0, 1, 3, 0, 2, 0, 0, 22]])
def test_hstu_chunked_matches_reference_fwd_bwd(normalizer, num_targets):
    q, k, v, off, ts, nt = jagged(SKEWED, num_targets)
    ts_w = torch.randn(13, dtype=torch.float64, requires_grad=True)
    pos_w = torch.randn(64, dtype=torch.float64, requires_grad=True)
    layout = make_layout(off, ts, nt, 64)
    p = params(normalizer)  # tiny block_elems: many query blocks per bucket
    ref = hstu_attention_reference(q, k, v, layout, ts_w, pos_w, p)
    fast = hstu_attention_chunked(q, k, v, layout, ts_w, pos_w, p)  # float64: the PyTorch tile
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
    for g_fast, g_ref in zip(grads(fast, [q, k, v, ts_w, pos_w]), grads(ref, [q, k, v, ts_w, pos_w])):
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("bias", ["none", "position", "time"])
def test_hstu_chunked_bias_variants(bias):
    q, k, v, off, ts, _ = jagged(SKEWED)
    ts_w = torch.randn(13, dtype=torch.float64, requires_grad=True) if bias == "time" else None
    pos_w = torch.randn(64, dtype=torch.float64, requires_grad=True) if bias == "position" else None
    layout = make_layout(off, ts, None, 64)
    ref = hstu_attention_reference(q, k, v, layout, ts_w, pos_w, params(alpha=1.0))
    fast = hstu_attention_chunked(q, k, v, layout, ts_w, pos_w, params(alpha=1.0, block_elems=10**7))
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
    ins = [t for t in (q, k, v, ts_w, pos_w) if t is not None]
    for a, b in zip(grads(fast, ins), grads(ref, ins)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("normalizer", ["max_seq_len", "num_keys"])
def test_hstu_reference_matches_pairwise_definition(normalizer):
    lengths, num_targets = [6, 1, 0, 4], [2, 0, 0, 0]
    q, k, v, off, ts, nt = jagged(lengths, num_targets)
    ts_w, pos_w = torch.randn(13, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    out = hstu_attention_reference(q, k, v, make_layout(off, ts, nt, 64), ts_w, pos_w, params(normalizer))
    for b in range(len(lengths)):
        s0, n, hist = int(off[b]), lengths[b], lengths[b] - num_targets[b]
        for i in range(n):
            acc = torch.zeros_like(v[0])
            for j in range(n):
                # causal; candidates (i >= hist) see history and themselves only
                if j > i or (j >= hist and j != i):
                    continue
                dt = abs(int(ts[s0 + i]) - int(ts[s0 + j]))
                bucket = min(12, int(math.log(max(dt, 1)) / 0.301))
                rel = min(i, hist) - min(j, hist)  # candidates sit at position hist
                logit = 0.5 * (q[s0 + i] * k[s0 + j]).sum(-1) + pos_w[rel] + ts_w[bucket]
                norm = 64 if normalizer == "max_seq_len" else min(i, hist) + 1
                acc = acc + F.silu(logit)[:, None] / norm * v[s0 + j]
            torch.testing.assert_close(out[s0 + i], acc)


@pytest.mark.parametrize("normalizer", ["max_seq_len", "num_keys"])
@pytest.mark.parametrize("kernel", [hstu_attention_reference, hstu_attention_chunked])
def test_float64_kernels_divide_by_n_in_float64(normalizer, kernel):
    """1 / n is not rounded to fp32 in float64 (n = 300 or 3 are not powers of two)."""
    q, k, v, off, ts, nt = jagged([7, 2], [2, 0])
    layout = make_layout(off, ts, nt, 300)
    p = {name: HSTUAttentionParams(alpha=0.5, normalizer=name, max_seq_len=300, num_time_buckets=12,
                                   time_bucket_divisor=0.301, bucket_min_fill=0.75, block_elems=300)
         for name in (normalizer, "none")}
    ts_w, pos_w = torch.randn(13, dtype=torch.float64), torch.randn(300, dtype=torch.float64)
    out = kernel(q, k, v, layout, ts_w, pos_w, p[normalizer])
    summed = kernel(q, k, v, layout, ts_w, pos_w, p["none"])
    n = torch.full((9,), 300.0, dtype=torch.float64) if normalizer == "max_seq_len" else \
        torch.tensor([1, 2, 3, 4, 5, 6, 6, 1, 2], dtype=torch.float64)  # row 0: 5 history + 2 candidates
    torch.testing.assert_close(out, summed / n[:, None, None], rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("num_targets", [None, [1, 0, 1, 3, 0, 2, 0, 0, 5]])
def test_sdpa_matches_reference_fwd_bwd(num_targets):
    q, k, v, off, ts, nt = jagged(SKEWED, num_targets, dtype=torch.float32)
    layout = make_layout(off, ts, nt, 64)
    ref = mha_reference(q, k, v, layout, 0.0)
    fast = mha_sdpa(q, k, v, layout, 0.0)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads(fast, [q, k, v]), grads(ref, [q, k, v])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_target_aware_mask_candidates_do_not_see_each_other():
    # Perturbing one candidate must not change the other candidates or the history.
    q, k, v, off, ts, nt = jagged([6], [3])
    layout = make_layout(off, ts, nt, 64)
    ts_w, pos_w = torch.randn(13, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    for fn in (hstu_attention_reference, hstu_attention_chunked):
        base = fn(q, k, v, layout, ts_w, pos_w, params())
        k2, v2 = k.detach().clone(), v.detach().clone()
        k2[4] += 1.0
        v2[4] += 1.0
        moved = fn(q, k2, v2, layout, ts_w, pos_w, params())
        changed = (moved - base).abs().amax(dim=(1, 2)) > 0
        assert changed.tolist() == [False, False, False, False, True, False]


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
@pytest.mark.parametrize("normalizer", ["max_seq_len", "num_keys"])
@pytest.mark.parametrize("num_targets", [None, [1, 0, 1, 3, 0, 2, 0, 0, 22]])
@pytest.mark.parametrize("bias", ["both", "none"])
def test_fused_tile_fp32_matches_float64_reference(normalizer, num_targets, bias):
    q, k, v, off, ts, nt = jagged(SKEWED, num_targets)
    ts_w = torch.randn(13, dtype=torch.float64, requires_grad=True) if bias == "both" else None
    pos_w = torch.randn(64, dtype=torch.float64, requires_grad=True) if bias == "both" else None
    layout = make_layout(off, ts, nt, 64)
    ref = hstu_attention_reference(q, k, v, layout, ts_w, pos_w, params(normalizer))
    ins64 = [t for t in (q, k, v, ts_w, pos_w) if t is not None]
    g_ref = grads(ref, ins64)
    ins32 = [t.detach().float().requires_grad_() for t in ins64]
    q32, k32, v32 = ins32[:3]
    w32 = ins32[3:] if bias == "both" else [None, None]
    out = hstu_attention_chunked(q32, k32, v32, layout, w32[0], w32[1], params(normalizer))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads(out, ins32), g_ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
def test_fused_time_index_equals_reference_bucketing():
    g = torch.Generator().manual_seed(3)
    # Gaps spanning seconds to years, both signs, and exact bucket thresholds.
    ts = torch.cumsum(torch.randint(0, 10**6, (2, 300), generator=g), 1)
    ts[0, :64] = fused.time_thresholds(128, 0.301)[1:65].clamp(max=2**40)
    ts[0, 64] = 0
    got = fused.time_index(ts, 128, 0.301).long()
    want = torch.ops.aten.clamp(
        (torch.log((ts[:, :, None] - ts[:, None, :]).abs().clamp(min=1).float()) / 0.301).long(), 0, 128)
    assert torch.equal(got, want)


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
def test_fused_time_index_runs_agree_with_the_formula_pair_by_pair():
    """Over a sorted history the index is built from runs of equal buckets (binary searches
    for the thresholds), elsewhere pair by pair: both must give the formula's bucket for every
    pair, with repeated times, gaps past the last bucket, zero padding after the history,
    an unsorted row and query times before, inside and after the history."""
    g = torch.Generator().manual_seed(11)
    G, N, NB = 4, 257, 40
    gaps = torch.randint(0, 3, (G, N), generator=g) * torch.randint(1, 10**5, (G, N), generator=g)
    ts = torch.cumsum(gaps, 1)                      # sorted, many repeats
    ts[1, 100:] += 10**12                           # a gap beyond the last bucket
    ts[2, 200:] = 0                                 # padding after a history of 200
    ts[3] = torch.randint(0, 10**6, (N,), generator=g)  # not sorted at all
    # Row 0: keys exactly at, one below and one above every bucket threshold away from a
    # query time of 10**13, on both sides of it (where the runs begin and end).
    thr = fused.time_thresholds(NB, 0.301)[1:NB + 1]
    d = torch.unique(torch.cat([torch.zeros(1, dtype=torch.long), thr - 1, thr, thr + 1]).clamp(0, 2**40))
    row = torch.cat([10**13 - d.flip(0), 10**13 + d[1:]])
    ts[0] = torch.cat([row, torch.full((N - row.numel(),), 10**13 + 2**41)])
    qts = ts.clone()
    qts[:, ::3] += torch.randint(-10**7, 10**7, (G, (N + 2) // 3), generator=g)
    qts[0] = 10**13
    qts[0, 5] = -(2**40)
    for query in (None, qts):
        got = fused.time_index(ts, NB, 0.301, query).long()
        q = ts if query is None else query
        want = (torch.log((q[:, :, None] - ts[:, None, :]).abs().clamp(min=1).float()) / 0.301).long().clamp(0, NB)
        assert torch.equal(got, want)


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
@pytest.mark.parametrize("num_targets", [None, [1, 0, 1, 3, 0, 2, 0, 0, 22]])
@pytest.mark.parametrize("dqk,dv", [(12, 20), (36, 40)])
@pytest.mark.parametrize("time_index", ["index", "runs"])
def test_one_pass_native_kernels_match_reference_for_any_head_dims(num_targets, dqk, dv, time_index, monkeypatch):
    """fp32 runs the whole forward and the whole backward in one native pass each (no
    [N, N] tile): outputs and every gradient (q, k, v, both biases) must match the float64
    reference with query/key and value dims that are not multiples of the vector width and
    differ, candidates included; the forward gives the same bits on 1 and 2 threads, the
    backward the same bits when run again; and both kernels must actually have run. 36 and
    40 columns take the kernels' two-vectors-per-pass loops (8 and 16 floats a vector) and
    their masked tails; 12 and 20 the one-vector ones. Time buckets from the per-call index
    and, with the index's length limit at 0, from runs over the sorted times."""
    monkeypatch.setattr(kernels, "TIME_INDEX_MAX_LEN", 0 if time_index == "runs" else 10**6)
    lengths = SKEWED + [60]
    g = torch.Generator().manual_seed(5)
    off = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    T = int(off[-1])
    ts = torch.cumsum(torch.randint(0, 5000, (T,), generator=g), 0) - 100 * (torch.arange(T) % 7 == 3)
    q, k = (torch.randn(T, 3, dqk, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(T, 3, dv, dtype=torch.float64, generator=g).requires_grad_()
    ts_w, pos_w = (torch.randn(n, dtype=torch.float64, generator=g).requires_grad_() for n in (13, 64))
    nt = None if num_targets is None else torch.tensor(num_targets + [9])
    ins64 = [q, k, v, ts_w, pos_w]
    ref = hstu_attention_reference(q, k, v, make_layout(off, ts, nt, 64), ts_w, pos_w, params("num_keys"))
    g_ref = grads(ref, ins64)
    calls = {"attention_forward": 0, "attention_backward": 0}
    for name in calls:
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, real=real, name=name: calls.__setitem__(name, calls[name] + 1)
                            or real(*a))
    threads = torch.get_num_threads()
    outs, grad_runs = [], []
    try:
        for n in (1, 2, 2):
            torch.set_num_threads(n)
            ins32 = [t.detach().float().requires_grad_() for t in ins64]
            out = hstu_attention_chunked(*ins32[:3], make_layout(off, ts, nt, 64), *ins32[3:], params("num_keys"))
            outs.append(out)
            grad_runs.append(grads(out, ins32))
    finally:
        torch.set_num_threads(threads)
    assert calls["attention_forward"] and calls["attention_backward"]
    torch.testing.assert_close(outs[0].double(), ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(grad_runs[0], g_ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(grad_runs[1], grad_runs[2]))


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
def test_bf16_runs_the_one_pass_kernels_in_fp32_and_rounds_once(monkeypatch):
    """bf16 q, k, v go through the fp32 one-pass kernels (no [N, N] tile in bf16): the output
    and the q / k / v gradients are the float64 reference's on the same bf16 values, rounded
    to bf16 once (half a bf16 step: 2^-9 relative, plus fp32 summation), and the bias
    gradients are fp32 sums."""
    q, k, v, off, ts, _ = jagged(SKEWED + [60], d=16, seed=7)
    ins64 = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in (q, k, v)]
    ts_w, pos_w = (torch.randn(n, dtype=torch.float64).requires_grad_() for n in (13, 64))
    layout = make_layout(off, ts, None, 64)
    ref = hstu_attention_reference(*ins64, layout, ts_w, pos_w, params("num_keys"))
    w = torch.randn(ref.shape, dtype=torch.float64).to(torch.bfloat16)  # the upstream gradient, exact in bf16
    g_ref = torch.autograd.grad((ref * w.double()).sum(), [*ins64, ts_w, pos_w])
    calls = []
    for name in ("attention_forward", "attention_backward"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    ins16 = [t.detach().to(torch.bfloat16).requires_grad_() for t in ins64]
    w32 = [ts_w.detach().float().requires_grad_(), pos_w.detach().float().requires_grad_()]
    out = hstu_attention_chunked(*ins16, layout, *w32, params("num_keys"))
    got = [out, *torch.autograd.grad(out, [*ins16, *w32], w)]
    assert out.dtype == torch.bfloat16 and set(calls) == {"attention_forward", "attention_backward"}
    for a, b in zip(got, [ref, *g_ref]):
        torch.testing.assert_close(a.double(), b, rtol=2 ** -8, atol=2 ** -8 * b.abs().max().item())


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
@pytest.mark.parametrize("sorted_times", [True, False])
@pytest.mark.parametrize("time_index", ["index", "runs"])
def test_one_pass_kernels_on_long_rows_match_reference(sorted_times, time_index, monkeypatch):
    """Rows longer than the backward's chunk of keys (256) and its super block of rows (64 or
    128): dq sums over several chunks, dk / dv and the bias gradients over several super
    blocks, the time bias's runs cut at chunk edges (sorted times) or bucketed pair by pair
    (times out of order), candidates seeing a history that spans chunks; time buckets from
    the per-call index or from runs."""
    monkeypatch.setattr(kernels, "TIME_INDEX_MAX_LEN", 0 if time_index == "runs" else 10**6)
    g = torch.Generator().manual_seed(21)
    lengths, targets = [700, 330, 3], [0, 45, 1]
    off = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    T = int(off[-1])
    ts = torch.cumsum(torch.randint(0, 50_000, (T,), generator=g), 0)
    if not sorted_times:
        ts = ts - 10**6 * (torch.arange(T) % 5 == 2)
    q, k = (torch.randn(T, 2, 16, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(T, 2, 24, dtype=torch.float64, generator=g).requires_grad_()
    ts_w, pos_w = (torch.randn(n, dtype=torch.float64, generator=g).requires_grad_() for n in (13, 1024))
    p = HSTUAttentionParams(alpha=0.25, normalizer="num_keys", max_seq_len=1024, num_time_buckets=12,
                            time_bucket_divisor=0.301, bucket_min_fill=0.75, block_elems=10**7)
    layout = make_layout(off, ts, torch.tensor(targets), 1024)
    ins64 = [q, k, v, ts_w, pos_w]
    ref = hstu_attention_reference(q, k, v, layout, ts_w, pos_w, p)
    g_ref = grads(ref, ins64)
    ins32 = [t.detach().float().requires_grad_() for t in ins64]
    out = hstu_attention_chunked(*ins32[:3], layout, *ins32[3:], p)
    for a, b in zip([out, *grads(out, ins32)], [ref, *g_ref]):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5 * b.abs().max().item())


def test_native_tile_is_built_and_keeps_subnormals():
    """The install command built the tile (no silent PyTorch fallback), and loading it
    does not switch the process to flush-to-zero (as a -ffast-math link would)."""
    import os

    if os.environ.get("GENREC_DENSE_FUSED", "1") == "0":
        pytest.skip("GENREC_DENSE_FUSED=0 chose the PyTorch tile")
    assert fused.library() is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # subnormal in fp32
    assert float(tiny * 1.0) != 0.0


# ----------------------------------------------------------------------------------------
# The kernels' builds per instruction set: the loader takes the best one this CPU runs, an
# unknown choice is an error naming the choices, and on a CPU that runs both x86 builds they
# compute the same attention (to fp32 rounding) as each other and the reference.

X86 = platform.machine() == "x86_64"
AVX512 = X86 and set(fused.BUILDS["x86_64"][0][2]) <= fused._cpu_flags()


@pytest.fixture
def fresh_loader(monkeypatch):
    """library() loads again under this test's environment, and the process's choice is put
    back afterwards."""
    monkeypatch.delenv("GENREC_DENSE_FUSED", raising=False)
    monkeypatch.delenv("GENREC_DENSE_ISA", raising=False)
    monkeypatch.setattr(fused, "_lib", False)
    return monkeypatch


@pytest.mark.skipif(not X86, reason="x86 has two builds; other machines one")
def test_a_cpu_without_avx512_gets_the_avx2_build(fresh_loader):
    flags = fused._cpu_flags() - {"avx512f", "avx512vl", "avx512bw", "avx512dq"}
    fresh_loader.setattr(fused, "_cpu_flags", lambda: flags)
    lib = fused.library()
    assert (lib.isa, lib.key_block) == ("avx2", 8)


@pytest.mark.skipif(not X86, reason="x86 has two builds; other machines one")
def test_the_loader_takes_the_widest_build_the_cpu_runs(fresh_loader):
    lib = fused.library()
    assert (lib.isa, lib.key_block) == (("avx512", 16) if AVX512 else ("avx2", 8))


def test_an_unknown_isa_choice_names_the_builds(fresh_loader):
    fresh_loader.setenv("GENREC_DENSE_ISA", "sse2")
    with pytest.raises(fused.NativeKernelError, match="GENREC_DENSE_ISA='sse2'.*builds are"):
        fused.library()


def _attention(isa, monkeypatch, ins64, layout):
    monkeypatch.setattr(fused, "_lib", False)
    monkeypatch.setenv("GENREC_DENSE_ISA", isa)
    assert fused.library().isa == isa
    ins32 = [t.detach().float().requires_grad_() for t in ins64]
    out = hstu_attention_chunked(*ins32[:3], layout, *ins32[3:], params("num_keys"))
    return out, grads(out, ins32)


@pytest.mark.skipif(not AVX512, reason="this CPU runs only the AVX2 build")
def test_the_avx512_and_avx2_builds_agree(fresh_loader):
    g = torch.Generator().manual_seed(8)
    lengths = SKEWED + [61]
    off = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    T = int(off[-1])
    ts = torch.cumsum(torch.randint(0, 5000, (T,), generator=g), 0)
    q, k = (torch.randn(T, 2, 33, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(T, 2, 47, dtype=torch.float64, generator=g).requires_grad_()
    ts_w, pos_w = (torch.randn(n, dtype=torch.float64, generator=g).requires_grad_() for n in (13, 64))
    ins64 = [q, k, v, ts_w, pos_w]
    layout = make_layout(off, ts, None, 64)
    ref = hstu_attention_reference(q, k, v, layout, ts_w, pos_w, params("num_keys"))
    g_ref = grads(ref, ins64)
    out512, g512 = _attention("avx512", fresh_loader, ins64, layout)
    out2, g2 = _attention("avx2", fresh_loader, ins64, layout)
    for a, b, want in zip([out512, *g512], [out2, *g2], [ref, *g_ref]):
        scale = want.abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale)
        torch.testing.assert_close(a.double(), want, rtol=0, atol=1e-5 * scale)


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
@pytest.mark.parametrize("dtype", [torch.int8, torch.float32])
def test_scan_scores_a_row_alike_alone_and_among_other_rows(dtype, fresh_loader):
    """The scan scores 16 rows at a time (AVX-512) or 8 (AVX2) where the width allows and
    single rows elsewhere (a range's last rows, a lone row): a row's score is the same bit for
    bit either way, so a ranking never depends on where a row sits in the index or on the
    thread split. Each build this CPU runs is checked."""
    g = torch.Generator().manual_seed(3)
    N, dim = 1_000 + 7, 64
    rows = torch.randint(-127, 128, (N, dim), generator=g, dtype=torch.int8)
    scale = torch.rand(N, generator=g) + 0.5
    if dtype == torch.float32:
        rows, scale = rows.float() * scale[:, None] * torch.randn(N, 1, generator=g), None
    q = torch.randn(1, dim, generator=g)
    for isa in (["avx2", "avx512"] if AVX512 else ["avx2"]) if X86 else [None]:
        if isa is not None:
            fresh_loader.setattr(fused, "_lib", False)
            fresh_loader.setenv("GENREC_DENSE_ISA", isa)
            assert fused.library().isa == isa
        s, i = fused.scan_top_k(q, rows, scale, N, None)
        together = torch.empty(N).index_put_((i[0],), s[0])
        for n in range(0, N, 37):
            alone, _ = fused.scan_top_k(q, rows[n : n + 1], None if scale is None else scale[n : n + 1], 1, None)
            assert torch.equal(alone[0, 0], together[n]), (isa, n)


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
@pytest.mark.parametrize("dim", [19, 64])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float32])
def test_scan_top_k_is_the_exact_top_k(dim, dtype):
    """The native retrieval scan against a plain sort: scores, order (higher first, ties to
    the lower row), a mask per query, k beyond what a mask leaves (-inf / -1 padding), rows
    whose width is not a multiple of the vector, more rows than its candidate buffer, and a
    lone query's rows split among threads."""
    g = torch.Generator().manual_seed(dim)
    N = 20_000
    rows = torch.randint(-127, 128, (N, dim), generator=g, dtype=torch.int8)
    rows[7_000:7_010] = rows[123]  # ties: equal scores, ordered by row
    scale = (torch.rand(N, generator=g) + 0.5) * 0.01
    scale[123] = scale[7_000:7_010] = 1.0  # far above the rest: the query q[2] ranks them first
    if dtype == torch.float32:
        rows, scale = rows.float() * scale[:, None], None
    q = torch.randn(3, dim, generator=g)
    q[2] = rows[123].float() if scale is None else rows[123].float() * scale[123]
    mask = torch.ones(3, N, dtype=torch.bool)
    mask[1] = torch.rand(N, generator=g) < 0.001
    exact = q @ rows.float().T if scale is None else (q @ rows.float().T) * scale
    for k in (1, 37, 5_000):
        got_s, got_i = fused.scan_top_k(q, rows, scale, k, mask)
        for b in range(3):
            s = exact[b].masked_fill(~mask[b], float("-inf"))
            order = sorted(range(N), key=lambda n: (-float(s[n]), n))[:k]
            n_ok = min(k, int(mask[b].sum()))
            want = torch.tensor(order[:n_ok])
            near_tie = (s[want[-1]] - s).abs() < 1e-4 * s[want[0]].abs()
            assert (got_i[b, n_ok:] == -1).all() and torch.isinf(got_s[b, n_ok:]).all()
            assert set(got_i[b, :n_ok].tolist()) - set(want.tolist()) <= set(torch.nonzero(near_tie).flatten().tolist())
            torch.testing.assert_close(got_s[b, :n_ok], s[got_i[b, :n_ok]], rtol=1e-5, atol=1e-5)
            assert (got_s[b, :n_ok - 1] >= got_s[b, 1:n_ok]).all()
        # A lone query with more threads than queries splits its rows among the threads and
        # merges their best k: the same list, bit for bit, as one thread scanning it whole.
        before = torch.get_num_threads()
        try:
            for threads in (2, 3):
                torch.set_num_threads(threads)
                for b in range(3):
                    one_s, one_i = fused.scan_top_k(q[b : b + 1], rows, scale, k, mask[b : b + 1])
                    assert torch.equal(one_i[0], got_i[b]) and torch.equal(one_s[0], got_s[b])
        finally:
            torch.set_num_threads(before)
        top = got_i[2, :11].tolist()  # the query equals row 123: row 123 and its ten copies lead, in row order
        if k >= 11:
            assert top == sorted(top) and set(top) == {123, *range(7_000, 7_010)}


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_silu_equals_silu_of_scores_plus_each_groups_bias_row(dtype, with_bias):
    """The serving path's one-pass SiLU(s + bias): every row of group g adds bias row g, at
    any thread count; bf16 scores are read, summed and rounded once (not twice as in ATen)."""
    g = torch.Generator().manual_seed(0)
    s = (torch.randn(3, 5, 77, generator=g) * 4).to(dtype)  # 77: not a multiple of the vector
    bias = torch.randn(3, 77, generator=g) if with_bias else None
    x = s.float() + (bias[:, None] if with_bias else 0)
    want = (x * torch.sigmoid(x.double()).float()).to(dtype)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = fused.bias_silu_(s.clone(), bias)
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
            else:  # one bf16 rounding of the same float: equal, or one unit apart
                assert float((got.float() - want.float()).abs().div(want.float().abs().clamp(min=1e-3)).max()) <= 2 ** -7
    finally:
        torch.set_num_threads(before)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=7),
       min_fill=st.sampled_from([1e-9, 0.5, 0.75, 1.0]), seed=st.integers(0, 2 ** 16))
def test_bucket_gather_puts_each_row_once_zero_pads_and_inverts_with_gradients(lengths, min_fill, seed):
    # Equal lengths give the layout whose padded order is its own (no copy at all).
    T = sum(lengths)
    assume(T > 0)
    offsets = [0] + torch.tensor(lengths).cumsum(0).tolist()
    layout = make_layout(torch.tensor(offsets), torch.arange(T), None, 16)
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.arange(1, T + 1, dtype=torch.float64)[:, None],  # column 0: token id + 1
                   torch.randn(T, 2, dtype=torch.float64, generator=g)], 1).requires_grad_()
    parts = layout.gather_to_buckets(x, min_fill)
    starts, place = [], {}
    for b, (bucket, part) in enumerate(zip(layout.buckets(min_fill), parts)):
        assert part.shape == (bucket.num_rows, bucket.max_len, 3)
        for r in range(bucket.num_rows):
            n = int(bucket.lengths_G[r])
            ids = part[r, :n, 0].long() - 1
            start = int(ids[0])
            assert ids.tolist() == list(range(start, start + n))  # a whole row, in order
            assert (start, n) in zip(offsets, lengths)
            torch.testing.assert_close(part[r, :n], x[ids])
            assert (part[r, n:] == 0).all()  # padding is zeros
            starts.append(start)
            place.update({int(t): (b, r, i) for i, t in enumerate(ids)})
    assert sorted(starts) == [o for o, n in zip(offsets, lengths) if n > 0]  # every row once
    weights = [torch.randn(p.shape, dtype=torch.float64, generator=g) for p in parts]
    (gx,) = torch.autograd.grad(sum((p * w).sum() for p, w in zip(parts, weights)), x, retain_graph=True)
    expected = torch.stack([weights[b][r, i] for b, r, i in (place[t] for t in range(T))])
    torch.testing.assert_close(gx, expected)  # each token's weight at its one padded place
    back = layout.scatter_from_buckets(parts)
    torch.testing.assert_close(back, x)
    w2 = torch.randn(T, 3, dtype=torch.float64, generator=g)
    (gx2,) = torch.autograd.grad((back * w2).sum(), x)
    torch.testing.assert_close(gx2, w2)


_SCRATCH_OUT_OF_REACH = """
import resource, sys
import torch
from genrec.dense import fused

torch.set_num_threads(8)  # the backward's scratch: dk and dv sums per thread, 8x each
# Fewer than 4 rows per thread: the rows' super blocks are split among the threads, into
# per-thread sums (with more rows each thread writes its own rows' dk and dv in place).
G, H, N, d = 16, 2, 4096, 32  # 4M floats (16 MB) per [G, H, N, d] tensor
q, k, v, dout = (torch.randn(G, H, N, d) for _ in range(4))
hist = torch.full((G,), N, dtype=torch.int64)
pos = torch.arange(N).repeat(G, 1).contiguous()


def backward():
    args = fused.tile_args(G=G, H=H, bq=N, K=N, N=N, i0=0, P=N, NB=1, ts=None, thr=None, ts_w=None,
                           pos_w=None, pos=pos, hist=hist, alpha=1.0, divisor=1.0)
    return fused.attention_backward(args, q, k, v, dout, None, None)


want = backward()  # also starts the 8 OpenMP threads (their stacks) before the limit
del want
with open("/proc/self/status") as f:
    used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
# The call's own outputs and key blocks (about 6 x 16 MB) fit; 8 threads' dk + dv sums (256 MB) do not.
resource.setrlimit(resource.RLIMIT_AS, (used + 160 * 2**20, resource.RLIM_INFINITY))
try:
    backward()
except MemoryError as e:
    print("MemoryError:", e)
    sys.exit(0)
sys.exit("no MemoryError")
"""


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
def test_the_backward_gives_whole_rows_the_same_bits_on_any_thread_count():
    """With at least 4 rows per thread, each thread adds its own rows' dk and dv in place:
    dq, dk and dv are then the same bits on 1 and 2 threads (9 rows), and equal the float64
    products of the same scores; with fewer rows per thread (9 rows, 3 threads) a row's
    super blocks are split among the threads and summed per thread, the same values to
    rounding."""
    g = torch.Generator().manual_seed(11)
    G, H, N, dqk, dv = 9, 2, 150, 20, 12
    q, k = (torch.randn(G, H, N, dqk, generator=g) for _ in range(2))
    v, dout = (torch.randn(G, H, N, dv, generator=g) for _ in range(2))
    hist = torch.full((G,), N, dtype=torch.int64)
    pos = torch.arange(N).repeat(G, 1).contiguous()
    before = torch.get_num_threads()
    try:
        runs = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)  # the kernel's arguments take the count when made
            args = fused.tile_args(G=G, H=H, bq=N, K=N, N=N, i0=0, P=N, NB=1, ts=None, thr=None, ts_w=None,
                                   pos_w=None, pos=pos, hist=hist, alpha=1.0, divisor=1.0)
            assert args.nthreads == threads
            runs[threads] = fused.attention_backward(args, q, k, v, dout, None, None)
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(runs[1], runs[2], runs[3]):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-4)
    # The float64 backward of a = SiLU(q k^T) on j <= i, out = a v (no bias, no 1/n here).
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    s = q64 @ k64.transpose(-1, -2)
    a = torch.nn.functional.silu(s).masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), 0.0)
    (a @ v64).backward(dout.double())
    for got, want in zip(runs[2], (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch tile")
@pytest.mark.skipif(platform.system() != "Linux", reason="RLIMIT_AS and /proc/self/status are Linux's")
def test_a_kernel_whose_scratch_does_not_fit_raises_memory_error_naming_it():
    """A native kernel whose scratch cannot be allocated returns an error that Python turns
    into MemoryError naming the kernel (it used to write through a null pointer): the
    attention backward under an address-space limit that its outputs fit and its per-thread
    gradient sums do not, in a process of its own."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _SCRATCH_OUT_OF_REACH], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "MemoryError: native kernel hstu_attn_bwd: out of memory" in run.stdout
