"""Export artifact: contents, checksums (tamper / truncation refused by file name), no pickle
(not even from a crafted program file), id index with a default row, quantization error
bounds, the torch.export program."""

from __future__ import annotations

import ast
import hashlib
import io
import json
import pickle
import re
import zipfile
from pathlib import Path

import pytest
import torch

from genrec.models.serving import artifact as artifact_module
from genrec.models.serving import ranker as ranker_module
from genrec.models.serving.artifact import (
    ServingTable, dequantize_rows, export_artifact, load_artifact_contents, quantize_rows, verify_artifact,
)
from genrec.models.serving.bench import build_synthetic_model

from serving_helpers import rewrite_tensors

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_and_items():
    return build_synthetic_model(num_items=300, dim=16, max_seq_len=64)


def _export(model_and_items, path, dtype="fp32", **kw):
    model, item_ids, feats = model_and_items
    return export_artifact(model, {"dense": {"embedding_dim": 16}}, path, dtype=dtype, item_ids=item_ids,
                           item_features=feats, version="v-test", export_program=kw.pop("export_program", False), **kw)


def test_manifest_lists_every_file_with_checksum(model_and_items, tmp_path):
    art = _export(model_and_items, tmp_path / "a")
    manifest = json.loads((art / "manifest.json").read_text())
    on_disk = {p.relative_to(art).as_posix() for p in art.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert {"dense.safetensors", "item_index.safetensors"} <= on_disk
    assert manifest["version"] == "v-test" and manifest["dtype"] == "fp32"
    assert manifest["features"]["item"] == "item_id"
    assert manifest["tower"]["max_seq_len"] == 64
    assert "torch" in manifest["libraries"] and "safetensors" in manifest["libraries"]
    assert manifest["job_config"] == {"dense": {"embedding_dim": 16}}
    # No temporary directory is left beside the artifact.
    assert [p.name for p in tmp_path.iterdir()] == ["a"]


def test_existing_directory_is_not_overwritten_by_default(model_and_items, tmp_path):
    _export(model_and_items, tmp_path / "a")
    with pytest.raises(FileExistsError):
        _export(model_and_items, tmp_path / "a")
    _export(model_and_items, tmp_path / "a", overwrite=True)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_file_is_refused_naming_it(model_and_items, tmp_path, damage):
    art = _export(model_and_items, tmp_path / "a")
    victim = art / "tables" / "t_item_id.safetensors"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) - 100]))
    else:
        victim.unlink()
    with pytest.raises(ValueError, match="tables/t_item_id.safetensors"):
        load_artifact_contents(art)


# (dtype, file, change, what the error names). Each loaded before, then failed per request
# or answered wrongly.
_INCONSISTENT = [
    ("fp32", "tables/t_item_id.safetensors", lambda t: {**t, "rows": t["rows"][:10]}, "'rows'"),
    ("fp32", "tables/t_item_id.safetensors", lambda t: {**t, "rows": t["rows"][:, :8]}, "'rows'"),
    ("fp32", "tables/t_item_id.safetensors", lambda t: {**t, "ids": t["ids"].flip(0)}, "strictly increasing"),
    ("int8", "tables/t_item_id.safetensors", lambda t: {k: v for k, v in t.items() if k != "scale_bias"},
     "'scale_bias'"),
    ("int8", "tables/t_item_id.safetensors", lambda t: {**t, "rows": t["rows"].float()}, "'rows'"),
    ("fp32", "item_index.safetensors", lambda t: {**t, "embeddings": t["embeddings"][:50]}, "'embeddings'"),
    ("int8", "item_index.safetensors", lambda t: {k: v for k, v in t.items() if k != "scale"}, "'scale'"),
    ("fp32", "item_index.safetensors", lambda t: {**t, "feature.advertiser_id": t["feature.advertiser_id"][:50]},
     "'feature.advertiser_id'"),
    ("fp32", "item_index.safetensors", lambda t: {**t, "item_ids": t["item_ids"].float()}, "'item_ids'"),
]


@pytest.mark.parametrize("dtype,rel,change,named", _INCONSISTENT)
def test_an_inconsistent_file_is_refused_at_load_naming_it(model_and_items, tmp_path, dtype, rel, change, named):
    art = _export(model_and_items, tmp_path / "a", dtype=dtype)
    rewrite_tensors(art, rel, change)
    with pytest.raises(ValueError, match=re.escape(rel)) as err:
        load_artifact_contents(art)
    assert named in str(err.value)


