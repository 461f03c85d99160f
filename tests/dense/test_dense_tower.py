"""Tower-level properties: reference vs fast kernels end to end, KV-cache scoring equals a
full recompute, bf16 numerics, activation checkpointing, bad input errors."""

from __future__ import annotations

import pytest
import torch

from genrec.dense import TowerConfig, autocast, build_tower, make_grad_scaler, parallelize

D = 16


def small_cfg(**kw) -> TowerConfig:
    base = dict(embedding_dim=D, num_layers=2, num_heads=2, attention_dim=8, linear_dim=8,
                max_seq_len=64, num_time_buckets=20, dropout=0.0)
    base.update(kw)
    return TowerConfig(**base)


def perturbed(tower):
    # Default init makes attention tiny (0.02 std, 1/max_seq_len); bigger weights make the
    # comparisons sensitive to every term.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in tower.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return tower


def rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(n, D, generator=g) for n in lengths]
    ts = [torch.cumsum(torch.randint(0, 10_000, (n,), generator=g), 0) for n in lengths]
    return values, ts


def offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())


@pytest.mark.parametrize("kind", ["hstu", "transformer"])
@pytest.mark.parametrize("with_targets", [False, True])
def test_fast_kernel_tower_matches_reference_tower(kind, with_targets):
    _fast_matches_reference(kind, with_targets, grad_atol=lambda b: 1e-4)


def _fast_matches_reference(kind, with_targets, grad_atol, **cfg):
    """The fast kernels' tower equals the reference kernels' (same weights), fwd + bwd;
    returns the fast tower."""
    lengths = [5, 0, 1, 37, 3, 9]
    targets = torch.tensor([1, 0, 1, 4, 0, 2]) if with_targets else None
    values, ts = rows(lengths)
    towers = [perturbed(build_tower(small_cfg(kind=kind, kernel=k, attention_block_elems=500, **cfg)))
              for k in ("reference", "auto")]
    towers[1].load_state_dict(towers[0].state_dict())
    outs, grads = [], []
    for tower in towers:
        x = torch.cat(values).requires_grad_()
        y = tower(x, offsets(lengths), torch.cat(ts), targets)
        (y * torch.sin(y)).sum().backward()
        outs.append(y)
        grads.append([x.grad] + [p.grad for p in tower.parameters()])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=grad_atol(b))
    return towers[1]


@pytest.mark.parametrize("kind", ["hstu", "transformer"])
@pytest.mark.parametrize("normalizer", ["max_seq_len", "num_keys"])
@pytest.mark.parametrize("kernel", ["reference", "auto"])
def test_kv_cache_scoring_equals_full_recompute(kind, normalizer, kernel):
    _kv_cache_parity(small_cfg(kind=kind, normalizer=normalizer, kernel=kernel, target_micro_batch=3, dropout=0.3))


@pytest.mark.parametrize("kernel", ["reference", "auto"])
def test_kv_cache_scoring_with_the_lowpass_branch(kernel):
    _kv_cache_parity(small_cfg(kernel=kernel, target_micro_batch=3, dropout=0.3, lowpass_mix=0.4, lowpass_window=3))


@pytest.mark.parametrize("with_targets", [False, True])
def test_lowpass_branch_fast_kernel_matches_reference(with_targets):
    _fast_matches_reference("hstu", with_targets, grad_atol=lambda b: 1e-4, lowpass_mix=0.4, lowpass_window=4)


def test_lowpass_branch_is_the_causal_window_mean():
    """An independent transcription: a history token averages its own V and the window - 1
    before it in its row; a candidate its own V and the last window - 1 of the history."""
    from genrec.dense.jagged import make_layout

    w = 3
    hist_len, cand_len = [5, 1, 0, 2], [2, 0, 3, 1]
    block = build_tower(small_cfg(lowpass_mix=0.4, lowpass_window=w)).layers[0]
    lengths = [h + c for h, c in zip(hist_len, cand_len)]
    v = torch.randn(sum(lengths), 6)
    layout = make_layout(offsets(lengths), torch.zeros(sum(lengths), dtype=torch.long), torch.tensor(cand_len), 64)
    _, got = block.lowpass(v, layout)
    want, start = [], 0
    for h, c in zip(hist_len, cand_len):
        row = v[start:start + h + c]
        want += [row[max(0, i - w + 1):i + 1].mean(0) for i in range(h)]
        want += [torch.cat([row[max(0, h - w + 1):h], row[h + j:h + j + 1]]).mean(0) for j in range(c)]
        start += h + c
    torch.testing.assert_close(got, torch.stack(want))


