"""The one-pass native HSTU attention as torch.library custom ops (dense/hstu_op.py): the
registrations hold up to torch.library.opcheck (schema, fake shapes, autograd), a function
that calls them compiles with fullgraph=True (no graph break) and computes what eager does,
and the op's gradients match the float64 PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from genrec.dense import hstu_op
from genrec.dense.bias import time_buckets

G, H, N, DQ, DV, P, NB = 3, 2, 12, 8, 6, 16, 16
ALPHA, DIVISOR = 0.35, 0.301


def _inputs(seed: int, with_ts: bool = True, with_pos: bool = True, index: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(G, H, N, DQ, generator=gen) for _ in range(2))
    v = torch.randn(G, H, N, DV, generator=gen)
    lens = torch.tensor([N, 7, 1])
    hist = torch.tensor([N, 5, 1])  # row 1: 2 candidates after a history of 5
    ts = torch.cumsum(torch.randint(0, 5000, (G, N), generator=gen), 1)
    pos = torch.arange(N).expand(G, N).contiguous()
    ts_w = torch.randn(NB + 1, generator=gen) * 0.1 if with_ts else None
    pos_w = torch.randn(P, generator=gen) * 0.1 if with_pos else None
    tidx = None
    if index and with_ts:
        tidx = time_buckets(ts[:, :, None] - ts[:, None, :], NB, DIVISOR).to(torch.uint8)
    return dict(q=q, k=k, v=v, ts=ts if with_ts else None, qts=None, tidx=tidx, ts_w=ts_w, pos_w=pos_w, pos=pos,
                hist=hist, lens=lens)


def _call(x):
    return hstu_op.attention(x["q"], x["k"], x["v"], x["ts"], x["qts"], x["tidx"], x["ts_w"], x["pos_w"], x["pos"],
                             x["hist"], x["lens"], max_seq_len=P, num_buckets=NB, alpha=ALPHA, divisor=DIVISOR)


def _reference(x):
    """float64, padded, the kernels' specification: SiLU(alpha q.k + pos_w[pos_i - pos_j] +
    ts_w[bucket(ts_i - ts_j)]) v over the visible keys (j <= i and (j < hist or j == i)),
    rows past their length zero."""
    q, k, v = (x[n].double() for n in ("q", "k", "v"))
    s = ALPHA * q @ k.transpose(-1, -2)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    if x["pos_w"] is not None:
        s = s + x["pos_w"].double()[(x["pos"][:, :, None] - x["pos"][:, None, :]).clamp(0, P - 1)][:, None]
    if x["ts_w"] is not None:
        b = time_buckets(x["ts"][:, :, None] - x["ts"][:, None, :], NB, DIVISOR)
        s = s + x["ts_w"].double()[b][:, None]
    hist, lens = x["hist"][:, None, None], x["lens"][:, None, None]
    visible = (j <= i) & ((j < hist) | (j == i)) & (i < lens) & (j < lens)
    return (torch.nn.functional.silu(s) * visible[:, None]) @ v


@pytest.mark.parametrize("with_ts, with_pos, index", [(True, True, False), (True, True, True), (False, True, False),
                                                      (True, False, False), (False, False, False)])
def test_the_op_matches_the_float64_reference_forward_and_backward(with_ts, with_pos, index):
    x = _inputs(0, with_ts, with_pos, index)
    names = [n for n in ("q", "k", "v", "ts_w", "pos_w") if x[n] is not None]
    leaves = [x[n].requires_grad_(True) for n in names]
    dout = torch.randn(G, H, N, DV, generator=torch.Generator().manual_seed(1))
    got = _call(x)
    grads = torch.autograd.grad((got * dout).sum(), leaves)
    ref64 = {n: x[n].detach().double().requires_grad_(True) if n in names else x[n] for n in x}
    want = _reference(ref64)
    want_grads = torch.autograd.grad((want * dout.double()).sum(), [ref64[n] for n in names])
    lens = x["lens"]
    valid = torch.arange(N)[None, :] < lens[:, None]
    torch.testing.assert_close(got[valid.unsqueeze(1).expand(G, H, N)], want.float()[valid.unsqueeze(1).expand(G, H, N)],
                               atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w.float(), atol=1e-4, rtol=1e-4)


def test_opcheck_holds_for_the_registrations():
    for kwargs in (dict(), dict(with_ts=False), dict(index=True)):
        x = _inputs(2, **kwargs)
        for n in ("q", "k", "v"):
            x[n].requires_grad_(True)
        args = (x["q"], x["k"], x["v"], x["ts"], x["qts"], x["tidx"], x["ts_w"], x["pos_w"], x["pos"], x["hist"],
                x["lens"], P, NB, ALPHA, DIVISOR)
        torch.library.opcheck(torch.ops.genrec.hstu_attention_fwd.default, args)


def test_a_compiled_function_traces_the_op_without_a_graph_break():
    x = _inputs(3)
    for n in ("q", "k", "v", "ts_w", "pos_w"):
        x[n].requires_grad_(True)

    def loss(q, k, v, ts_w, pos_w):
        y = hstu_op.attention(q * 1.5, k, v, x["ts"], None, None, ts_w, pos_w, x["pos"], x["hist"], x["lens"],
                              max_seq_len=P, num_buckets=NB, alpha=ALPHA, divisor=DIVISOR)
        return torch.nn.functional.silu(y).square().sum()

    leaves = [x[n] for n in ("q", "k", "v", "ts_w", "pos_w")]
    eager = loss(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    got = compiled(*leaves)
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, eager)
    for g, e in zip(got_grads, eager_grads):
        torch.testing.assert_close(g, e)


def test_bf16_inputs_are_kept_in_bf16_for_the_backward():
    """The op widens bf16 inside: autograd saves the bf16 tensors, not fp32 copies (twice
    the activation memory), and the gradients come back in bf16."""
    x = _inputs(4)
    for n in ("q", "k", "v"):
        x[n] = x[n].bfloat16().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dim(), t.dtype)) or t, lambda t: t):
        y = _call(x)
    assert [dtype for dim, dtype in saved if dim == 4] == [torch.bfloat16] * 3  # q, k, v
    grads = torch.autograd.grad(y.sum(), [x["q"], x["k"], x["v"]])
    assert all(g.dtype == torch.bfloat16 for g in grads)


def test_time_gaps_up_to_int64s_range_take_the_last_bucket():
    """|t_i - t_j| = 2^63 - 1 (or 2^63 - 1 between -2^62 and 2^62 and more) falls in the
    last bucket, as the reference clamps it, not one past ts_w."""
    x = _inputs(3)
    x["ts"] = torch.tensor([[0] * (N - 1) + [2**63 - 1]] * G)
    x["ts"][1] = torch.tensor([-(2**62)] * 6 + [2**62] * (N - 6))
    torch.testing.assert_close(_call(x).double(), _reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, error", [
    (lambda x: x.update(lens=x["lens"].int()), "lens must be torch.int64"),
    (lambda x: x.update(v=x["v"].double()), "share fp32 or bf16"),
    (lambda x: x.update(ts=None), "needs the keys' times"),
    (lambda x: x.update(tidx=torch.zeros(G, N, N - 1, dtype=torch.uint8)), "tidx must be"),
    (lambda x: x.update(pos_w=torch.zeros(P + 1)), "pos_w must be"),
    (lambda x: x.update(tidx=torch.full((G, N, N), NB + 1, dtype=torch.uint8)), "past ts_w's last"),
    (lambda x: x.update(lens=torch.tensor([N, N + 1, 1])), r"lens must lie in \[0, N = 12\]"),
    (lambda x: x.update(hist=torch.tensor([N, -1, 1])), "hist must lie in"),
])
def test_what_the_kernel_would_misread_is_refused(change, error):
    x = _inputs(5)
    change(x)
    with pytest.raises((TypeError, ValueError), match=error):
        _call(x)


def test_time_gaps_past_2_to_the_62_take_the_references_bucket():
    """With more than 142 buckets at divisor 0.301, gaps between 2^62 and 2^63 have buckets
    of their own under the reference formula; the kernels' integer thresholds reach them too."""
    nb, n = 150, 5
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(1, 1, n, DQ, generator=gen) for _ in range(2))
    v = torch.randn(1, 1, n, DV, generator=gen)
    ts = torch.tensor([[0, 2**62, 5 * 10**18, 8 * 10**18, 2**63 - 2]])
    ts_w = torch.randn(nb + 1, generator=gen)
    pos, hist = torch.arange(n)[None], torch.tensor([n])
    buckets = time_buckets(ts[:, :, None] - ts[:, None, :], nb, DIVISOR)
    assert int(buckets.max()) > 142
    s = ALPHA * q.double() @ k.double().transpose(-1, -2) + ts_w.double()[buckets][:, None]
    want = (torch.nn.functional.silu(s) * torch.ones(n, n, dtype=torch.bool).tril()) @ v.double()
    for tidx in (None, buckets.to(torch.uint8)):
        got = hstu_op.attention(q, k, v, ts, None, tidx, ts_w, None, pos, hist, hist, max_seq_len=P, num_buckets=nb,
                                alpha=ALPHA, divisor=DIVISOR)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
