"""Live row updates (models/serving/delta.py): a delta carries only the rows that changed,
the base plus its delta answers exactly like the full new artifact (and so does a chain of
deltas), a delta for another base is refused naming both versions, and a server applies one
while serving with no request seeing a half-applied model."""

from __future__ import annotations

import dataclasses
import re
import shutil
import threading
import time

import httpx
import pytest
import torch

from genrec.models.serving.artifact import ServingTable, TablePatch, export_artifact, load_artifact_contents
from genrec.models.serving.bench import build_synthetic_model, synthetic_request
from genrec.models.serving.delta import DeltaConflict, apply_delta, write_delta
from genrec.models.serving.ranker import Ranker, ServingConfig, load_artifact
from genrec.models.serving.server import create_app

from serving_helpers import TOKEN, rewrite_tensors, serve_in_thread

NUM_ITEMS = 600
CFG = ServingConfig(max_k=40, micro_batch=16)


def _perturb(model, seed: int, frac: float = 0.05) -> int:
    """Change `frac` of the item rows, one advertiser row and the dense weights; returns the
    number of item rows changed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        items = model.embeddings.embeddings["t_item_id"].weight
        rows = torch.randperm(NUM_ITEMS, generator=g)[: int(frac * NUM_ITEMS)]
        items[rows] += 0.05 * torch.randn(rows.numel(), items.shape[1], generator=g)
        model.embeddings.embeddings["t_advertiser_id"].weight[3] += 0.1
        for p in model.tower.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=g))
    return rows.numel()


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    model, item_ids, feats = build_synthetic_model(num_items=NUM_ITEMS, dim=16, max_seq_len=96, seed=4)
    root = tmp_path_factory.mktemp("delta")
    arts, changed = {}, {}
    for v in ("v1", "v2", "v3"):
        if v != "v1":
            changed[v] = _perturb(model, seed=int(v[1]))
        arts[v] = export_artifact(model, {}, root / v, dtype="int8", item_ids=item_ids, item_features=feats,
                                  version=v, export_program=False)
    deltas = {"v2": write_delta(arts["v2"], arts["v1"], root / "d-v2"), "v3": write_delta(arts["v3"], arts["v2"], root / "d-v3")}
    return {"arts": arts, "deltas": deltas, "changed": changed, "feats": feats, "root": root}


def _answers(ranker: Ranker, feats, n: int = 6) -> list[dict]:
    return [ranker.rank(synthetic_request(NUM_ITEMS, 50, k=40, n=20, seed=s, item_features=feats)) for s in range(n)]


def test_a_delta_carries_only_the_changed_rows(versions):
    import json

    manifest = json.loads((versions["deltas"]["v2"] / "manifest.json").read_text())
    assert (manifest["base_version"], manifest["version"]) == ("v1", "v2")
    changes = manifest["changes"]
    assert changes["t_item_id"] == {"changed_rows": versions["changed"]["v2"], "removed_rows": 0}
    assert changes["t_advertiser_id"]["changed_rows"] == 1 and changes["t_category_id"]["changed_rows"] == 0
    assert changes["item_index"]["changed_rows"] == versions["changed"]["v2"]
    full = (versions["arts"]["v2"] / "tables" / "t_item_id.safetensors").stat().st_size
    assert (versions["deltas"]["v2"] / "tables" / "t_item_id.safetensors").stat().st_size < 0.1 * full


def test_base_plus_delta_answers_like_the_new_artifact(versions):
    arts, deltas, feats = versions["arts"], versions["deltas"], versions["feats"]
    base = load_artifact(arts["v1"], CFG)
    v2 = Ranker(apply_delta(base.contents, deltas["v2"]), CFG)
    assert v2.version == "v2" and _answers(v2, feats) == _answers(load_artifact(arts["v2"], CFG), feats)
    v3 = Ranker(apply_delta(v2.contents, deltas["v3"]), CFG)  # a chain: the patches merge
    assert _answers(v3, feats) == _answers(load_artifact(arts["v3"], CFG), feats)
    assert _answers(base, feats) == _answers(load_artifact(arts["v1"], CFG), feats)  # the base is untouched


def test_a_delta_for_another_base_is_refused_naming_both(versions):
    base = load_artifact(versions["arts"]["v1"], CFG)
    with pytest.raises(DeltaConflict, match="'v2'.*'v1'"):
        apply_delta(base.contents, versions["deltas"]["v3"])


def test_a_delta_for_another_model_of_the_same_version_name_is_refused(versions, tmp_path):
    """Two runs can export the same version name (a retrain with --fresh in the same folder):
    a delta names its base's contents too, and serving other contents is a conflict."""
    model, item_ids, feats = build_synthetic_model(num_items=NUM_ITEMS, dim=16, max_seq_len=96, seed=7)
    other = export_artifact(model, {}, tmp_path / "v1", dtype="int8", item_ids=item_ids, item_features=feats,
                            version="v1", export_program=False)
    delta = write_delta(versions["arts"]["v2"], other, tmp_path / "d")
    base = load_artifact(versions["arts"]["v1"], CFG)
    with pytest.raises(DeltaConflict, match="'v1' is serving other contents"):
        apply_delta(base.contents, delta)
    assert apply_delta(load_artifact(other, CFG).contents, delta).manifest["version"] == "v2"