def _kv_cache_parity(cfg):
    hist_len, cand_len = [5, 1, 12, 0, 3], [4, 7, 0, 2, 1]
    tower = perturbed(build_tower(cfg)).eval()
    hist, hist_ts = rows(hist_len, seed=2)
    cand, _ = rows(cand_len, seed=3)
    cand_ts = [(h[-1] if len(h) else 0) + torch.arange(n) * 7 for h, n in zip(hist_ts, cand_len)]
    full_len = [h + c for h, c in zip(hist_len, cand_len)]
    full = torch.cat([torch.cat([h, c]) for h, c in zip(hist, cand)])
    full_ts = torch.cat([torch.cat([h, c]) for h, c in zip(hist_ts, cand_ts)])
    with torch.no_grad():
        y = tower(full, offsets(full_len), full_ts, torch.tensor(cand_len))
    off = offsets(full_len)
    want_cand = torch.cat([y[int(off[b]) + hist_len[b]:int(off[b + 1])] for b in range(5)])
    want_hist = torch.cat([y[int(off[b]):int(off[b]) + hist_len[b]] for b in range(5)])
    states, cache = tower.encode_history(torch.cat(hist), offsets(hist_len), torch.cat(hist_ts))
    got = tower.score_targets(cache, torch.cat(cand), offsets(cand_len), torch.cat(cand_ts))
    assert want_cand.abs().max() > 1.0  # a meaningful scale for the 1e-5 comparison
    torch.testing.assert_close(got, want_cand, rtol=0, atol=1e-5)
    torch.testing.assert_close(states, want_hist, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["hstu", "transformer"])
def test_bf16_autocast_close_to_fp32(kind):
    """bf16 autocast keeps fp32 master weights; outputs and grads stay within 3% (relative
    to each tensor's max) of the fp32 run. The relative-bias tables get 12%: each entry is a
    sum over all (query, key) pairs of a bucket with heavy cancellation, so bf16 logits and
    dA (8-bit mantissa) show up more there."""
    lengths = [40, 3, 1, 17, 0, 25]
    values, ts = rows(lengths, seed=4)
    tower = build_tower(small_cfg(kind=kind))
    # A fixed random readout: a square loss on a LayerNorm output has ~zero input gradient.
    readout = torch.randn(sum(lengths), D, generator=torch.Generator().manual_seed(6))
    results = []
    for precision in ("fp32", "bf16"):
        tower.zero_grad()
        x = torch.cat(values).requires_grad_()
        with autocast(precision):
            y = tower(x, offsets(lengths), torch.cat(ts))
        assert all(p.dtype == torch.float32 for p in tower.parameters())
        (y.float() * readout).sum().backward()
        results.append([y.float()] + [x.grad] + [p.grad.clone() for p in tower.parameters()])
    names = ["out", "x.grad"] + [n for n, _ in tower.named_parameters()]
    for name, a, b in zip(names, results[1], results[0]):
        scale = b.abs().max().clamp(min=1e-12)
        err = ((a - b).abs().max() / scale).item()
        assert err < (0.12 if name.endswith(("ts_w", "pos_w")) else 0.03), (name, err)


def test_fp16_autocast_with_grad_scaler_steps():
    tower = build_tower(small_cfg())
    opt = torch.optim.SGD(tower.parameters(), lr=0.1)
    scaler = make_grad_scaler("fp16")
    values, ts = rows([10, 4])
    before = [p.detach().clone() for p in tower.parameters()]
    # The first steps may overflow at the initial scale (65536) and be skipped; the scaler
    # then backs off until a step goes through.
    for _ in range(20):
        opt.zero_grad()
        with autocast("fp16"):
            loss = tower(torch.cat(values), offsets([10, 4]), torch.cat(ts)).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert any(not torch.equal(a, b) for a, b in zip(before, tower.parameters()))
    assert all(torch.isfinite(p).all() for p in tower.parameters())