def test_tampered_manifest_json_is_refused(model_and_items, tmp_path):
    art = _export(model_and_items, tmp_path / "a")
    (art / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest"):
        verify_artifact(art)


def _drop(d: dict, key: str) -> None:
    del d[key]


# (how the manifest is damaged, the key the error must name). Each one used to escape
# Ranker.__init__ as a KeyError, a TypeError or a RuntimeError.
_BAD_MANIFESTS = [
    (lambda m: m["features"].update(sparse=5), "features.sparse"),
    (lambda m: m["features"].update(colour="red"), "features.colour"),
    (lambda m: m["features"].update(labels=["click", 3]), "features.labels"),
    (lambda m: m["model"].update(ranking_tasks="click"), "model.ranking_tasks"),
    (lambda m: m["model"].update(negatives="some"), "model.negatives"),
    (lambda m: m["model"].update(ranking_hidden_dim=3), "model"),
    (lambda m: m["tower"].update(embedding_dim="16"), "tower.embedding_dim"),
    (lambda m: m["tower"].update(num_layers=5), "tower"),
    (lambda m: m["tower"].update(bogus=1), "tower.bogus"),
    (lambda m: _drop(m["feature_dims"], "category_id"), "feature_dims.category_id"),
    (lambda m: m["feature_dims"].update(advertiser_id="16"), "feature_dims.advertiser_id"),
    (lambda m: m["tables"]["t_category_id"].update(features=[]), "category_id"),
    (lambda m: m.update(item_index=[300]), "item_index"),
    (lambda m: m["item_index"].update(ann="ivf"), "item_index"),
    (lambda m: m["item_index"].update(ann=""), "item_index"),
]


@pytest.mark.parametrize("damage,key", _BAD_MANIFESTS)
def test_malformed_manifest_is_a_value_error_naming_the_key(model_and_items, tmp_path, damage, key):
    art = _export(model_and_items, tmp_path / "a")
    manifest = json.loads((art / "manifest.json").read_text())
    damage(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))  # the manifest checksums other files only
    with pytest.raises(ValueError, match=re.escape(key)) as err:
        ranker_module.load_artifact(art)
    assert "manifest.json" in str(err.value)


def test_loading_never_unpickles(model_and_items, tmp_path, monkeypatch):
    art = _export(model_and_items, tmp_path / "a", dtype="int8")

    def forbidden(*a, **k):
        raise AssertionError("artifact loading must not unpickle")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    contents = load_artifact_contents(art)
    assert contents.tables["t_item_id"].rows_ND.dtype == torch.uint8


def test_table_lookup_uses_sorted_id_index_and_default_row():
    ids = torch.tensor([90, 3, 17])
    rows = torch.tensor([[9.0, 9.0], [3.0, 3.0], [1.0, 7.0]])
    order = torch.argsort(ids)
    table = ServingTable(ids_N=ids[order], rows_ND=rows[order], scale_bias_N2=None)
    got = table.lookup(torch.tensor([17, 5, 90, 1000, -4, 3]))
    want = torch.tensor([[1.0, 7.0], [0.0, 0.0], [9.0, 9.0], [0.0, 0.0], [0.0, 0.0], [3.0, 3.0]])
    assert torch.equal(got, want)