@pytest.mark.parametrize("rel,change,named", [
    ("tables/t_item_id.safetensors", lambda t: {**t, "rows": t["rows"][:, :8]}, "'rows'"),
    ("tables/t_item_id.safetensors", lambda t: {k: v for k, v in t.items() if k != "scale_bias"}, "'scale_bias'"),
    ("item_index.safetensors", lambda t: {**t, "embeddings": t["embeddings"][:, :8]}, "'embeddings'"),
    ("item_index.safetensors", lambda t: {**t, "removed_ids": t["removed_ids"].float()}, "'removed_ids'"),
])
def test_a_delta_that_does_not_fit_the_serving_model_is_refused(versions, tmp_path, rel, change, named):
    """Checked against the serving model before the swap: such a delta used to be applied,
    and then every request that read a patched row failed."""
    bad = tmp_path / "bad"
    shutil.copytree(versions["deltas"]["v2"], bad)
    rewrite_tensors(bad, rel, change)
    base = load_artifact(versions["arts"]["v1"], CFG)
    with pytest.raises(ValueError, match=re.escape(rel)) as err:
        apply_delta(base.contents, bad)
    assert named in str(err.value)


def test_a_damaged_delta_is_refused_naming_the_file(versions, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(versions["deltas"]["v2"], bad)
    path = bad / "tables" / "t_item_id.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    base = load_artifact(versions["arts"]["v1"], CFG)
    with pytest.raises(ValueError, match="tables/t_item_id.safetensors"):
        apply_delta(base.contents, bad)


def test_a_removed_row_reads_the_default_row():
    table = ServingTable(ids_N=torch.tensor([1, 5, 9]), rows_ND=torch.ones(3, 2), scale_bias_N2=None,
                         patch=TablePatch(ids_N=torch.tensor([5, 7]), live_N=torch.tensor([False, True]),
                                          rows_ND=torch.tensor([[3.0, 3.0], [2.0, 2.0]])))
    assert table.lookup(torch.tensor([1, 5, 7, 8])).tolist() == [[1, 1], [0, 0], [2, 2], [0, 0]]


def test_a_server_applies_a_delta_while_serving(versions):
    arts, deltas, feats = versions["arts"], versions["deltas"], versions["feats"]
    reqs = [synthetic_request(NUM_ITEMS, 50, k=40, n=20, seed=s, item_features=feats) for s in range(4)]
    want = {v: [load_artifact(arts[v], CFG).rank(r)["items"] for r in reqs] for v in ("v1", "v2")}
    # The server holds hot rows in a cache of 64 slots (tables of 600 rows): the delta's
    # patch and the slots' collisions under two clients must not change an answer.
    cached = dataclasses.replace(CFG, table_cache_mb=0.01)
    app = create_app(arts["v1"], serving_cfg=cached, reload_token=TOKEN, reload_dirs=[versions["root"]])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    seen, stop = [], threading.Event()
    with serve_in_thread(app) as url:
        def client():
            with httpx.Client(base_url=url, timeout=60) as c:
                while not stop.is_set():
                    for i, r in enumerate(reqs):
                        body = c.post("/v1/rank", json=r).json()
                        seen.append((body["model_version"], i, body["items"]))
        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        with httpx.Client(base_url=url, timeout=120) as c:
            wrong = c.post("/admin/apply-delta", json={"delta": str(deltas["v3"])}, headers=auth)
            assert wrong.status_code == 409 and "'v2'" in wrong.json()["detail"] and "'v1'" in wrong.json()["detail"]
            assert c.post("/admin/apply-delta", json={"delta": str(deltas["v2"])}).status_code == 401
            deadline = time.monotonic() + 60
            while not seen:  # some answers come from v1 before the delta lands
                assert time.monotonic() < deadline, "no client got an answer in 60 s"
                time.sleep(0.01)
            ok = c.post("/admin/apply-delta", json={"delta": str(deltas["v2"])}, headers=auth)
            assert ok.status_code == 200 and ok.json()["model_version"] == "v2", ok.text
            while sum(1 for v, _, _ in seen if v == "v2") < len(reqs):
                time.sleep(0.01)
            stop.set()
            for t in threads:
                t.join()
            health = c.get("/healthz").json()
            assert health["model_version"] == "v2" and health["deltas"] == [str(deltas["v2"])]
            assert health["artifact"] == str(arts["v1"])
            metrics = c.get("/metrics").text
            # A reload serves the artifact alone again: no delta on top.
            assert c.post("/admin/reload", json={}, headers=auth).status_code == 200
            health = c.get("/healthz").json()
            assert health["model_version"] == "v1" and health["deltas"] == []
    assert re.search(r'genrec_table_cache_rows\{outcome="hits",table="t_item_id"\} [1-9]', metrics), metrics
    # Every answer is one version's answer, whole. Within 1e-5, as a request batched with
    # another is answered (test_serving's batched-vs-single contract): the batch runs its
    # GEMMs at another shape, and some CPUs' kernels then round the last bit differently
    # (measured: a click probability 0.75380373 batched, 0.75380361 alone).
    assert {v for v, _, _ in seen} == {"v1", "v2"}
    assert any(not _same_answer(a, b) for a, b in zip(want["v1"], want["v2"])), "the delta must change answers"
    for v, i, items in seen:
        assert _same_answer(items, want[v][i]), (v, i)


def _same_answer(a: list[dict], b: list[dict], tol: float = 1e-5) -> bool:
    """The same items in the same order, every score and probability within `tol`."""
    def numbers(item: dict) -> list[float]:
        return [item["score"], item["retrieval_score"], *item["probabilities"].values()]
    return [x["item_id"] for x in a] == [x["item_id"] for x in b] and all(
        abs(p - q) <= tol for x, y in zip(a, b) for p, q in zip(numbers(x), numbers(y)))


def test_patches_merge_with_the_later_delta_winning():
    from genrec.models.serving.delta import _merge_patch

    first = _merge_patch(None, torch.tensor([4, 2]), {"rows_ND": torch.tensor([[4.0], [2.0]])}, torch.tensor([9]))
    assert first.ids_N.tolist() == [2, 4, 9] and first.live_N.tolist() == [True, True, False]
    # The second delta changes 9 back into a live row, removes 2 and adds 7; 4 is untouched.
    second = _merge_patch(first, torch.tensor([9, 7]), {"rows_ND": torch.tensor([[9.0], [7.0]])}, torch.tensor([2]))
    assert second.ids_N.tolist() == [2, 4, 7, 9]
    assert second.live_N.tolist() == [False, True, True, True]
    assert second.rows_ND.flatten().tolist() == [0.0, 4.0, 7.0, 9.0]


def test_a_delta_replaced_while_it_is_read_is_refused(versions, tmp_path, monkeypatch):
    """A delta exported with --overwrite over the one being applied: the files read after
    the checksums must not be the other delta's under the verified manifest's base."""
    from genrec.models.serving import delta as delta_module

    d = tmp_path / "d"
    shutil.copytree(versions["deltas"]["v2"], d)
    verify = delta_module.verify_files

    def verified_then_replaced(root, manifest):
        verify(root, manifest)
        write_delta(versions["arts"]["v3"], versions["arts"]["v2"], d, overwrite=True)

    monkeypatch.setattr(delta_module, "verify_files", verified_then_replaced)
    base = load_artifact(versions["arts"]["v1"], CFG)
    with pytest.raises(ValueError, match="replaced while it was read"):
        apply_delta(base.contents, d)
