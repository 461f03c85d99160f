"""Approximate retrieval (models/serving/ann.py): an artifact exported with an IVF index
answers like the exact path (the same candidates up to the 8-bit codes' rounding when every
list is scanned, high recall at the calibrated nprobe), keeps the requests' filters inside
the search, and refuses a damaged or mislabelled index file by name."""

from __future__ import annotations

import json

import pytest
import torch

from genrec.models.serving import ann
from genrec.models.serving.artifact import export_artifact, verify_artifact
from genrec.models.serving.bench import build_synthetic_model, synthetic_request
from genrec.models.serving.ranker import ServingConfig, load_artifact

NUM_ITEMS = 4000
K = 100


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model, item_ids, feats = build_synthetic_model(num_items=NUM_ITEMS, dim=16, max_seq_len=128, seed=5)
    root = tmp_path_factory.mktemp("ann")
    paths = {}
    for kind in ("exact", "ivf"):
        paths[kind] = export_artifact(model, {}, root / kind, dtype="fp32", item_ids=item_ids, item_features=feats,
                                      version=f"v-{kind}", export_program=False, retrieval_index=kind)
    return model, feats, paths


def _requests(feats, n=12):
    return [synthetic_request(NUM_ITEMS, 40, k=K, n=K, seed=s, item_features=feats) for s in range(n)]


def _retrieved(ranker, req) -> list[int]:
    return [x["item_id"] for x in ranker.rank(dict(req, sort_by="retrieval"))["items"]]


def test_manifest_records_the_calibrated_index(exported):
    _, _, paths = exported
    manifest = verify_artifact(paths["ivf"])
    entry = manifest["item_index"]["ann"]
    assert entry["file"] == ann.ANN_FILE and ann.ANN_FILE in manifest["files"]
    assert 1 <= entry["nprobe"] <= entry["nlist"] == ann.default_nlist(NUM_ITEMS)
    assert entry["calibration"]["recall"] >= entry["calibration"]["recall_target"] == 0.95
    assert verify_artifact(paths["exact"])["item_index"]["ann"] is None


def test_scanning_every_list_gives_the_exact_candidates(exported):
    _, feats, paths = exported
    exact = load_artifact(paths["exact"], ServingConfig(max_k=K))
    nlist = verify_artifact(paths["ivf"])["item_index"]["ann"]["nlist"]
    full = load_artifact(paths["ivf"], ServingConfig(max_k=K, ann_nprobe=nlist))
    for req in _requests(feats, 6):
        want, got = exact.rank(dict(req, sort_by="retrieval")), full.rank(dict(req, sort_by="retrieval"))
        # Only the 8-bit codes differ: scores within their rounding, the same items but
        # for swaps at the K-th place.
        overlap = len({x["item_id"] for x in want["items"]} & {x["item_id"] for x in got["items"]}) / K
        assert overlap >= 0.97
        exact_score = {x["item_id"]: x["retrieval_score"] for x in want["items"]}
        diffs = [abs(x["retrieval_score"] - exact_score[x["item_id"]]) for x in got["items"] if x["item_id"] in exact_score]
        assert max(diffs) < 0.02


def test_calibrated_nprobe_keeps_recall_on_user_queries(exported):
    _, feats, paths = exported
    exact = load_artifact(paths["exact"], ServingConfig(max_k=K))
    approx = load_artifact(paths["ivf"], ServingConfig(max_k=K))
    assert approx.ann is not None and exact.ann is None
    recalls = [len(set(_retrieved(exact, r)) & set(_retrieved(approx, r))) / K for r in _requests(feats)]
    assert sum(recalls) / len(recalls) >= 0.9
    # The same artifact searched exactly on request answers like the exact artifact.
    forced = load_artifact(paths["ivf"], ServingConfig(max_k=K, exact_retrieval=True))
    req = _requests(feats, 1)[0]
    assert _retrieved(forced, req) == _retrieved(exact, req)


def test_an_answer_depends_on_neither_its_batch_nor_its_own_k(exported):
    """The refinement keeps k_factor x k candidates, so a search at a larger k finds other
    items: each request is searched at its own k (at least the calibration's), never at its
    batch mates' largest."""
    _, feats, paths = exported
    r = load_artifact(paths["ivf"], ServingConfig(max_k=300))
    reqs = [dict(q, k=10, n=10, sort_by="retrieval") for q in _requests(feats, 7)]
    big = dict(reqs.pop(), k=300, n=300)
    alone = [r.rank(q) for q in reqs]
    batched = r.rank_batch(reqs + [big])[: len(reqs)]
    wider = [r.rank(dict(q, k=K, n=K)) for q in reqs]
    for a, b, w in zip(alone, batched, wider):
        ids = [x["item_id"] for x in a["items"]]
        assert len(ids) == 10
        assert [x["item_id"] for x in b["items"]] == ids == [x["item_id"] for x in w["items"]][:10]


def test_filters_run_inside_the_search(exported):
    _, feats, paths = exported
    r = load_artifact(paths["ivf"], ServingConfig(max_k=K))
    # A request whose plain top K holds some of its history, so that the filter has work.
    req = next((q for q in (synthetic_request(NUM_ITEMS, 200, k=K, n=K, seed=s, item_features=feats)
                            for s in range(40)) if set(_retrieved(r, q)) & set(q["item_ids"])), None)
    assert req is not None, "no request among 40 retrieves an item of its own history"
    seen = set(req["item_ids"])
    excluded = _retrieved(r, dict(req, exclude_seen=True))
    assert len(excluded) == K and not set(excluded) & seen
    allowed = [1, 2, 3]
    only = _retrieved(r, dict(req, allowed_advertisers=allowed))
    assert only and all(int(feats["advertiser_id"][i]) in allowed for i in only)
    both = _retrieved(r, dict(req, allowed_advertisers=allowed, exclude_seen=True))
    assert both and not set(both) & seen and all(int(feats["advertiser_id"][i]) in allowed for i in both)


def test_a_truncated_index_file_is_refused_naming_it(exported, tmp_path):
    import shutil

    _, _, paths = exported
    art = tmp_path / "art"
    shutil.copytree(paths["ivf"], art)
    data = (art / ann.ANN_FILE).read_bytes()
    (art / ann.ANN_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=ann.ANN_FILE):
        load_artifact(art)


def test_a_manifest_pointing_the_index_elsewhere_is_refused(exported, tmp_path):
    import shutil

    _, _, paths = exported
    art = tmp_path / "art"
    shutil.copytree(paths["ivf"], art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["item_index"]["ann"]["file"] = "dense.safetensors"
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="item_index.ann"):
        load_artifact(art)


def test_an_unknown_retrieval_index_is_refused_before_writing(exported, tmp_path):
    model, feats, _ = exported
    with pytest.raises(ValueError, match="retrieval_index"):
        export_artifact(model, {}, tmp_path / "x", dtype="fp32", item_ids=torch.arange(NUM_ITEMS),
                        item_features=feats, version="v", export_program=False, retrieval_index="hnsw")
    assert not (tmp_path / "x").exists()


def test_recall_helper_and_nlist_bounds():
    assert ann.recall_at_k(torch.tensor([[1, 2, -1]]), torch.tensor([[2, 3, 1]])) == pytest.approx(2 / 3)
    assert ann.default_nlist(10) == 1
    assert ann.default_nlist(1_000_000) == 2048 and ann.default_nlist(10_000_000) == 8192