def test_exported_rows_match_the_model(model_and_items, tmp_path):
    model, item_ids, _ = model_and_items
    art = _export(model_and_items, tmp_path / "a")
    contents = load_artifact_contents(art)
    w = model.embeddings.embeddings["t_category_id"].weight.detach()
    assert torch.equal(contents.tables["t_category_id"].lookup(torch.arange(w.shape[0])), w)
    want = torch.nn.functional.normalize(model.embeddings.embeddings["t_item_id"].weight.detach(), dim=-1, eps=1e-6)
    assert torch.equal(contents.item_rows_ND, want[contents.item_ids_N])
    dense = {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")}
    assert dense.keys() == contents.dense_state.keys()
    assert all(torch.equal(dense[k], contents.dense_state[k]) for k in dense)


@pytest.mark.parametrize("dtype,bound", [("fp16", 1e-3), ("int8", None)])
def test_quantization_error_is_bounded(dtype, bound):
    x = torch.randn(500, 32) * torch.rand(500, 1) * 3
    q, sb = quantize_rows(x, dtype)
    err = (dequantize_rows(q, sb) - x).abs()
    if dtype == "int8":
        assert q.dtype == torch.uint8
        # Round to nearest: at most half a step of each row's own scale.
        assert bool((err <= sb[:, :1] * 0.5 + 1e-6).all())
    else:
        assert float(err.max()) < bound * float(x.abs().max())


def test_missing_item_side_features_is_an_error(model_and_items, tmp_path):
    model, item_ids, feats = model_and_items
    with pytest.raises(ValueError, match="advertiser_id"):
        export_artifact(model, {}, tmp_path / "a", dtype="fp32", item_ids=item_ids,
                        item_features={"category_id": feats["category_id"]}, version="v")


@pytest.fixture(scope="module")
def program_artifact(tmp_path_factory):
    model, item_ids, feats = build_synthetic_model(num_items=50, dim=8, max_seq_len=32, num_layers=1)
    art = export_artifact(model, {}, tmp_path_factory.mktemp("program") / "a", dtype="fp32", item_ids=item_ids,
                          item_features=feats, version="v", export_program=True)
    return model, art


def test_exported_program_reproduces_the_tower(program_artifact):
    model, art = program_artifact
    manifest = verify_artifact(art)
    assert manifest["program"]["file"] == "tower.pt2" and "tower.pt2" in manifest["files"]
    # This test trusts the file it has just written; genrec itself never loads it.
    program = torch.export.load(art / "tower.pt2").module()
    offsets = torch.tensor(manifest["program"]["example_offsets_B1"])
    num_targets = torch.tensor(manifest["program"]["example_num_targets_B"])
    T = int(offsets[-1])
    x = torch.randn(T, 8)
    ts = torch.arange(T) * 13 + 1000
    with torch.no_grad():
        assert torch.allclose(program(x, offsets, ts, num_targets), model.tower(x, offsets, ts, num_targets), atol=1e-5)


def test_item_features_from_events_takes_the_last_event():
    from genrec.models.serving.artifact import item_features_from_events

    got = item_features_from_events(torch.tensor([7, 5, 9]), torch.tensor([7, 5, 7, 11]),
                                    {"advertiser_id": torch.tensor([2, 3, 4, 8])})
    assert got["advertiser_id"].tolist() == [4, 3, -1]


def test_tiered_store_rows_and_unseen_ids_match_the_store(tmp_path):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from genrec.data.config import FeatureSpec
    from genrec.dense.config import TowerConfig
    from genrec.dense.tower import build_tower
    from genrec.models.serving.artifact import item_features_from_events
    from genrec.models.model import GenerativeRecommender, ModelConfig
    from genrec.sparse.config import SparseConfig, TableConfig
    from genrec.sparse.module import TieredEmbeddingCollection

    D = 8
    spec = FeatureSpec(sparse=["item_id", "action", "advertiser_id"], labels=["click"])
    store = TieredEmbeddingCollection(SparseConfig(tables=[
        TableConfig(name="items", embedding_dim=D, feature_names=["item_id"]),
        TableConfig(name="misc", embedding_dim=D, feature_names=["action", "advertiser_id"])]))
    tower = build_tower(TowerConfig(embedding_dim=D, num_heads=1, attention_dim=4, linear_dim=4, max_seq_len=32))
    model = GenerativeRecommender(features=spec, cfg=ModelConfig(ranking=True, ranking_tasks=["click"], task_weights=[1.0]),
                                  embeddings=store, feature_dims={f: D for f in spec.sparse}, tower=tower, dim=D)
    gen = torch.Generator().manual_seed(0)
    items = torch.randint(1 << 40, (50,), generator=gen)  # raw ids from an unbounded space
    adv = torch.randint(1 << 30, (50,), generator=gen)
    model.train()
    store(KeyedJaggedTensor(keys=spec.sparse, values=torch.cat([items, torch.randint(3, (50,), generator=gen), adv]),
                            lengths=torch.tensor([50, 50, 50])))  # admits the rows
    model.eval()
    feats = item_features_from_events(items.unique(), items, {"advertiser_id": adv})
    art = export_artifact(model, {}, tmp_path / "a", dtype="fp32", item_ids=items.unique(), item_features=feats,
                          version="v", export_program=False)
    contents = load_artifact_contents(art)
    assert contents.tables["items"].ids_N.numel() == items.unique().numel()
    probe = torch.cat([items[:10], torch.tensor([12345, 1 << 41])])  # seen, then never seen
    want = store(KeyedJaggedTensor(keys=["item_id"], values=probe, lengths=torch.tensor([len(probe)])))["item_id"].values()
    got = contents.tables["items"].lookup(probe)
    assert torch.equal(got, want)
    assert not got[-2:].any()  # the store's default_row="zeros"


class _Payload:
    """Unpickling this creates the marker file: proof that code from the artifact ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _craft_program(art: Path, marker: Path) -> None:
    """Replace tower.pt2's sample inputs (which torch.export.load unpickles, falling back to
    weights_only=False) by a payload, and update the manifest's checksum to match."""
    program = art / "tower.pt2"
    payload = io.BytesIO()
    torch.save(_Payload(marker), payload)
    crafted = io.BytesIO()
    with zipfile.ZipFile(program) as src, zipfile.ZipFile(crafted, "w") as dst:
        for info in src.infolist():
            data = payload.getvalue() if info.filename.endswith("sample_inputs/model.pt") else src.read(info)
            dst.writestr(info.filename, data)
    assert any(n.endswith("sample_inputs/model.pt") for n in zipfile.ZipFile(crafted).namelist())
    program.write_bytes(crafted.getvalue())
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"]["tower.pt2"] = {"sha256": hashlib.sha256(crafted.getvalue()).hexdigest(),
                                      "bytes": len(crafted.getvalue())}
    (art / "manifest.json").write_text(json.dumps(manifest))


