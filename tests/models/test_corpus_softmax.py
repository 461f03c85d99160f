"""The fused corpus cross-entropy against the plain one: the same loss and gradients for any
sizes, masks and block boundaries, and a reused buffer that two pending losses never share."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from genrec.models import corpus_softmax
from genrec.models.corpus_softmax import LogitsWorkspace, corpus_cross_entropy


def _case(P: int, N: int, D: int, mask_rate: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(P, D, generator=g, requires_grad=True)
    corpus = torch.randn(N, D, generator=g, requires_grad=True)
    target = torch.randint(N, (P,), generator=g)
    hit = torch.rand(P, N, generator=g) < mask_rate
    hit[torch.arange(P), target] = False  # a query's own target is never masked
    mask_p, mask_n = torch.nonzero(hit, as_tuple=True)  # row-major: queries in order
    return query, corpus, target, mask_p, mask_n


def _plain(query, corpus, target, mask_p, mask_n):
    logits = (query @ corpus.T).index_put((mask_p, mask_n), torch.tensor(float("-inf")))
    return F.cross_entropy(logits, target)


def _grads(loss, *inputs):
    return torch.autograd.grad(loss, inputs)


@settings(max_examples=40, deadline=None)
@given(P=st.integers(1, 300), N=st.integers(1, 40), D=st.integers(1, 8), mask_rate=st.sampled_from([0.0, 0.3, 0.9]),
       seed=st.integers(0, 2**16))
def test_loss_and_gradients_match_the_plain_cross_entropy(P, N, D, mask_rate, seed):
    # P up to 300 crosses the 128-row blocks; N = 1 and a 0.9 mask leave only the target
    query, corpus, target, mask_p, mask_n = _case(P, N, D, mask_rate, seed)
    want = _plain(query, corpus, target, mask_p, mask_n)
    got = corpus_cross_entropy(query, corpus, target, mask_p, mask_n, LogitsWorkspace())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(_grads(got, query, corpus), _grads(want, query, corpus)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_no_mask_is_the_plain_softmax():
    query, corpus, target, _, _ = _case(200, 30, 4, 0.0, 1)
    got = corpus_cross_entropy(query, corpus, target, None, None, LogitsWorkspace())
    torch.testing.assert_close(got, F.cross_entropy(query @ corpus.T, target))


def test_two_losses_before_one_backward_each_keep_their_own_logits():
    """A second forward while the first's backward is pending must not overwrite the
    first's logits in the shared buffer (gradient accumulation, two views of a batch)."""
    workspace = LogitsWorkspace()
    first, second = _case(150, 20, 4, 0.3, 2), _case(140, 20, 4, 0.3, 3)
    loss_a = corpus_cross_entropy(*first, workspace)
    loss_b = corpus_cross_entropy(*second, workspace)
    for case, loss in ((second, loss_b), (first, loss_a)):
        want = _grads(_plain(*case), case[0], case[1])
        for a, b in zip(_grads(loss, case[0], case[1]), want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_buffer_is_reused_once_a_backward_ran_or_its_graph_was_dropped():
    workspace = LogitsWorkspace()
    case = _case(130, 25, 4, 0.2, 4)
    corpus_cross_entropy(*case, workspace).backward()
    held = workspace._buffer.data_ptr()
    corpus_cross_entropy(*case, workspace)  # dropped without a backward
    corpus_cross_entropy(*case, workspace).backward()
    assert workspace._buffer.data_ptr() == held
    with torch.no_grad():
        corpus_cross_entropy(*case, workspace)
    loss = corpus_cross_entropy(*case, workspace)
    assert workspace._lease().buffer.data_ptr() == held
    loss.backward()


def test_a_second_backward_is_refused():
    case = _case(10, 5, 3, 0.0, 5)
    loss = corpus_cross_entropy(*case, LogitsWorkspace())
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_larger_batches_grow_the_buffer_and_smaller_ones_fit_in_it(monkeypatch):
    monkeypatch.setattr(corpus_softmax, "CHUNK_ROWS", 16)
    workspace = LogitsWorkspace()
    for P in (40, 90, 20):
        case = _case(P, 12, 3, 0.2, P)
        loss = corpus_cross_entropy(*case, workspace)
        torch.testing.assert_close(loss, _plain(*case))
        loss.backward()
    assert workspace._buffer.numel() >= 90 * 12