@pytest.mark.parametrize("kind", ["hstu", "transformer"])
def test_activation_checkpointing_same_grads(kind):
    lengths = [20, 1, 7]
    values, ts = rows(lengths, seed=5)
    tower = perturbed(build_tower(small_cfg(kind=kind)))
    grads = []
    for ckpt in (False, True):
        parallelize(tower, activation_checkpointing=ckpt)
        tower.zero_grad()
        tower(torch.cat(values), offsets(lengths), torch.cat(ts)).square().mean().backward()
        grads.append([p.grad.clone() for p in tower.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_dropout_active_only_in_training():
    tower = build_tower(small_cfg(dropout=0.5))
    values, ts = rows([8])
    args = (torch.cat(values), offsets([8]), torch.cat(ts))
    assert not torch.equal(tower(*args), tower(*args))
    tower.eval()
    assert torch.equal(tower(*args), tower(*args))


def test_empty_batch_and_errors():
    tower = build_tower(small_cfg())
    out = tower(torch.zeros(0, D), torch.tensor([0, 0]), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0, D)
    with pytest.raises(ValueError, match="max_seq_len"):
        tower(torch.zeros(65, D), torch.tensor([0, 65]), torch.arange(65))
    with pytest.raises(ValueError, match="embedding_dim"):
        tower(torch.zeros(3, D + 1), torch.tensor([0, 3]), torch.arange(3))
    with pytest.raises(ValueError, match="timestamps_T"):
        tower(torch.zeros(3, D), torch.tensor([0, 3]), torch.arange(4))
    with pytest.raises(ValueError, match="num_targets_B"):
        tower(torch.zeros(3, D), torch.tensor([0, 3]), torch.arange(3), torch.tensor([4]))
    with pytest.raises(ValueError, match="num_time_buckets"):
        TowerConfig(num_time_buckets=300)


def _sasrec_padded(tower, x_BND, lengths):
    """The SASRec forward as its public implementations write it, on padded rows:
    seqs = emb * sqrt(D) + pos; per block Q = LN(seqs), seqs = Q + MHA(Q, seqs, seqs)
    (causal), seqs = LN(seqs), seqs = seqs + FFN(seqs); out = LN(seqs)."""
    B, N, _ = x_BND.shape
    H = tower.cfg.num_heads
    seqs = x_BND * D ** 0.5 + tower.position_embedding.weight[:N][None]
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    for blk in tower.layers:
        q_in = torch.nn.functional.layer_norm(seqs, (D,), blk.attn_input_norm.weight, blk.attn_input_norm.bias,
                                              tower.cfg.layer_norm_eps)
        q = (q_in @ blk.q.weight.T + blk.q.bias).view(B, N, H, -1).transpose(1, 2)
        kv = seqs @ blk.kv.weight.T + blk.kv.bias
        dq = blk.attention_dim
        k = kv[..., : H * dq].reshape(B, N, H, dq).transpose(1, 2)
        v = kv[..., H * dq:].reshape(B, N, H, -1).transpose(1, 2)
        s = (q @ k.transpose(-1, -2)) / dq ** 0.5
        a = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        attn = (a @ v).transpose(1, 2).reshape(B, N, -1)
        seqs = q_in + attn @ blk.output.weight.T + blk.output.bias
        seqs = torch.nn.functional.layer_norm(seqs, (D,), blk.ffn_norm.weight, blk.ffn_norm.bias,
                                              tower.cfg.layer_norm_eps)
        w1, w2 = blk.ffn[0], blk.ffn[3]
        seqs = seqs + (torch.relu(seqs @ w1.weight.T + w1.bias) @ w2.weight.T + w2.bias)
    fn = tower.final_norm
    out = torch.nn.functional.layer_norm(seqs, (D,), fn.weight, fn.bias, tower.cfg.layer_norm_eps)
    return torch.cat([out[b, :n] for b, n in enumerate(lengths)])


@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
def test_sasrec_block_matches_the_papers_padded_forward_and_backward(kernel):
    lengths = [7, 1, 4]
    tower = perturbed(build_tower(small_cfg(kind="sasrec", kernel=kernel, input_scale="sqrt_dim",
                                            ffn_multiplier=1))).eval()
    values, ts = rows(lengths, seed=3)
    x = torch.cat(values).requires_grad_()
    got = tower(x, offsets(lengths), torch.cat(ts))
    padded = torch.zeros(len(lengths), max(lengths), D)
    for b, v in enumerate(values):
        padded[b, : len(v)] = v
    x_ref = padded.requires_grad_()
    want = _sasrec_padded(tower, x_ref, lengths)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(want)
    (gx,) = torch.autograd.grad(got, x, g)
    (gref,) = torch.autograd.grad(want, x_ref, g)
    torch.testing.assert_close(gx, torch.cat([gref[b, :n] for b, n in enumerate(lengths)]), rtol=1e-5, atol=1e-5)


def test_input_scale_and_dropout():
    lengths = [5, 3]
    values, ts = rows(lengths)
    x, off, t = torch.cat(values), offsets(lengths), torch.cat(ts)
    plain = build_tower(small_cfg(position_embedding="none"))
    scaled = build_tower(small_cfg(position_embedding="none", input_scale="sqrt_dim"))
    scaled.load_state_dict(plain.state_dict())
    torch.testing.assert_close(scaled.eval()(x, off, t), plain.eval()(x * D ** 0.5, off, t))
    dropped = build_tower(small_cfg(input_dropout=0.5))
    dropped.train()
    assert not torch.allclose(dropped(x, off, t), dropped(x, off, t))  # fresh masks each call
    dropped.eval()
    torch.testing.assert_close(dropped(x, off, t), dropped(x, off, t))


@pytest.mark.parametrize("with_targets", [False, True])
def test_sasrec_fast_kernel_and_kv_cache_match_the_reference(with_targets):
    torch.manual_seed(0)
    # fp32 summation order differs: gradients compared relative to each tensor's scale.
    towers = [None, _fast_matches_reference("sasrec", with_targets,
                                            grad_atol=lambda b: 1e-5 * float(b.abs().max().clamp(min=1)))]
    # M-FALCON: candidates scored against the cached history equal the full recompute.
    tower = towers[1].eval()
    hist = [2, 1, 5]
    cand = [3, 1, 2]
    hv, hts = rows(hist, seed=7)
    cv, cts = rows(cand, seed=8)
    full_rows, full_ts = [], []
    for b in range(3):
        full_rows += [hv[b], cv[b]]
        full_ts += [hts[b], hts[b][-1:] + 1 + cts[b] % 7]
    full = tower(torch.cat(full_rows), offsets([h + c for h, c in zip(hist, cand)]), torch.cat(full_ts),
                 torch.tensor(cand))
    _, cache = tower.encode_history(torch.cat(hv), offsets(hist), torch.cat(hts))
    scored = tower.score_targets(cache, torch.cat(cv), offsets(cand), torch.cat([full_ts[2 * b + 1] for b in range(3)]))
    want = torch.cat([full[sum(hist[:b]) + sum(cand[:b]) + hist[b]: sum(hist[:b + 1]) + sum(cand[:b + 1])]
                      for b in range(3)])
    torch.testing.assert_close(scored, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("normalizer", ["max_seq_len", "num_keys"])
@pytest.mark.parametrize("kernel", ["reference", "auto"])
@pytest.mark.parametrize("with_query_time", [False, True])
def test_kv_cache_scoring_equals_full_recompute_with_next_query_time(normalizer, kernel, with_query_time):
    """time_bias_query="next": the cached history (each event's bias taken at the next event's
    time, the last at query_time_B) and candidates scored against it at their own time equal
    the full forward with num_targets_B and the same query_time_B."""
    hist_len, cand_len = [5, 1, 12, 0, 3], [4, 7, 0, 2, 1]
    tower = perturbed(build_tower(small_cfg(normalizer=normalizer, kernel=kernel, target_micro_batch=3,
                                            dropout=0.3, time_bias_query="next"))).eval()
    hist, hist_ts = rows(hist_len, seed=2)
    cand, _ = rows(cand_len, seed=3)
    cand_ts = [(h[-1] if len(h) else 0) + torch.arange(n) * 7 for h, n in zip(hist_ts, cand_len)]
    # The request time, a while after the last event (and before the impressions' times).
    query_time = torch.stack([(h[-1] if len(h) else torch.tensor(0)) + 3 for h in hist_ts]) \
        if with_query_time else None
    full_len = [h + c for h, c in zip(hist_len, cand_len)]
    full = torch.cat([torch.cat([h, c]) for h, c in zip(hist, cand)])
    full_ts = torch.cat([torch.cat([h, c]) for h, c in zip(hist_ts, cand_ts)])
    with torch.no_grad():
        y = tower(full, offsets(full_len), full_ts, torch.tensor(cand_len), query_time)
    off = offsets(full_len)
    want_cand = torch.cat([y[int(off[b]) + hist_len[b]:int(off[b + 1])] for b in range(5)])
    want_hist = torch.cat([y[int(off[b]):int(off[b]) + hist_len[b]] for b in range(5)])
    states, cache = tower.encode_history(torch.cat(hist), offsets(hist_len), torch.cat(hist_ts), query_time)
    got = tower.score_targets(cache, torch.cat(cand), offsets(cand_len), torch.cat(cand_ts))
    assert want_cand.abs().max() > 1.0  # a meaningful scale for the 1e-5 comparison
    torch.testing.assert_close(got, want_cand, rtol=0, atol=1e-5)
    torch.testing.assert_close(states, want_hist, rtol=0, atol=1e-5)
    # The query time is in effect: the same weights under "own" give other states.
    own = build_tower(small_cfg(normalizer=normalizer, kernel=kernel, target_micro_batch=3, dropout=0.3))
    own.load_state_dict(tower.state_dict())
    own_states, _ = own.eval().encode_history(torch.cat(hist), offsets(hist_len), torch.cat(hist_ts))
    assert (own_states - states).abs().max() > 1e-3


@pytest.mark.parametrize("kind,normalizer,query", [
    ("hstu", "max_seq_len", "own"), ("hstu", "num_keys", "own"), ("hstu", "max_seq_len", "next"),
    ("hstu", "num_keys", "next_at_request_time"), ("sasrec", None, "own"), ("transformer", None, "own")])
@pytest.mark.parametrize("kernel", ["reference", "auto"])
def test_last_states_are_the_full_forwards_last_rows(kind, normalizer, kernel, query):
    """`last_states` and `encode_history(last_only=True)` (the last layer attends from each
    row's last token only) give forward()'s last row of every row, and the same cache; the
    last block's forward never runs (a fall-back to the whole layer fails this)."""
    lengths = [5, 1, 37, 2, 64]
    kw = {"normalizer": normalizer} if normalizer else {}
    time_bias_query = "own" if query == "own" else "next"
    tower = perturbed(build_tower(small_cfg(kind=kind, kernel=kernel, time_bias_query=time_bias_query,
                                            dropout=0.3, **kw))).eval()
    values, ts = rows(lengths, seed=4)
    x, t, off = torch.cat(values), torch.cat(ts), offsets(lengths)
    query_time = torch.stack([r[-1] + 5_000 for r in ts]) if query == "next_at_request_time" else None
    with torch.no_grad():
        want = tower(x, off, t, query_time_B=query_time)[off[1:] - 1]
        want_states, want_cache = tower.encode_history(x, off, t, query_time)
    assert want.abs().max() > 1.0  # a meaningful scale for the 1e-5 comparison
    calls = []
    tower.layers[-1].register_forward_hook(lambda *a: calls.append(1))
    got = tower.last_states(x, off, t, query_time)
    got_states, got_cache = tower.encode_history(x, off, t, query_time, last_only=True)
    assert calls == []
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_states, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(want_states[off[1:] - 1], want, rtol=0, atol=1e-5)
    for a, b in zip(got_cache.keys + got_cache.values, want_cache.keys + want_cache.values):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(got_cache.valid_BL, want_cache.valid_BL)
    if query == "next_at_request_time":  # the request time is in effect on the last rows
        assert (tower.last_states(x, off, t, None) - got).abs().max() > 1e-3


def test_last_states_with_the_lowpass_branch_and_bad_rows():
    """HSTU's lowpass mixes the last token's neighbours' outputs: its last layer runs whole,
    same answer. A row without a token has no last state: a clear error."""
    tower = perturbed(build_tower(small_cfg(lowpass_mix=0.4, lowpass_window=3))).eval()
    lengths = [4, 1, 9]
    values, ts = rows(lengths, seed=5)
    x, t, off = torch.cat(values), torch.cat(ts), offsets(lengths)
    with torch.no_grad():
        want = tower(x, off, t)[off[1:] - 1]
    torch.testing.assert_close(tower.last_states(x, off, t), want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="empty row"):
        tower.last_states(x, offsets([4, 0, 10]), t)
    for kind in ("hstu", "sasrec"):  # no rows at all: no states, an empty cache
        empty = build_tower(small_cfg(kind=kind)).eval()
        states, cache = empty.encode_history(x[:0], offsets([]), t[:0], last_only=True)
        assert states.shape == (0, D) and empty.last_states(x[:0], offsets([]), t[:0]).shape == (0, D)
        assert all(k.shape[0] == 0 for k in cache.keys)


@pytest.mark.parametrize("cfg", [dict(kernel="auto"), dict(kernel="reference", lowpass_mix=0.3, lowpass_window=3),
                                 dict(kernel="auto", lowpass_mix=0.3)])
@pytest.mark.parametrize("micro_batch", [None, 1])
def test_kv_cache_scoring_when_no_row_has_history(cfg, micro_batch):
    """Cold-start users only: the cache's padded history is 0 long. One candidate per
    micro-batch takes the shared-time path, whose views must not infer a size from 0 elements."""
    tower = perturbed(build_tower(small_cfg(**cfg))).eval()
    cand, cand_ts, cand_len = torch.randn(4, D), torch.tensor([10, 17, 24, 5]), [3, 1]
    with torch.no_grad():
        want = tower(cand, offsets(cand_len), cand_ts, torch.tensor(cand_len))
    _, cache = tower.encode_history(torch.zeros(0, D), offsets([0, 0]), torch.zeros(0, dtype=torch.long))
    got = tower.score_targets(cache, cand, offsets(cand_len), cand_ts, micro_batch=micro_batch)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_tower_cast_to_fp16_runs_its_fast_kernel():
    """The chunked kernel's mask (-1e30) has no fp16 form: its bias is built in fp32."""
    tower = build_tower(small_cfg(kernel="auto"))
    reference = build_tower(small_cfg(kernel="reference"))
    reference.load_state_dict(tower.state_dict())
    values, ts = rows([5, 9, 1])
    x, o, t = torch.cat(values).half(), offsets([5, 9, 1]), torch.cat(ts)
    got, want = tower.half()(x, o, t), reference.half()(x, o, t)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_float64_softmax_attention_keeps_float64():
    """The softmax of the reference attention, the cache's scoring and last-row attention is
    computed in at least fp32, not down to it: float64 towers agree to float64 precision."""
    tower = perturbed(build_tower(small_cfg(kind="transformer", kernel="reference"))).double().eval()
    hist, hist_ts = rows([6, 3], seed=4)
    cand, _ = rows([2, 3], seed=5)
    cand_ts = [h[-1] + torch.arange(n) * 7 for h, n in zip(hist_ts, [2, 3])]
    full = torch.cat([torch.cat([h, c]) for h, c in zip(hist, cand)]).double()
    full_ts = torch.cat([torch.cat([h, c]) for h, c in zip(hist_ts, cand_ts)])
    with torch.no_grad():
        y = tower(full, offsets([8, 6]), full_ts, torch.tensor([2, 3]))
        sdpa = build_tower(small_cfg(kind="transformer", kernel="auto")).double().eval()
        sdpa.load_state_dict(tower.state_dict())
        torch.testing.assert_close(sdpa(full, offsets([8, 6]), full_ts, torch.tensor([2, 3])), y, rtol=0, atol=1e-12)
    _, cache = tower.encode_history(torch.cat(hist).double(), offsets([6, 3]), torch.cat(hist_ts))
    got = tower.score_targets(cache, torch.cat(cand).double(), offsets([2, 3]), torch.cat(cand_ts))
    torch.testing.assert_close(got, torch.cat([y[6:8], y[11:14]]), rtol=0, atol=1e-12)