def test_a_crafted_program_file_never_runs(program_artifact, tmp_path):
    import shutil

    _, art = program_artifact
    crafted = tmp_path / "crafted"
    shutil.copytree(art, crafted)
    marker = tmp_path / "code-ran"
    _craft_program(crafted, marker)
    # The payload is live: whatever unpickles the file's sample inputs runs it.
    with zipfile.ZipFile(crafted / "tower.pt2") as z:
        name = next(n for n in z.namelist() if n.endswith("sample_inputs/model.pt"))
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(z.read(name)), weights_only=True)
    assert not marker.exists()
    # Every public loader of the artifact and ranker modules, on the crafted artifact.
    loaders = [getattr(mod, name) for mod in (artifact_module, ranker_module) for name in dir(mod)
               if re.match(r"(load|read|verify)_", name) and callable(getattr(mod, name))
               and getattr(getattr(mod, name), "__module__", "") == mod.__name__]
    assert {f.__name__ for f in loaders} >= {"load_artifact", "load_artifact_contents", "verify_artifact"}
    for load in loaders:
        try:
            load(crafted)
        except Exception:  # noqa: BLE001 (refusing is fine, however; running the payload is not)
            pass
        assert not marker.exists(), f"{load.__module__}.{load.__name__} ran code from the artifact"
    ranker = ranker_module.load_artifact(crafted)  # the artifact still serves: the program is never read
    assert ranker.version == "v"


UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
UNPICKLING_CALLS = {"torch.export.load", "torch.jit.load", "torch.package.PackageImporter", "yaml.load",
                    "yaml.unsafe_load", "torch._C._pickle_load_obj"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _unpickling_calls(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [(node.lineno, f"import {n}") for n in names if n.split(".")[0] in UNPICKLING_MODULES]
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        keywords = {k.arg: k.value for k in node.keywords}
        weights_only = keywords.get("weights_only")
        if name in UNPICKLING_CALLS:
            found.append((node.lineno, name))
        elif name == "torch.load" and not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
            found.append((node.lineno, "torch.load without weights_only=True"))
        elif isinstance(weights_only, ast.Constant) and weights_only.value is False:
            found.append((node.lineno, f"{name}(weights_only=False)"))
        elif name.endswith(".load") and isinstance(keywords.get("allow_pickle"), ast.Constant) \
                and keywords["allow_pickle"].value is True:
            found.append((node.lineno, f"{name}(allow_pickle=True)"))
    return found


def test_the_package_has_no_unpickling_call():
    offenders = []
    for folder in ("data", "sparse", "dense", "models", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for lineno, what in _unpickling_calls(ast.parse(path.read_text(), str(path))):
                offenders.append(f"{path.relative_to(REPO)}:{lineno}: {what}")
    assert not offenders, "\n".join(offenders)


def test_the_unpickling_scan_catches_what_it_should():
    src = ("import pickle\nfrom dill import loads\ntorch.export.load(p)\ntorch.load(p)\n"
           "torch.load(p, weights_only=False)\nnp.load(p, allow_pickle=True)\ntorch.load(p, weights_only=True)\n")
    assert [line for line, _ in _unpickling_calls(ast.parse(src))] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_table_with_no_rows_reads_the_default_row(tmp_path, dtype):
    """A feature none of whose ids the tiered store admitted exports as an empty table; its
    lookups read the default row (zeros), as the store's do, instead of failing every request."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from genrec.data.config import FeatureSpec
    from genrec.dense.config import TowerConfig
    from genrec.dense.tower import build_tower
    from genrec.models.model import GenerativeRecommender, ModelConfig
    from genrec.sparse.config import SparseConfig, TableConfig
    from genrec.sparse.module import TieredEmbeddingCollection

    D = 8
    spec = FeatureSpec(sparse=["item_id", "action", "advertiser_id"], labels=["click"])
    store = TieredEmbeddingCollection(SparseConfig(tables=[
        TableConfig(name="items", embedding_dim=D, feature_names=["item_id"]),
        TableConfig(name="actions", embedding_dim=D, feature_names=["action"]),
        TableConfig(name="advertisers", embedding_dim=D, feature_names=["advertiser_id"])]))
    tower = build_tower(TowerConfig(embedding_dim=D, num_heads=1, attention_dim=4, linear_dim=4, max_seq_len=32))
    model = GenerativeRecommender(features=spec, cfg=ModelConfig(ranking=True, ranking_tasks=["click"], task_weights=[1.0]),
                                  embeddings=store, feature_dims={f: D for f in spec.sparse}, tower=tower, dim=D)
    gen = torch.Generator().manual_seed(0)
    items = torch.randint(1000, (50,), generator=gen)
    model.train()
    store(KeyedJaggedTensor(keys=spec.sparse, values=torch.cat([items, torch.randint(3, (50,), generator=gen)]),
                            lengths=torch.tensor([50, 50, 0])))  # no advertiser id admitted
    model.eval()
    corpus = items.unique()
    art = export_artifact(model, {}, tmp_path / "a", dtype=dtype, item_ids=corpus, version="v", export_program=False,
                          item_features={"advertiser_id": torch.full((corpus.numel(),), 7)})
    table = load_artifact_contents(art).tables["advertisers"]
    assert table.ids_N.numel() == 0
    assert torch.equal(table.lookup(torch.tensor([7, 12345])), torch.zeros(2, D))
    out = ranker_module.load_artifact(art).rank({"item_ids": items[:3].tolist(), "actions": [0, 1, 0],
                                                 "timestamps": [1, 2, 3], "k": 5, "n": 3})
    assert len(out["items"]) == 3


def test_a_table_narrower_than_its_features_dimension_is_refused_at_load(model_and_items, tmp_path):
    """A table (and its manifest entry) of another width than `feature_dims` says loaded and
    then failed every request (500s; a reload to it answered 200)."""
    art = _export(model_and_items, tmp_path / "a")
    rewrite_tensors(art, "tables/t_category_id.safetensors", lambda t: {**t, "rows": t["rows"][:, :8]})
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["tables"]["t_category_id"]["embedding_dim"] = 8
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="tables/t_category_id.safetensors"):
        ranker_module.load_artifact(art)


def test_an_artifact_replaced_while_it_loads_is_refused(model_and_items, tmp_path, monkeypatch):
    """`genrec export --overwrite` renames a new artifact over the served one. A load that
    has verified the old manifest must not then read the new files under it: another model
    would serve under the old version and fingerprint (and take the old one's deltas)."""
    served = _export(model_and_items, tmp_path / "served")
    other = build_synthetic_model(num_items=300, dim=16, max_seq_len=64, seed=1)
    verify = artifact_module.verify_artifact

    def verified_then_replaced(root):
        manifest = verify(root)
        _export(other, served, overwrite=True)  # published between the checksums and the reads
        return manifest

    monkeypatch.setattr(artifact_module, "verify_artifact", verified_then_replaced)
    with pytest.raises(ValueError, match="replaced while it was read"):
        ranker_module.load_artifact(served)
    monkeypatch.setattr(artifact_module, "verify_artifact", verify)
    assert ranker_module.load_artifact(served).version == "v-test"  # loaded again: one artifact, whole
