"""Metric library checks: hand-computed cases, independent implementations (torchmetrics,
scikit-learn, plain loops), adversarial inputs (ties, one-class users, empty slices)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.calibration import calibration_curve
from sklearn.metrics import log_loss, roc_auc_score
from torchmetrics.classification import BinaryAUROC
from torchmetrics.retrieval import RetrievalHitRate, RetrievalMRR, RetrievalNormalizedDCG

from genrec.models.evaluation.metrics import (
    MeanOfRuns,
    RankingMetrics,
    RetrievalMetrics,
    binary_auc,
    bootstrap_ci,
    compare_models,
    headline_cis,
    paired_bootstrap,
    rank_of_target,
)
from genrec.models.evaluation.slices import (
    POPULARITY_VALUES,
    USER_TYPE_VALUES,
    PopularityScorer,
    SlicedMetrics,
    item_counts,
    length_buckets,
    new_vs_returning,
    popularity_buckets,
)

# --------------------------------------------------------------------------- retrieval


def test_rank_of_target_docstring_case_all_exclude_forms_agree():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.5], [0.2, 0.8, 0.3, 0.1]])
    target = torch.tensor([2, 0])
    padded = torch.tensor([[0, -1], [1, 2]])
    mask = torch.tensor([[True, False, False, False], [False, True, True, False]])
    jagged = (torch.tensor([0, 1, 2]), torch.tensor([0, 1, 3]))
    for exclude in (padded, mask, jagged):
        assert rank_of_target(scores, target, exclude).tolist() == [1, 0]
    # Without exclusion: user 0 has 0.9 above and 0.5 tied -> 2; user 1 has 0.8, 0.3 above -> 2.
    assert rank_of_target(scores, target).tolist() == [2, 2]
    m = RetrievalMetrics(ks=(1,))
    m.update(scores, target, padded)
    assert m.compute() == {"count": 2, "hr@1": 0.5, "ndcg@1": 0.5, "mrr": 0.75}


def test_target_is_never_excluded_and_duplicates_in_history_count_once():
    scores = torch.tensor([[0.1, 0.9, 0.8, 0.7]])
    # The target (3) is in the seen list, item 1 appears twice.
    exclude = torch.tensor([[1, 3, 1, -1]])
    assert rank_of_target(scores, torch.tensor([3]), exclude).tolist() == [1]  # only 0.8 above
    mask = torch.tensor([[False, True, False, True]])
    assert rank_of_target(scores, torch.tensor([3]), mask).tolist() == [1]
    jagged = (torch.tensor([1, 3, 1]), torch.tensor([0, 3]))
    assert rank_of_target(scores, torch.tensor([3]), jagged).tolist() == [1]
    assert mask.tolist() == [[False, True, False, True]]  # the caller's mask is not modified


def test_ties_are_pessimistic():
    # A constant model gets the worst rank among the items left after exclusion.
    scores = torch.zeros(3, 10)
    exclude = torch.tensor([[0, 1], [-1, -1], [5, 9]])
    ranks = rank_of_target(scores, torch.tensor([4, 4, 5]), exclude)
    assert ranks.tolist() == [7, 9, 8]
    # -inf ties too; +inf above a finite target counts as above.
    scores = torch.tensor([[-math.inf, -math.inf, 0.0, math.inf]])
    assert rank_of_target(scores, torch.tensor([0])).tolist() == [3]
    assert rank_of_target(scores, torch.tensor([2])).tolist() == [1]


def test_rank_of_target_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        rank_of_target(torch.tensor([[0.1, float("nan")]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="target_idx_B"):
        rank_of_target(torch.rand(2, 5), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="exclude"):
        rank_of_target(torch.rand(2, 5), torch.tensor([0, 1]), torch.tensor([[7], [0]]))
    with pytest.raises(ValueError, match="exclude"):
        rank_of_target(torch.rand(2, 5), torch.tensor([0, 1]), torch.zeros(2, 4, dtype=torch.bool))


def _brute_force_ranks(scores, target, mask):
    scores, target, mask = scores.numpy(), target.numpy(), mask.numpy()
    out = []
    for b in range(scores.shape[0]):
        t = scores[b, target[b]]
        out.append(sum(1 for j in range(scores.shape[1])
                       if j != target[b] and not mask[b, j] and scores[b, j] >= t))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_retrieval_matches_torchmetrics_and_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    B, N, ks = 40, 300, (1, 10, 50)
    # Positive scores: torchmetrics' MRR treats a target scored <= 0 as not retrieved.
    scores = torch.rand(B, N, generator=g) + 0.01
    target = torch.randint(0, N, (B,), generator=g)
    mask = torch.rand(B, N, generator=g) < 0.3
    ranks = rank_of_target(scores, target, mask)
    mask_no_target = mask.clone()
    mask_no_target[torch.arange(B), target] = False
    assert ranks.tolist() == _brute_force_ranks(scores, target, mask_no_target)
    # The index forms (with duplicates and padding) give the same ranks as the mask.
    seen = torch.where(mask, torch.arange(N).expand(B, N), torch.full((B, N), -1))
    seen = torch.cat([seen, seen[:, :50]], dim=1)[:, torch.randperm(N + 50, generator=g)]
    assert torch.equal(rank_of_target(scores, target, seen), ranks)
    lengths = (seen >= 0).sum(1)
    jagged = (seen[seen >= 0], torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
    assert torch.equal(rank_of_target(scores, target, jagged), ranks)

    m = RetrievalMetrics(ks=ks)
    for lo in range(0, B, 16):  # streamed in uneven batches
        m.update(scores[lo:lo + 16], target[lo:lo + 16], mask[lo:lo + 16])
    got = m.compute()
    # torchmetrics on the same problem with the seen items physically removed.
    keep = ~mask_no_target
    preds = scores[keep]
    rel = torch.zeros(B, N, dtype=torch.bool)
    rel[torch.arange(B), target] = True
    rel = rel[keep]
    idx = torch.arange(B)[:, None].expand(B, N)[keep]
    for k in ks:
        assert got[f"hr@{k}"] == pytest.approx(RetrievalHitRate(top_k=k)(preds, rel, indexes=idx).item(), abs=1e-6)
        assert got[f"ndcg@{k}"] == pytest.approx(
            RetrievalNormalizedDCG(top_k=k)(preds, rel, indexes=idx).item(), abs=1e-6)
    assert got["mrr"] == pytest.approx(RetrievalMRR()(preds, rel, indexes=idx).item(), abs=1e-6)
    assert got["count"] == B


def test_retrieval_hand_computed_ranks_empty_and_merge():
    m = RetrievalMetrics(ks=(10, 50))
    assert m.compute() == {"count": 0, "hr@10": None, "ndcg@10": None, "hr@50": None, "ndcg@50": None, "mrr": None}
    ranks = [0, 1, 9, 10, 60]
    m.update_ranks(torch.tensor(ranks[:2]))
    other = RetrievalMetrics(ks=(10, 50))
    other.update_ranks(np.array(ranks[2:]))
    m.merge(other)
    got = m.compute()
    assert got["hr@10"] == pytest.approx(3 / 5)
    assert got["hr@50"] == pytest.approx(4 / 5)
    assert got["ndcg@10"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(11)) / 5)
    assert got["ndcg@50"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(11) + 1 / math.log2(12)) / 5)
    assert got["mrr"] == pytest.approx(sum(1 / (r + 1) for r in ranks) / 5)
    assert m.ranks().tolist() == ranks
    assert m.per_user()["hr@10"].tolist() == [1, 1, 1, 0, 0]
    with pytest.raises(ValueError):
        m.update_ranks(torch.tensor([-1]))


# --------------------------------------------------------------------------- ranking


def test_auc_hand_case_with_tie_gets_half_credit():
    # positives 0.4, 0.8 vs negatives 0.1, 0.4: 1 + 0.5 + 1 + 1 = 3.5 of 4 pairs.
    assert binary_auc(np.array([0.1, 0.4, 0.4, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.875)
    assert binary_auc(np.array([0.5, 0.5]), np.array([0, 1])) == pytest.approx(0.5)
    assert binary_auc(np.array([0.2, 0.7]), np.array([1, 1])) is None


def _random_ranking(seed, num_candidates=600, num_users=60, tasks=2):
    rng = np.random.default_rng(seed)
    users = rng.integers(0, num_users, num_candidates)
    # Rounded probabilities: many ties, including across classes.
    probs = np.round(rng.random((num_candidates, tasks)), 1)
    labels = (rng.random((num_candidates, tasks)) < probs * 0.8).astype(np.float32)
    # Adversarial users: one all-positive, one all-negative, one with a single candidate.
    users[:5], labels[:5, :] = 1000, 1.0
    users[5:9], labels[5:9, :] = 1001, 0.0
    users[9] = 1002
    return users, probs, labels


@pytest.mark.parametrize("seed", [0, 3])
def test_ranking_matches_sklearn_and_torchmetrics(seed):
    users, probs, labels = _random_ranking(seed)
    m = RankingMetrics(tasks=["click", "conversion"], num_bins=10)
    for lo in range(0, len(users), 128):  # users span several batches
        m.update(torch.from_numpy(users[lo:lo + 128]), torch.from_numpy(probs[lo:lo + 128]),
                 torch.from_numpy(labels[lo:lo + 128]))
    got = m.compute()
    for j, task in enumerate(["click", "conversion"]):
        p, y, r = probs[:, j], labels[:, j], got[task]
        assert r["count"] == len(p)
        assert r["auc"] == pytest.approx(roc_auc_score(y, p), abs=1e-12)
        assert r["auc"] == pytest.approx(BinaryAUROC()(torch.from_numpy(p), torch.from_numpy(y).long()).item(),
                                         abs=1e-5)
        # GAUC by a plain loop over users with sklearn's AUC.
        num, den, skipped = 0.0, 0, 0
        for u in np.unique(users):
            sel = users == u
            if len(np.unique(y[sel])) < 2:
                skipped += 1
                continue
            num += roc_auc_score(y[sel], p[sel]) * sel.sum()
            den += sel.sum()
        assert r["gauc"] == pytest.approx(num / den, abs=1e-12)
        assert r["gauc_skipped_users"] == skipped and skipped >= 3
        assert r["gauc_users"] + skipped == len(np.unique(users))
        clipped = np.clip(p, 1e-7, 1 - 1e-7)
        assert r["logloss"] == pytest.approx(log_loss(y, clipped, labels=[0, 1]), rel=1e-9)
        base = y.mean()
        assert r["ne"] == pytest.approx(r["logloss"] / -(base * np.log(base) + (1 - base) * np.log(1 - base)))
        assert r["calibration"] == pytest.approx(p.sum() / y.sum())
        # Reliability curve: sklearn drops empty bins and uses (low, high] bins, so compare on
        # predictions that sit off the edges.
        off = p * 0.8 + 0.05  # rounded p -> 0.05, 0.13, 0.21, ...: never on a bin edge
        m2 = RankingMetrics(tasks=["t"], num_bins=10)
        m2.update(torch.from_numpy(users), torch.from_numpy(off[:, None]), torch.from_numpy(y[:, None]))
        curve = m2.compute()["t"]["reliability"]
        prob_true, prob_pred = calibration_curve(y, off, n_bins=10, strategy="uniform")
        nonempty = [b for b in curve if b["count"]]
        assert [b["observed"] for b in nonempty] == pytest.approx(list(prob_true))
        assert [b["mean_pred"] for b in nonempty] == pytest.approx(list(prob_pred))
        assert sum(b["count"] for b in curve) == len(p)


def test_ranking_hand_case_edges_and_one_class():
    m = RankingMetrics(tasks=["click"], num_bins=10)
    # 0.3 is an edge: it goes to the bin starting at 0.3; 1.0 goes to the last bin.
    m.update(torch.tensor([1, 1, 2, 2]), torch.tensor([[0.0], [0.3], [1.0], [0.3]]),
             torch.tensor([[0.0], [1.0], [1.0], [0.0]]))
    r = m.compute()["click"]
    counts = [b["count"] for b in r["reliability"]]
    assert counts == [1, 0, 0, 2, 0, 0, 0, 0, 0, 1]
    assert r["reliability"][1]["mean_pred"] is None and r["reliability"][1]["observed"] is None
    assert r["reliability"][3]["observed"] == 0.5
    assert r["calibration"] == pytest.approx(1.6 / 2)
    assert r["auc"] == pytest.approx(0.875)  # pos {0.3, 1.0} vs neg {0.0, 0.3}
    assert r["gauc"] == pytest.approx(1.0) and r["gauc_users"] == 2
    # Every edge lands in the bin it starts (linspace's edges are off by an ulp: 0.3, 0.7).
    edges = RankingMetrics(tasks=["click"], num_bins=10)
    p = torch.arange(11, dtype=torch.float64)[:, None] / 10
    edges.update(torch.arange(11), p, torch.zeros(11, 1))
    assert [b["count"] for b in edges.compute()["click"]["reliability"]] == [1] * 9 + [2]
    assert math.isfinite(r["logloss"])  # p = 0 with y = 0 and p = 1 with y = 1 are clipped, finite

    one_class = RankingMetrics(tasks=["conversion"])
    one_class.update(torch.tensor([1, 2]), torch.tensor([[0.1], [0.2]]), torch.tensor([[0.0], [0.0]]))
    r = one_class.compute()["conversion"]
    assert r["auc"] is None and r["gauc"] is None and r["ne"] is None and r["calibration"] is None
    assert r["gauc_skipped_users"] == 2 and r["base_rate"] == 0.0

    empty = RankingMetrics(tasks=["click"]).compute()["click"]
    assert empty["count"] == 0 and empty["auc"] is None and empty["logloss"] is None


def test_ranking_rejects_bad_labels_and_scores_naming_the_task():
    m = RankingMetrics(tasks=["click", "conversion"])
    users = torch.tensor([1, 2])
    ok = torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    with pytest.raises(ValueError, match="'conversion'.*0 or 1"):
        m.update(users, ok, torch.tensor([[0.0, 2.0], [1.0, 0.0]]))
    with pytest.raises(ValueError, match="'conversion'.*0 or 1"):
        m.update(users, ok, torch.tensor([[0.0, float("nan")], [1.0, 0.0]]))
    with pytest.raises(ValueError, match="'click'.*NaN"):
        m.update(users, torch.tensor([[float("nan"), 0.2], [0.3, 0.4]]), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="'click'.*inf"):
        m.update(users, torch.tensor([[0.1, 0.2], [float("inf"), 0.4]]), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="'click'.*logits"):
        m.update(users, torch.tensor([[1.5, 0.2], [0.3, 0.4]]), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"\[C, L\]"):
        m.update(users, ok[:, :1], torch.zeros(2, 1))
    assert m.compute()["click"]["count"] == 0  # nothing was half-accumulated


def test_ranking_per_user_sums_reproduce_headline_metrics():
    users, probs, labels = _random_ranking(5)
    m = RankingMetrics(tasks=["click", "conversion"])
    m.update(torch.from_numpy(users), torch.from_numpy(probs), torch.from_numpy(labels))
    r, pu = m.compute()["click"], m.per_user("click")
    assert pu["logloss_sum"].sum() / pu["count"].sum() == pytest.approx(r["logloss"])
    assert pu["pred_sum"].sum() / pu["label_sum"].sum() == pytest.approx(r["calibration"])
    ok = ~np.isnan(pu["auc"])
    assert (pu["auc"][ok] * pu["count"][ok]).sum() / pu["count"][ok].sum() == pytest.approx(r["gauc"])
    with pytest.raises(ValueError, match="ctr"):
        m.per_user("ctr")


# --------------------------------------------------------------------------- slices and baseline


def test_sliced_retrieval_matches_direct_subsets_and_reports_empty_slices():
    rng = np.random.default_rng(0)
    ranks = torch.from_numpy(rng.integers(0, 300, 100))
    train_counts = rng.integers(0, 3, 100)
    train_counts[:3] = 0
    hist = torch.from_numpy(rng.integers(1, 40, 100))  # nobody reaches 50+ or 200+
    country = np.array(["fr", "de", "us", "us"] * 25)
    sliced = SlicedMetrics(lambda: RetrievalMetrics(ks=(10, 50)), method="update_ranks",
                           columns={"user_type": USER_TYPE_VALUES, "history_length": ["0-4", "5-19", "20-49",
                                                                                       "50-199", "200+"],
                                    "country": None})
    for lo in (0, 50):
        s = slice(lo, lo + 50)
        sliced.update({"user_type": new_vs_returning(train_counts[s]), "history_length": length_buckets(hist[s]),
                       "country": country[s]}, ranks[s])
    out = sliced.compute()
    assert list(out["country"]) == ["de", "fr", "us"]
    assert out["history_length"]["200+"] == {"count": 0, "hr@10": None, "ndcg@10": None, "hr@50": None,
                                             "ndcg@50": None, "mrr": None}
    for column, labels in [("user_type", new_vs_returning(train_counts)), ("country", country)]:
        for value, got in out[column].items():
            direct = RetrievalMetrics(ks=(10, 50))
            direct.update_ranks(ranks[torch.from_numpy(labels == value)])
            assert got == pytest.approx(direct.compute())
    assert sum(v["count"] for v in out["history_length"].values()) == 100
    with pytest.raises(ValueError, match="'user_type'.*'old'"):
        sliced.update({"user_type": ["old"], "history_length": ["0-4"], "country": ["fr"]}, torch.tensor([1]))


def test_sliced_ranking_by_item_popularity():
    users, probs, labels = _random_ranking(1, num_candidates=200)
    items = np.random.default_rng(1).integers(0, 20, 200)
    buckets = popularity_buckets(item_counts(torch.from_numpy(items), 30))
    sliced = SlicedMetrics(lambda: RankingMetrics(tasks=["click", "conversion"]),
                           columns={"item_popularity": POPULARITY_VALUES})
    sliced.update({"item_popularity": buckets[items]}, torch.from_numpy(users), torch.from_numpy(probs),
                  torch.from_numpy(labels))
    out = sliced.compute()["item_popularity"]
    assert sum(out[v]["click"]["count"] for v in POPULARITY_VALUES) == 200
    head = buckets[items] == "head"
    direct = RankingMetrics(tasks=["click", "conversion"])
    direct.update(torch.from_numpy(users[head]), torch.from_numpy(probs[head]), torch.from_numpy(labels[head]))
    assert out["head"]["click"]["auc"] == pytest.approx(direct.compute()["click"]["auc"])


def test_bucket_helpers():
    assert length_buckets(torch.tensor([0, 4, 5, 19, 20, 199, 200, 5000])).tolist() == [
        "0-4", "0-4", "5-19", "5-19", "20-49", "50-199", "200+", "200+"]
    assert length_buckets(np.array([1, 3]), edges=(2,)).tolist() == ["0-1", "2+"]
    with pytest.raises(ValueError):
        length_buckets(np.array([1]), edges=(5, 5))
    assert new_vs_returning(torch.tensor([0, 3])).tolist() == ["new", "returning"]
    # 100 interactions: item 0 alone is 50% (head), item 1 reaches 80% (torso), the rest tail.
    assert popularity_buckets(np.array([50, 30, 10, 5, 5, 0])).tolist() == [
        "head", "torso", "tail", "tail", "tail", "tail"]
    # Equal counts share a bucket even across the mass cut.
    assert popularity_buckets(np.array([10, 10, 10, 10])).tolist() == ["head"] * 4
    assert popularity_buckets(np.zeros(3)).tolist() == ["tail"] * 3


def test_popularity_scorer_orders_by_count_and_breaks_ties_by_index():
    counts = item_counts(torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]), 4)
    assert counts.tolist() == [3, 5, 5, 0]
    pop = PopularityScorer(counts)
    assert pop.scores_N.tolist() == [2.0, 4.0, 3.0, 1.0]
    m = RetrievalMetrics(ks=(1, 2))
    # User 0 has seen item 1, so item 2 (the next most popular) is on top.
    m.update(pop.scores(2), torch.tensor([2, 0]), torch.tensor([[1], [-1]]))
    assert m.ranks().tolist() == [0, 2]
    probs = pop.candidate_probs(torch.tensor([1, 3, 0]))
    assert probs.tolist() == [1.0, 0.25, 0.5]
    with pytest.raises(ValueError):
        item_counts(torch.tensor([4]), 4)


# --------------------------------------------------------------------------- bootstrap


def test_bootstrap_ci_is_seeded_and_matches_normal_approximation():
    rng = np.random.default_rng(0)
    hits = (rng.random(2000) < 0.3).astype(float)
    a = bootstrap_ci(hits, seed=7)
    assert a == bootstrap_ci(hits, seed=7)
    assert a != bootstrap_ci(hits, seed=8)
    p = hits.mean()
    half = 1.96 * math.sqrt(p * (1 - p) / len(hits))
    assert a["estimate"] == pytest.approx(p)
    assert a["low"] < p < a["high"]
    assert a["high"] - a["low"] == pytest.approx(2 * half, rel=0.12)
    assert (a["low"] + a["high"]) / 2 == pytest.approx(p, abs=0.2 * half)


def test_bootstrap_ratio_form_and_errors():
    # Ratio of sums (GAUC style): the estimate is the count-weighted mean.
    auc, count = np.array([0.5, 1.0, 0.8]), np.array([2.0, 6.0, 2.0])
    ci = bootstrap_ci(auc * count, count, num_resamples=200)
    assert ci["estimate"] == pytest.approx((1 + 6 + 1.6) / 10)
    assert 0.5 <= ci["low"] <= ci["estimate"] <= ci["high"] <= 1.0
    assert bootstrap_ci(np.zeros(0))["estimate"] is None
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_ci(np.array([0.1, np.nan]))


def test_paired_bootstrap_detects_real_differences_only():
    rng = np.random.default_rng(1)
    base = rng.random(1500)
    same = paired_bootstrap(base, base.copy(), num_resamples=300)
    assert same["diff"] == 0.0 and same["p_value"] == 1.0
    better = paired_bootstrap(base + 0.02 + 0.05 * rng.standard_normal(1500), base, num_resamples=300)
    assert better["diff"] > 0 and better["low"] > 0 and better["p_value"] < 0.01
    noise = paired_bootstrap(base + 0.05 * rng.standard_normal(1500), base, num_resamples=300, seed=3)
    assert noise["low"] < 0 < noise["high"] and noise["p_value"] > 0.05
    # Pairing removes the shared per-user variance: its interval is far narrower than an
    # unpaired one would be (each model's own CI is ~0.03 wide here).
    assert better["high"] - better["low"] < 0.5 * (bootstrap_ci(base, num_resamples=300)["high"]
                                                 - bootstrap_ci(base, num_resamples=300)["low"])
    with pytest.raises(ValueError, match="same users"):
        paired_bootstrap(base, base[:-1])


def test_headline_cis_and_compare_models_keys_and_consistency():
    rng = np.random.default_rng(2)
    ranks_a, ranks_b = rng.integers(0, 30, 400), rng.integers(0, 300, 400)
    ra, rb = RetrievalMetrics(ks=(10,)), RetrievalMetrics(ks=(10,))
    ra.update_ranks(ranks_a)
    rb.update_ranks(ranks_b)
    users, probs, labels = _random_ranking(4)
    ka, kb = RankingMetrics(tasks=["click", "conversion"]), RankingMetrics(tasks=["click", "conversion"])
    ka.update(torch.from_numpy(users), torch.from_numpy(probs), torch.from_numpy(labels))
    kb.update(torch.from_numpy(users), torch.from_numpy(np.full_like(probs, 0.3)), torch.from_numpy(labels))
    cis = headline_cis(ra, ka, num_resamples=200)
    assert set(cis) == {"retrieval.hr@10", "retrieval.ndcg@10", "retrieval.mrr", "ranking.click.gauc",
                        "ranking.click.logloss", "ranking.conversion.gauc", "ranking.conversion.logloss"}
    assert cis["retrieval.hr@10"]["estimate"] == pytest.approx(ra.compute()["hr@10"])
    assert cis["ranking.click.gauc"]["estimate"] == pytest.approx(ka.compute()["click"]["gauc"])
    assert cis["ranking.click.logloss"]["estimate"] == pytest.approx(ka.compute()["click"]["logloss"])
    cmp = compare_models(ra, rb, ka, kb, num_resamples=200)
    assert cmp["retrieval.hr@10"]["diff"] == pytest.approx(ra.compute()["hr@10"] - rb.compute()["hr@10"])
    assert cmp["retrieval.hr@10"]["p_value"] < 0.01
    # A constant predictor has AUC 0.5 for every user.
    assert cmp["ranking.click.gauc"]["diff"] == pytest.approx(ka.compute()["click"]["gauc"] - 0.5)
    kc = RankingMetrics(tasks=["click", "conversion"])
    kc.update(torch.from_numpy(users + 1), torch.from_numpy(probs), torch.from_numpy(labels))
    with pytest.raises(ValueError, match="different users"):
        compare_models(None, None, ka, kc)


def test_mean_of_runs_averages_each_users_values_and_compares_like_one_run():
    rng = np.random.default_rng(3)
    users, probs, labels = _random_ranking(5)

    def run(high: int) -> tuple[RetrievalMetrics, RankingMetrics]:
        r, k = RetrievalMetrics(ks=(10,)), RankingMetrics(tasks=["click", "conversion"])
        r.update_ranks(rng.integers(0, high, 300))
        k.update(torch.from_numpy(users), torch.from_numpy(np.clip(probs + rng.normal(0, 0.2, probs.shape), 0, 1)),
                 torch.from_numpy(labels))
        return r, k

    (ra1, ka1), (ra2, ka2), (rb1, kb1), (rb2, kb2) = run(30), run(40), run(60), run(80)
    mean_a = MeanOfRuns([ra1, ra2], [ka1, ka2])
    mean_b = MeanOfRuns([rb1, rb2], [kb1, kb2])
    want = (ra1.per_user()["ndcg@10"] + ra2.per_user()["ndcg@10"]) / 2
    np.testing.assert_allclose(mean_a.per_user()["ndcg@10"], want)
    np.testing.assert_allclose(mean_a.per_user("click")["logloss_sum"],
                               (ka1.per_user("click")["logloss_sum"] + ka2.per_user("click")["logloss_sum"]) / 2)
    cmp = compare_models(mean_a, mean_b, mean_a, mean_b, num_resamples=200)
    # A difference of means is the mean of the runs' differences (same users, same weights).
    pair_diffs = [compare_models(a, b, num_resamples=50)["retrieval.hr@10"]["diff"] for a, b in ((ra1, rb1), (ra2, rb2))]
    assert cmp["retrieval.hr@10"]["diff"] == pytest.approx(np.mean(pair_diffs))
    assert cmp["retrieval.hr@10"]["low"] < cmp["retrieval.hr@10"]["diff"] < cmp["retrieval.hr@10"]["high"]
    assert set(cmp) >= {"ranking.click.gauc", "ranking.conversion.logloss"}
    # The mean of one run repeated is that run: the same comparison, resample for resample.
    same = compare_models(MeanOfRuns([ra1, ra1], [ka1, ka1]), MeanOfRuns([rb1, rb1], [kb1, kb1]),
                          MeanOfRuns([ra1, ra1], [ka1, ka1]), MeanOfRuns([rb1, rb1], [kb1, kb1]), num_resamples=200)
    one = compare_models(ra1, rb1, ka1, kb1, num_resamples=200)
    assert same.keys() == one.keys() and all(same[k] == pytest.approx(one[k]) for k in one)
    kc = RankingMetrics(tasks=["click", "conversion"])
    kc.update(torch.from_numpy(users + 1), torch.from_numpy(probs), torch.from_numpy(labels))
    with pytest.raises(ValueError, match="different users by the runs"):
        MeanOfRuns([ra1, ra2], [ka1, kc]).per_user("click")


def test_a_target_outside_the_corpus_is_a_miss_at_every_k_even_above_the_corpus_size():
    from genrec.models.evaluation.metrics import RetrievalMetrics
    from genrec.models.evaluation.validation import target_ranks

    corpus = torch.arange(10, 160)  # N = 150 < K = 200
    scores = torch.randn(3, 150, generator=torch.Generator().manual_seed(0))
    ranks = target_ranks(scores, torch.tensor([11, 5, 999]), corpus, torch.tensor([], dtype=torch.long),
                         torch.zeros(3, dtype=torch.long))
    metrics = RetrievalMetrics(ks=(10, 200), keep_ranks=True)
    metrics.update_ranks(ranks)
    result = metrics.compute()
    # Users 1 and 2 (targets 5 and 999 are not items of the corpus) score nothing; user 0 ranks.
    assert result["hr@200"] == pytest.approx(1 / 3) and result["mrr"] == pytest.approx(1 / (int(ranks[0]) + 1) / 3)
    assert metrics.per_user()["hr@200"].tolist() == [1.0, 0.0, 0.0]
    assert metrics.per_user()["mrr"].tolist()[1:] == [0.0, 0.0]
