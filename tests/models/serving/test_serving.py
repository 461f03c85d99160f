"""Serving path: served scores equal the training model's (fp32 within 1e-4, int8 within a
stated tolerance), M-FALCON equals a full recompute, batching and filters keep answers right."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from genrec.data.batch import Batch
from genrec.dense import fused
from genrec.models.serving.artifact import export_artifact
from genrec.models.serving.bench import build_synthetic_model, synthetic_request
from genrec.models.serving.ranker import RankRequest, RequestError, ServingConfig, load_artifact

NUM_ITEMS = 400
INT8_PROB_TOLERANCE = 0.01
"""Stated int8 tolerance: max |p_int8 - p_fp32| per candidate and task (measured ~2e-3)."""
BF16_PROB_TOLERANCE = 2e-3
"""Stated tolerance of a bf16 history cache (ServingConfig.history_dtype), same measure
(about 2e-4 at the bench's full size)."""
EXACT = dict(history_dtype="fp32")


HEAD_INPUTS = {"": "state", "wide": "state_and_token", "cross": "cross"}


@pytest.fixture(scope="module", params=["sum", "concat", "sum+wide", "concat+cross"])
def setup(request, tmp_path_factory):
    combine, _, head = request.param.partition("+")
    model, item_ids, feats = build_synthetic_model(num_items=NUM_ITEMS, dim=16, max_seq_len=128,
                                                   token_combine=combine, seed=3,
                                                   ranking_head_input=HEAD_INPUTS[head])
    root = tmp_path_factory.mktemp(f"serving_{request.param}")
    rankers = {}
    for dtype in ("fp32", "int8"):
        art = export_artifact(model, {}, root / dtype, dtype=dtype, item_ids=item_ids, item_features=feats,
                              version=f"v-{dtype}", export_program=False)
        rankers[dtype] = load_artifact(art, ServingConfig(max_k=60, micro_batch=16, **EXACT))
    rankers["wide"] = load_artifact(root / "fp32", ServingConfig(max_k=300, micro_batch=16, **EXACT))
    rankers["bf16"] = load_artifact(root / "fp32", ServingConfig(max_k=60, micro_batch=16, history_dtype="bf16"))
    return model, feats, rankers


def _reference(model, feats, req: dict, cand_items: torch.Tensor, similarity: str = "cosine"):
    """The training model's retrieval scores and ranking probabilities for the same input."""
    keys = model.features.sparse
    L, C = len(req["item_ids"]), cand_items.numel()
    hist = {"item_id": torch.tensor(req["item_ids"]), "action": torch.tensor(req["actions"]),
            **{f: torch.tensor(v) for f, v in req["features"].items()}}
    cand = {"item_id": cand_items, "action": torch.zeros(C, dtype=torch.long),
            **{f: feats[f][cand_items] for f in feats}}

    def kjt(vals, n):
        return KeyedJaggedTensor(keys=keys, values=torch.cat([vals[k] for k in keys]), lengths=torch.tensor([n] * len(keys)))

    batch = Batch(user_ids_B=torch.tensor([0]), history=kjt(hist, L), timestamps_T=torch.tensor(req["timestamps"]),
                  history_lengths_B=torch.tensor([L]), candidates=kjt(cand, C),
                  candidate_timestamps_C=torch.full((C,), req["timestamps"][-1]))
    user = model.user_embeddings(batch)[0]
    items = model.embeddings.embeddings["t_item_id"].weight.detach()
    if similarity == "cosine":
        items = torch.nn.functional.normalize(items, dim=-1, eps=1e-6)
    return user @ items.T, model.rank_probabilities(batch)


def test_fp32_scores_equal_the_training_model(setup):
    model, feats, rankers = setup
    req = synthetic_request(NUM_ITEMS, 50, k=60, n=60, seed=1, item_features=feats)
    out = rankers["fp32"].rank(dict(req, sort_by="retrieval"))
    got_ids = torch.tensor([x["item_id"] for x in out["items"]])
    retrieval, probs = _reference(model, feats, req, got_ids)
    # Retrieval: exactly the training model's top K (ties aside), with the same scores.
    want_top = retrieval.topk(60)
    assert torch.equal(got_ids, want_top.indices)
    assert torch.allclose(torch.tensor([x["retrieval_score"] for x in out["items"]]), want_top.values, atol=1e-5)
    got = torch.tensor([[x["probabilities"]["click"], x["probabilities"]["conversion"]] for x in out["items"]])
    assert float((got - probs).abs().max()) < 1e-4
    assert float(probs.std()) > 0.01  # the check means something: probabilities differ per item


def test_dot_similarity_serves_the_raw_inner_product(tmp_path):
    """model.similarity = "dot": the index keeps raw rows and the user vector is the raw
    state, so served scores are the training model's unnormalized inner products."""
    model, item_ids, feats = build_synthetic_model(num_items=NUM_ITEMS, dim=16, max_seq_len=128, seed=4,
                                                   similarity="dot")
    art = export_artifact(model, {}, tmp_path / "dot", dtype="fp32", item_ids=item_ids, item_features=feats,
                          version="v-dot", export_program=False)
    req = synthetic_request(NUM_ITEMS, 50, k=40, n=40, seed=2, item_features=feats)
    out = load_artifact(art, ServingConfig(max_k=40, micro_batch=16)).rank(dict(req, sort_by="retrieval"))
    got_ids = torch.tensor([x["item_id"] for x in out["items"]])
    retrieval, _ = _reference(model, feats, req, got_ids, similarity="dot")
    want_top = retrieval.topk(40)
    assert torch.equal(got_ids, want_top.indices)
    got = torch.tensor([x["retrieval_score"] for x in out["items"]])
    assert torch.allclose(got, want_top.values, rtol=1e-5, atol=1e-5)
    cosine, _ = _reference(model, feats, req, got_ids, similarity="cosine")
    assert not torch.equal(cosine.topk(40).indices, got_ids)  # the check tells the two apart


def test_int8_within_stated_tolerance(setup):
    model, feats, rankers = setup
    req = synthetic_request(NUM_ITEMS, 50, k=60, n=60, seed=2, item_features=feats)
    out = rankers["int8"].rank(dict(req, sort_by="retrieval"))
    ids = torch.tensor([x["item_id"] for x in out["items"]])
    _, probs = _reference(model, feats, req, ids)
    got = torch.tensor([[x["probabilities"]["click"], x["probabilities"]["conversion"]] for x in out["items"]])
    assert float((got - probs).abs().max()) < INT8_PROB_TOLERANCE
    assert out["model_version"] == "v-int8"


def test_bf16_history_within_stated_tolerance(setup):
    """history_dtype = "bf16": the same retrieval (the user vector is computed before the
    cache is narrowed), ranking probabilities within the stated tolerance, the cache in bf16."""
    model, feats, rankers = setup
    req = synthetic_request(NUM_ITEMS, 50, k=60, n=60, seed=2, item_features=feats)
    out = rankers["bf16"].rank(dict(req, sort_by="retrieval"))
    exact = rankers["fp32"].rank(dict(req, sort_by="retrieval"))
    assert [x["item_id"] for x in out["items"]] == [x["item_id"] for x in exact["items"]]
    ids = torch.tensor([x["item_id"] for x in out["items"]])
    _, probs = _reference(model, feats, req, ids)
    got = torch.tensor([[x["probabilities"]["click"], x["probabilities"]["conversion"]] for x in out["items"]])
    assert 0 < float((got - probs).abs().max()) < BF16_PROB_TOLERANCE
    assert rankers["bf16"].score_dtype(60, 50) == torch.bfloat16 and rankers["fp32"].score_dtype(60, 50) == torch.float32


def test_history_dtype_auto_and_bad_values(setup):
    """"auto": bf16 for large products on a CPU with native bf16, fp32 otherwise."""
    _, _, rankers = setup
    auto = load_artifact(rankers["fp32"].path, ServingConfig(max_k=60, micro_batch=512))
    big = torch.bfloat16 if fused.has_native_bf16() else torch.float32
    assert auto.score_dtype(500, 1024) == big and auto.score_dtype(256, 512) == big
    assert auto.score_dtype(100, 1024) == torch.float32 and auto.score_dtype(500, 128) == torch.float32
    with pytest.raises(ValueError, match="ServingConfig.history_dtype must be one of"):
        load_artifact(rankers["fp32"].path, ServingConfig(history_dtype="fp16"))


def test_an_advertiser_feature_the_artifact_lacks_is_refused_at_load(setup):
    """--advertiser-feature naming a feature the items do not carry started a server whose
    every allowed_advertisers request then failed; the default may be absent (no filter)."""
    _, _, rankers = setup
    side = sorted(rankers["fp32"].item_side)
    assert side, "the setup's items carry side features"
    assert load_artifact(rankers["fp32"].path, ServingConfig(advertiser_feature=side[-1])).item_side
    with pytest.raises(ValueError, match=r"--advertiser-feature\) 'advertiser' is not an item feature of this "
                                         r"artifact; it has \["):
        load_artifact(rankers["fp32"].path, ServingConfig(advertiser_feature="advertiser"))


@pytest.mark.parametrize("key, value", [("micro_batch", -1), ("micro_batch", 0), ("max_k", 0), ("max_n", 0),
                                        ("max_request_events", 0), ("retrieval_block_rows", -5),
                                        ("max_history", 0), ("ann_nprobe", 0), ("micro_batch", 2.5)])
def test_serving_limits_below_one_are_refused_naming_the_key(key, value):
    """micro_batch = -1 ranked uninitialised states with a 200; 0 answered every request
    with a 500; a max_k of 0 started a server that refused every request."""
    with pytest.raises(ValueError, match=f"ServingConfig.{key} must be an integer >= 1"):
        ServingConfig(**{key: value})


def test_batcher_limits_are_refused_naming_the_key(setup):
    from genrec.models.serving.batcher import Batcher

    _, _, rankers = setup
    for kwargs, key in [(dict(max_batch_size=0), "max_batch_size"), (dict(max_queue=0), "max_queue"),
                        (dict(max_wait_ms=float("nan")), "max_wait_ms"), (dict(workers=0), "workers")]:
        args = dict(max_batch_size=4, max_wait_ms=1.0, max_queue=8) | kwargs
        with pytest.raises(ValueError, match=f"serve: {key} must be"):
            Batcher(rankers["fp32"], metrics=None, **args)


def test_k_beyond_max_seq_len_minus_history(setup):
    """K + history may exceed the tower's max_seq_len: candidates go in chunks that fit, and
    each candidate's score is what the training model gives it in a smaller candidate set."""
    model, feats, rankers = setup
    req = synthetic_request(NUM_ITEMS, 120, k=300, n=300, seed=12, item_features=feats)
    out = rankers["wide"].rank(dict(req, sort_by="retrieval"))
    assert len(out["items"]) == 300
    ids = torch.tensor([x["item_id"] for x in out["items"]])
    got = torch.tensor([[x["probabilities"]["click"], x["probabilities"]["conversion"]] for x in out["items"]])
    for c0 in (0, 150, 292):  # the training model takes at most 128 - 120 candidates at once
        _, probs = _reference(model, feats, req, ids[c0 : c0 + 8])
        assert float((got[c0 : c0 + 8] - probs).abs().max()) < 1e-4


def test_mfalcon_equals_full_recompute(setup):
    _, feats, rankers = setup
    r = rankers["fp32"]
    req = RankRequest(**synthetic_request(NUM_ITEMS, 40, k=50, n=10, seed=4, item_features=feats))
    hist = r._history(req)
    user, cache = r.encode([hist])
    _, idx = r.retrieve(user, 50, [{}])
    mf = r.score_candidates(cache, [idx[0]], [hist["request_time"]])
    rc = r.score_candidates_recompute(hist, idx[0], hist["request_time"])
    assert float((mf - rc).abs().max()) < 1e-5


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_batched_requests_equal_single_requests(setup, dtype):
    """A request's answer does not depend on the others in its server batch (int8: each
    user vector is quantized on its own, not with the batch's range)."""
    _, feats, rankers = setup
    r = rankers[dtype]
    reqs = [synthetic_request(NUM_ITEMS, h, k=k, n=5, seed=10 + i, item_features=feats)
            for i, (h, k) in enumerate([(7, 20), (50, 60), (1, 5)])]
    together = r.rank_batch(reqs)
    for req, got in zip(reqs, together):
        alone = r.rank(req)
        assert [x["item_id"] for x in got["items"]] == [x["item_id"] for x in alone["items"]]
        for key in ("score", "retrieval_score"):
            assert max(abs(a[key] - b[key]) for a, b in zip(got["items"], alone["items"])) < 1e-5, key


def test_filters(setup):
    _, feats, rankers = setup
    r = rankers["fp32"]
    req = synthetic_request(NUM_ITEMS, 30, k=60, n=60, seed=5, item_features=feats)
    plain = {x["item_id"] for x in r.rank(dict(req, sort_by="retrieval"))["items"]}
    seen = set(req["item_ids"])
    assert plain & seen, "test needs a history item among the plain top K"
    excluded = r.rank(dict(req, exclude_seen=True))
    assert not ({x["item_id"] for x in excluded["items"]} & seen)
    allowed = [1, 2, 3]
    filtered = r.rank(dict(req, allowed_advertisers=allowed))
    assert filtered["items"]
    assert all(int(feats["advertiser_id"][x["item_id"]]) in allowed for x in filtered["items"])


def test_history_keeps_most_recent_events_sorted_by_time(setup):
    _, feats, rankers = setup
    r = rankers["fp32"]
    assert r.max_history == 127
    req = synthetic_request(NUM_ITEMS, 150, k=60, n=10, seed=6, item_features=feats)
    out = r.rank(req)
    assert out["history_truncated"] and out["history_used"] == 127
    tail = {key: (v[-127:] if isinstance(v, list) else v) for key, v in req.items()}
    tail["features"] = {f: v[-127:] for f, v in req["features"].items()}
    assert r.rank(tail)["items"] == out["items"]
    # Shuffled events give the same answer: the history is sorted by timestamp first.
    perm = torch.randperm(150, generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = {key: ([v[i] for i in perm] if isinstance(v, list) else v) for key, v in req.items()}
    shuffled["features"] = {f: [v[i] for i in perm] for f, v in req["features"].items()}
    assert r.rank(shuffled)["items"] == out["items"]


def test_side_features_default_to_the_item_index(setup):
    _, feats, rankers = setup
    r = rankers["fp32"]
    req = synthetic_request(NUM_ITEMS, 20, k=10, n=10, seed=7, item_features=feats)
    without = {key: v for key, v in req.items() if key != "features"}
    assert r.rank(without)["items"] == r.rank(req)["items"]


def test_request_context_overrides_candidate_side_features(setup):
    model, feats, rankers = setup
    r = rankers["fp32"]
    req = synthetic_request(NUM_ITEMS, 30, k=20, n=20, seed=13, item_features=feats)
    plain = r.rank(dict(req, sort_by="retrieval"))
    ctx = r.rank(dict(req, sort_by="retrieval", context={"category_id": 7}))
    assert [x["item_id"] for x in ctx["items"]] == [x["item_id"] for x in plain["items"]]  # retrieval unchanged
    ids = torch.tensor([x["item_id"] for x in ctx["items"]])
    saved = feats["category_id"]
    try:
        feats["category_id"] = torch.full_like(saved, 7)  # the training model sees category 7 on every candidate
        _, probs = _reference(model, feats, req, ids)
    finally:
        feats["category_id"] = saved
    got = torch.tensor([[x["probabilities"]["click"], x["probabilities"]["conversion"]] for x in ctx["items"]])
    assert float((got - probs).abs().max()) < 1e-4
    assert got.ne(torch.tensor([[x["probabilities"]["click"], x["probabilities"]["conversion"]]
                                for x in plain["items"]])).any()


@pytest.mark.parametrize("change,field", [
    ({"context": {"action": 1}}, "context.action"),
    ({"k": 61}, "k"), ({"n": 11, "k": 10}, "n"), ({"actions": [1]}, "actions"),
    ({"features": {"campaign_id": [1]}}, "features.campaign_id"), ({"sort_by": "revenue"}, "sort_by"),
    ({"item_ids": [], "actions": [], "timestamps": []}, "item_ids"),
])
def test_bad_requests_name_the_field(setup, change, field):
    _, feats, rankers = setup
    req = synthetic_request(NUM_ITEMS, 5, k=10, n=5, seed=8)
    with pytest.raises(RequestError) as e:
        rankers["fp32"].rank(dict(req, **change))
    assert e.value.field == field


def _plain_top_k(r, users, k, allowed=None):
    """The exact top-k in plain PyTorch: dequantized inner products, filtered rows -inf."""
    rows = r.item_rows_ND.float()
    scores = users @ rows.T if r.item_scale_N is None else (users @ rows.T) * r.item_scale_N
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores, scores.topk(k, dim=1)


@pytest.mark.skipif(fused.library() is None, reason="GENREC_DENSE_FUSED=0 chose the PyTorch paths")
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_native_retrieval_scan_is_the_exact_top_k(setup, dtype):
    """The native scan returns the exact top-k of the artifact's rows: each returned score
    is the row's inner product, best first, no row outside the top k (up to rounding at the
    boundary), filtered rows never, and -inf / -1 after the last row a filter leaves."""
    _, feats, rankers = setup
    r = rankers[dtype]
    assert r._native_scan  # the install built the scan; no FBGEMM copy of the index is made
    assert r._int8_blocks is None
    users = torch.cat([r.encode([r._history(RankRequest(**synthetic_request(NUM_ITEMS, 20, k=20, n=5, seed=s)))])[0]
                       for s in (9, 10, 11)])
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, NUM_ITEMS, generator=g) < 0.3
    allowed[2] = False
    allowed[2, [5, 77, 390]] = True  # a filter that leaves 3 rows for k = 50
    excluded = torch.tensor([0, 1, 2, 399])
    masks = [{}, {"allowed_N": allowed[1], "exclude": excluded}, {"allowed_N": allowed[2]}]
    keep = torch.ones(3, NUM_ITEMS, dtype=torch.bool)
    keep[1] = allowed[1]
    keep[1, excluded] = False
    keep[2] = allowed[2]
    for k in (1, 50, NUM_ITEMS + 5):
        got_s, got_i = r.retrieve(users, k, masks)
        want_s, (top_s, _) = _plain_top_k(r, users, min(k, NUM_ITEMS), keep)
        assert got_s.shape == (3, min(k, NUM_ITEMS))
        for b in range(3):
            n_ok = int(keep[b].sum())
            found = got_i[b][got_s[b] > float("-inf")]
            assert found.numel() == min(n_ok, got_s.shape[1])
            assert (got_i[b, found.numel():] == -1).all()
            assert keep[b, found].all() and found.unique().numel() == found.numel()
            s = got_s[b, :found.numel()]
            assert (s[:-1] >= s[1:]).all()
            torch.testing.assert_close(s, want_s[b, found], rtol=1e-5, atol=1e-5)
            kth = top_s[b, found.numel() - 1]
            assert (want_s[b, found] >= kth - 1e-5).all()


def test_int8_retrieval_without_the_scan_uses_fbgemm_close_to_exact(setup):
    """GENREC_DENSE_FUSED=0's path: FBGEMM's int8 GEMM (which also quantizes the user vector,
    uint8 per tensor) stays close to the exact int8 scores."""
    _, feats, rankers = setup
    r = rankers["int8"]
    user, _ = r.encode([r._history(RankRequest(**synthetic_request(NUM_ITEMS, 20, k=20, n=5, seed=9)))])
    s_ref, i_ref = r.retrieve(user, 20, [{}])
    r._native_scan, r._int8_blocks = False, r._pack_int8_index()
    try:
        assert r._int8_blocks is not None  # this torch has FBGEMM's int8 GEMM
        s_gemm, i_gemm = r.retrieve(user, 20, [{}])
    finally:
        r._native_scan, r._int8_blocks = True, None
    assert float((s_gemm - s_ref).abs().max()) < 0.02
    assert len(set(i_gemm[0, :10].tolist()) & set(i_ref[0].tolist())) >= 9


def test_request_time_is_the_query_time_of_the_time_bias(tmp_path):
    """With the reference's query-time bias, the served user vector is the training model's
    at the request's time: different request times give different retrievals, each equal
    to the model's user embedding with that query time."""
    model, item_ids, feats = build_synthetic_model(num_items=NUM_ITEMS, dim=16, max_seq_len=128, seed=5)
    model.tower.cfg.time_bias_query = "next"
    with torch.no_grad():
        for layer in model.tower.layers:  # a time bias large enough to move the scores
            layer.ts_w.normal_(0, 3.0)
    art = export_artifact(model, {}, tmp_path / "art", dtype="fp32", item_ids=item_ids, item_features=feats,
                          version="v", export_program=False)
    ranker = load_artifact(art, ServingConfig(max_k=60, micro_batch=16))
    req = synthetic_request(NUM_ITEMS, 30, k=20, n=20, seed=4, item_features=feats)
    scores = {}
    for when in (req["timestamps"][-1], req["timestamps"][-1] + 86_400 * 30):
        out = ranker.rank(dict(req, sort_by="retrieval", request_time=when))
        got = {x["item_id"]: x["retrieval_score"] for x in out["items"]}
        keys = model.features.sparse
        L = len(req["item_ids"])
        hist = {"item_id": torch.tensor(req["item_ids"]), "action": torch.tensor(req["actions"]),
                **{f: torch.tensor(v) for f, v in req["features"].items()}}
        batch = Batch(user_ids_B=torch.tensor([0]),
                      history=KeyedJaggedTensor(keys=keys, values=torch.cat([hist[k] for k in keys]),
                                                lengths=torch.tensor([L] * len(keys))),
                      timestamps_T=torch.tensor(req["timestamps"]), history_lengths_B=torch.tensor([L]),
                      query_time_B=torch.tensor([when]))
        user = model.user_embeddings(batch)[0]
        items = torch.nn.functional.normalize(model.embeddings.embeddings["t_item_id"].weight.detach(), dim=-1,
                                              eps=1e-6)
        want = user @ items.T
        for item, score in got.items():
            assert abs(score - float(want[item])) < 1e-5
        scores[when] = got
    first, later = scores.values()
    assert first != later  # the request time reached the tower


def test_item_rows_through_the_index_map_equal_a_search_of_the_item_table(tmp_path):
    """History and candidate rows read through the index -> item-table map (found at load)
    equal a search of the table, also for history items the index lacks: in the table only,
    or in neither (the default row)."""
    model, item_ids, feats = build_synthetic_model(num_items=NUM_ITEMS, dim=16, max_seq_len=128, seed=5)
    keep = item_ids[::2]  # the index holds half of the table's items
    art = export_artifact(model, {}, tmp_path / "a", dtype="fp32", item_ids=keep,
                          item_features={f: v[::2] for f, v in feats.items()}, version="v", export_program=False)
    ranker = load_artifact(art, ServingConfig(max_k=60, micro_batch=16))
    req = synthetic_request(NUM_ITEMS, 50, k=20, n=20, seed=2, item_features=feats)
    req["item_ids"][:3] = [1, 3, NUM_ITEMS + 7]
    hist = ranker._history(RankRequest(**req))
    cand = [torch.arange(0, keep.numel(), 3)]
    mapped = ranker.history_tokens([hist])[0], ranker.candidate_tokens(cand)
    ranker._item_table_at, hist["item_at"] = None, None  # every lookup searches the table
    searched = ranker.history_tokens([hist])[0], ranker.candidate_tokens(cand)
    assert torch.equal(mapped[0], searched[0]) and torch.equal(mapped[1], searched[1])
    # The items the index lacks read their own rows: the table's for 1 and 3, none for the third.
    rows = ranker.table_of["item_id"].lookup(torch.tensor([1, 3, NUM_ITEMS + 7]))
    assert bool(rows[:2].abs().sum(1).gt(0).all()) and not bool(rows[2].any())


def test_history_dtype_auto_does_not_depend_on_the_batch(tmp_path, monkeypatch):
    """history_dtype="auto" picks bf16 for large products: the choice is the request's own,
    not its batch's (a short history batched beside a long one used to be scored in bf16,
    alone in fp32, and its answer changed by ~1e-2)."""
    model, item_ids, feats = build_synthetic_model(num_items=600, dim=16, max_seq_len=400, seed=3)
    with torch.no_grad():  # attention logits of a trained model's size, so bf16 shows
        for name, p in model.named_parameters():
            if name.endswith("uvqk.weight"):
                p.mul_(20)
    art = export_artifact(model, {}, tmp_path / "a", dtype="fp32", item_ids=item_ids, item_features=feats,
                          version="v", export_program=False)
    r = load_artifact(art, ServingConfig(max_k=600, history_dtype="auto"))
    monkeypatch.setattr(r, "_native_bf16", True)  # the CPUs where "auto" chooses bf16
    short = synthetic_request(600, 5, k=500, n=50, seed=1, item_features=feats)
    long = synthetic_request(600, 300, k=500, n=50, seed=2, item_features=feats)
    alone = r.rank(short)
    together = r.rank_batch([short, long])[0]
    assert [x["item_id"] for x in together["items"]] == [x["item_id"] for x in alone["items"]]
    assert max(abs(a["score"] - b["score"]) for a, b in zip(together["items"], alone["items"])) < 1e-5
