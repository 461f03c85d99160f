"""`genrec eval` on a tiny trained model: report keys and plots, retrieval equal to a brute-force
recomputation from the model's embeddings, determinism, self-comparison, bad inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from genrec.data.prepare import prepare
from genrec.data.synth import synthesize
from train_helpers import FEATURES, tiny_config

@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(run dir, prepared data dir) of a model trained for a few steps."""
    from genrec.models.train.trainer import run_training

    root = tmp_path_factory.mktemp("evalrun")
    synthesize(root / "logs", num_users=80, num_items=200, num_events=4000, seed=5, progress=False)
    cfg = tiny_config(root / "data", root / "run", checkpoint_every=6)
    prepare(root / "logs", root / "data", cfg.data.features, cfg.data.prepare.split, num_shards=2,
            row_group_users=16, progress=False)
    run_training(cfg)
    return root / "run", root / "data"


def _evaluate(run: Path, data: Path, out: Path, **kwargs) -> dict:
    from genrec.models.evaluation.evaluate import run_evaluation

    kwargs.setdefault("num_resamples", 200)
    out_dir = run_evaluation(run, data, "test", out_dir=out, progress=False, **kwargs)
    assert out_dir == out
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def report(trained, tmp_path_factory) -> tuple[dict, Path]:
    run, data = trained
    out = tmp_path_factory.mktemp("report") / "eval"
    return _evaluate(run, data, out), out


def test_report_has_headline_keys_baseline_slices_and_plots(report):
    got, out = report
    for key in ("retrieval.hr@10", "retrieval.ndcg@10", "retrieval.hr@50", "retrieval.ndcg@200", "retrieval.mrr",
                "ranking.click.auc", "ranking.click.gauc", "ranking.click.ne", "ranking.click.logloss",
                "ranking.click.calibration", "ranking.conversion.auc", "ranking.click.reliability.0.count",
                "ci.retrieval.hr@10.low", "ci.ranking.click.gauc.high", "baselines.popularity.retrieval.mrr",
                "baselines.popularity.ranking.click.auc", "comparisons.popularity.retrieval.ndcg@10.p_value",
                "slices.retrieval.user_type.new.count", "slices.retrieval.history_length.20-49.hr@10",
                "slices.retrieval.item_popularity.tail.count", "slices.ranking.user_type.returning.click.auc"):
        assert key in got, key
    num_users = got["retrieval.count"]
    assert num_users == got["config"]["eval"]["num_users"] > 0
    for column in ("user_type", "history_length", "item_popularity", "category_id"):
        assert sum(got[k] for k in got if k.startswith(f"slices.retrieval.{column}.") and k.endswith(".count")) \
            == num_users, column
    # The leave-one-out test split scores its two held-out events per user, so GAUC exists.
    assert got["ranking.click.count"] == 2 * num_users
    assert got["ranking.click.gauc"] is not None and got["ranking.click.gauc_users"] > 0
    assert 0.0 <= got["retrieval.hr@10"] <= got["retrieval.hr@50"] <= got["retrieval.hr@200"] <= 1.0
    assert got["ci.retrieval.mrr.low"] <= got["retrieval.mrr"] <= got["ci.retrieval.mrr.high"]
    assert got["data_manifest_checksums"]["manifest.json"].startswith("sha256:")
    assert any(k.startswith("test/") for k in got["data_manifest_checksums"])
    assert got["config"]["run"]["model"]["ranking"] is True and "torch" in got["versions"]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["calibration.png", "category_id.png", "history_length.png", "item_popularity.png",
                     "report.json", "report.md"]
    md = (out / "report.md").read_text()
    assert "| metric | run | 95% CI | popularity | ad rate | oracle |" in md and "## run minus popularity" in md


def _column(split_dir: Path, name: str) -> list[list]:
    return [v for part in sorted(split_dir.glob("*.parquet")) for v in pq.read_table(part).column(name).to_pylist()]


def test_click_baselines_score_the_models_candidates_by_ad_rate_and_planted_truth(trained, report, tmp_path):
    """The ad-rate and oracle rows score exactly the candidates the model is scored on (each
    test row's last two events): recomputed here from the train split and the synth log."""
    from genrec.data.synth import click_auc

    got, _ = report
    run, data = trained
    logs = data.parent / "logs"
    truth = {}
    for part in sorted(logs.glob("*.parquet")):
        t = pq.read_table(part, columns=["user_id", "ts", "item_id", "p_click"]).to_pydict()
        truth.update(zip(zip(t["user_id"], t["ts"], t["item_id"]), t["p_click"]))
    impressions, clicks = {}, {}
    for items, labels in zip(_column(data / "train", "item_id"), _column(data / "train", "click")):
        for item, label in zip(items, labels):
            impressions[item] = impressions.get(item, 0) + 1
            clicks[item] = clicks.get(item, 0) + label
    mean = sum(clicks.values()) / sum(impressions.values())
    oracle, rate, labels = [], [], []
    test = {c: _column(data / "test", c) for c in ("user_id", "ts", "item_id", "click")}
    for user, ts, items, click in zip(test["user_id"], test["ts"], test["item_id"], test["click"]):
        for j in (-2, -1):
            oracle.append(truth[user, ts[j], items[j]])
            rate.append((clicks.get(items[j], 0) + 20 * mean) / (impressions.get(items[j], 0) + 20))
            labels.append(click[j])
    assert got["baselines.oracle.ranking.click.count"] == got["ranking.click.count"] == len(labels)
    assert got["baselines.oracle.ranking.click.auc"] == pytest.approx(click_auc(np.array(oracle), np.array(labels)))
    assert got["baselines.ad rate.ranking.click.auc"] == pytest.approx(click_auc(np.array(rate), np.array(labels)))
    assert got["baselines.ad rate.ranking.click.logloss"] is not None  # a probability: its log loss means something

    # The same events logged without the truth columns: no oracle row, everything else the same.
    synthesize(tmp_path / "logs", num_users=80, num_items=200, num_events=4000, seed=5, progress=False,
               emit_truth=False)
    cfg = tiny_config(tmp_path / "data", tmp_path / "run")
    prepare(tmp_path / "logs", tmp_path / "data", cfg.data.features, cfg.data.prepare.split, num_shards=2,
            row_group_users=16, progress=False)
    plain = _evaluate(run, tmp_path / "data", tmp_path / "eval")
    assert not any(k.startswith("baselines.oracle.") for k in plain)
    assert plain["baselines.ad rate.ranking.click.auc"] == got["baselines.ad rate.ranking.click.auc"]
    assert plain["ranking.click.auc"] == got["ranking.click.auc"]


def test_oracle_needs_integer_ids_in_the_log(tmp_path):
    """A log with the truth column but string item ids (prepare hashes them): no oracle row,
    rather than an error that stops the whole evaluation."""
    from genrec.models.evaluation.baselines import OracleScorer

    path = tmp_path / "log.parquet"
    pq.write_table(pa.table({"user_id": [1, 1], "ts": [10, 20], "item_id": ["ad-a", "ad-b"],
                             "p_click": pa.array([0.1, 0.2], pa.float32())}), path)
    manifest = {"sources": [{"path": str(path), "rows": 2}]}
    assert OracleScorer.from_prepared(manifest, "user_id", "ts", "item_id") is None
    pq.write_table(pa.table({"user_id": [1, 1], "ts": [10, 20], "item_id": [7, 8],
                             "p_click": pa.array([0.1, 0.2], pa.float32())}), path)
    oracle = OracleScorer.from_prepared(manifest, "user_id", "ts", "item_id")
    assert oracle.probs(torch.tensor([1]), torch.tensor([20]), torch.tensor([8])).tolist() == [[pytest.approx(0.2)]]


def test_popularity_has_no_probability_figures_and_slices_have_cis(report):
    got, out = report
    # Popularity's scores are an order: its AUC / GAUC stay, log loss / NE / calibration go,
    # from its column and from the comparison (where they would read as significant).
    for task in ("click", "conversion"):
        assert got[f"baselines.popularity.ranking.{task}.auc"] is not None
        assert f"comparisons.popularity.ranking.{task}.gauc.p_value" in got
        for figure in ("logloss", "ne", "calibration", "mean_pred", "reliability.0.count"):
            assert f"baselines.popularity.ranking.{task}.{figure}" not in got
            assert f"baselines.popularity.slices.ranking.user_type.returning.{task}.{figure}" not in got
        assert f"ranking.{task}.logloss" in got and f"comparisons.popularity.ranking.{task}.logloss.diff" not in got
    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| ranking.click.logloss |"))
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    assert cells[3] == "—" and cells[4] != "—", row  # popularity has no log loss, the ad rate has one
    section = md.split("## run minus popularity", 1)[1].split("\n## ", 1)[0]
    assert "logloss" not in section and "ranking.click.gauc" in section
    assert "e-0" not in section  # p-values at the bootstrap floor read "< 0.005" (200 resamples)
    # Every retrieval slice has a bootstrap interval around its figure (the plots' error bars).
    for bucket in ("0-4", "5-19", "20-49"):
        prefix = f"slices.retrieval.history_length.{bucket}."
        if got[prefix + "count"]:
            assert got[prefix + "ci.ndcg@10.low"] <= got[prefix + "ndcg@10"] <= got[prefix + "ci.ndcg@10.high"]


def _brute_force_ranks(run: Path, data: Path, users: int) -> dict[int, int]:
    """Each user's target rank from scratch: read the test rows with pyarrow, score every
    corpus item with the model's own embeddings, drop seen items, count items scoring >= the
    target. Shares no code with the evaluator beyond the model."""
    from genrec.data.batch import Batch
    from genrec.models.runs import load_trained
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    cfg, model = load_trained(run)
    corpus = model.item_corpus.tolist()
    item_emb = model.item_embeddings(model.item_corpus)
    table = pq.read_table(data / "test").to_pylist()
    table.sort(key=lambda r: r["user_id"])
    out = {}
    for row in table[:users]:
        hist = {k: row[k][:-1] for k in FEATURES}
        window = {k: v[-cfg.data.loader.max_seq_len:] for k, v in hist.items()}
        n = len(window["item_id"])
        batch = Batch(user_ids_B=torch.tensor([row["user_id"]]),
                      history=KeyedJaggedTensor(keys=FEATURES, values=torch.tensor(sum((window[k] for k in FEATURES), [])),
                                                lengths=torch.tensor([n] * len(FEATURES))),
                      timestamps_T=torch.tensor(row["ts"][:-1][-n:]), history_lengths_B=torch.tensor([n]))
        scores = (model.user_embeddings(batch) @ item_emb.T)[0].tolist()
        target = row["item_id"][-1]
        if target not in corpus:
            out[row["user_id"]] = len(corpus)
            continue
        t = scores[corpus.index(target)]
        seen = set(hist["item_id"]) - {target}
        out[row["user_id"]] = sum(1 for i, s in zip(corpus, scores) if i != target and i not in seen and s >= t)
    return out


def test_retrieval_equals_brute_force_over_model_embeddings(trained, tmp_path):
    from genrec.models.evaluation.evaluate import load_scored, _Rows, _score_retrieval
    from genrec.data.loader import LoaderConfig, make_loader
    from genrec.data.prepare import load_manifest
    from genrec.data.config import FeatureSpec

    run, data = trained
    expected = _brute_force_ranks(run, data, users=12)
    scored = load_scored(run, data)
    scored.item_corpus = scored.model.item_corpus
    scored.item_emb_ND = scored.model.item_embeddings(scored.item_corpus)
    spec = FeatureSpec(**load_manifest(data)["features"])
    loader = make_loader(data / "test", spec, LoaderConfig(batch_size=16, max_seq_len=2**31 - 1, mode="ranking",
                                                           num_candidates=2, shuffle=False))
    got = {}
    for batch in loader:
        ranks = _score_retrieval(scored, _Rows.from_batch(batch, spec.sparse, data / "test"))
        got.update(zip(batch.user_ids_B.tolist(), ranks.tolist()))
    assert {u: got[u] for u in expected} == expected
    # ... and the report's figures are the means of exactly these per-user ranks.
    rep = _evaluate(run, data, tmp_path / "eval", slice_columns=[])
    ranks = np.array(list(got.values()))
    assert rep["retrieval.count"] == len(ranks)
    assert rep["retrieval.hr@10"] == pytest.approx(float((ranks < 10).mean()))
    assert rep["retrieval.mrr"] == pytest.approx(float((1.0 / (ranks + 1)).mean()))
    assert rep["retrieval.ndcg@10"] == pytest.approx(float(np.where(ranks < 10, 1 / np.log2(ranks + 2), 0).mean()))


def test_deterministic_for_a_seed_and_self_comparison_is_zero(trained, report, tmp_path):
    run, data = trained
    first, _ = report
    second = _evaluate(run, data, tmp_path / "again", compare=run)
    figures = {k: v for k, v in first.items() if k not in ("config", "versions") and not k.startswith("comparisons.")}
    assert figures == {k: second[k] for k in figures}
    cmp = {k: v for k, v in second.items() if k.startswith("comparisons.run (compare).")}
    assert cmp and all(v == 0.0 for k, v in cmp.items() if k.endswith((".diff", ".low", ".high")))
    assert second["baselines.run (compare).retrieval.mrr"] == second["retrieval.mrr"]
    # A compared run in a folder named after a baseline keeps its own section.
    shutil.copytree(run, tmp_path / "oracle")
    named = _evaluate(run, data, tmp_path / "named", compare=tmp_path / "oracle")
    assert named["baselines.oracle (compare).retrieval.mrr"] == second["retrieval.mrr"]
    other_seed = _evaluate(run, data, tmp_path / "seed1", seed=1)
    assert other_seed["retrieval.mrr"] == first["retrieval.mrr"]
    assert other_seed["ci.retrieval.mrr.low"] != first["ci.retrieval.mrr.low"]


def test_several_runs_per_side_compare_per_pair_and_as_means(trained, report, tmp_path):
    from genrec.models.train.trainer import run_training

    run, data = trained
    first, _ = report
    seed1 = run.parent / "seed1"  # another run of the recipe
    cfg = tiny_config(data, seed1, checkpoint_every=6)
    cfg.train.seed = 1
    run_training(cfg)
    rep = _evaluate([run, seed1], data, tmp_path / "runs", compare=[seed1, run])
    assert rep["retrieval.mrr"] == first["retrieval.mrr"]  # the report's model is the first run
    pair_1, pair_2 = (f"comparisons.{a} minus {b}.retrieval.mrr.diff" for a, b in
                      (("run", "seed1 (compare)"), ("seed1", "run (4)")))
    assert rep[pair_1] == pytest.approx(first["retrieval.mrr"] - rep["baselines.seed1 (compare).retrieval.mrr"])
    assert rep[pair_1] != 0.0 and rep[pair_2] == pytest.approx(-rep[pair_1])
    # Both sides average the same two runs: their means agree for every user.
    means = {k: v for k, v in rep.items() if k.startswith("comparisons.mean of 2 runs minus mean of 2 compare runs.")}
    assert means and all(v == 0.0 for k, v in means.items() if k.endswith((".diff", ".low", ".high")))
    assert rep["config"]["eval"]["runs"] == [str(run), str(seed1)]
    # One run against two: each of them, and the mean of the two (the recipe's figure).
    one = _evaluate(run, data, tmp_path / "one", compare=[seed1, run])
    mean = "comparisons.mean of 1 run minus mean of 2 compare runs.retrieval.mrr.diff"
    assert one[mean] == pytest.approx(first["retrieval.mrr"] - (rep["baselines.seed1 (compare).retrieval.mrr"]
                                                                + first["retrieval.mrr"]) / 2)


def test_a_run_evaluated_on_other_data_than_it_trained_on_says_so(trained, tmp_path, capsys):
    """The report keeps the data.path the run trained on (its config holds the evaluated
    one), and a run trained on other prepared files is warned about; a copy of the same
    files is the same data."""
    run, data = trained
    cfg = tiny_config(data, run)
    other = tmp_path / "other"  # the same log prepared into one shard: other files
    prepare(run.parent / "logs", other, cfg.data.features, cfg.data.prepare.split, num_shards=1,
            row_group_users=16, progress=False)
    rep = _evaluate(run, other, tmp_path / "other-eval")
    assert rep["config"]["run"]["checkpoint"]["trained_on"] == str(data)
    assert rep["config"]["run"]["data"]["path"] == str(other)
    assert f"{run} trained on {data}, whose prepared files differ from those of {other}" in capsys.readouterr().err
    _evaluate(run, _copy_data(data, tmp_path / "copy"), tmp_path / "copy-eval")
    assert "trained on" not in capsys.readouterr().err


def _copy_data(data: Path, to: Path) -> Path:
    shutil.copytree(data, to)
    return to


def _rewrite_split(split_dir: Path, edit) -> None:
    for path in sorted(split_dir.glob("*.parquet")):
        table = pq.read_table(path)
        pq.write_table(edit(table), path)


def _bad_labels(table: pa.Table) -> pa.Table:
    clicks = table.column("click").to_pylist()
    clicks[0] = [2] * len(clicks[0])
    return table.set_column(table.schema.get_field_index("click"), "click", pa.array(clicks, pa.list_(pa.int8())))


@pytest.mark.parametrize("case", ["features", "empty", "labels", "nan"])
def test_bad_input_is_a_value_error_and_writes_no_report(trained, tmp_path, case, monkeypatch):
    from genrec.models.evaluation.evaluate import run_evaluation

    run, data = trained
    match = {"features": "feature spec does not match", "empty": "empty", "labels": "must be 0 or 1",
             "nan": "NaN"}[case]
    if case == "features":
        data = _copy_data(data, tmp_path / "data")
        manifest = json.loads((data / "manifest.json").read_text())
        manifest["features"]["sparse"] = [c for c in manifest["features"]["sparse"] if c != "advertiser_id"]
        (data / "manifest.json").write_text(json.dumps(manifest))
    elif case == "empty":
        data = _copy_data(data, tmp_path / "data")
        _rewrite_split(data / "test", lambda t: t.slice(0, 0))
    elif case == "labels":
        data = _copy_data(data, tmp_path / "data")
        _rewrite_split(data / "test", _bad_labels)
    else:
        from genrec.models.model import GenerativeRecommender

        real = GenerativeRecommender.user_embeddings

        def nan_user_embeddings(self, batch):
            out = real(self, batch)
            out[0, 0] = float("nan")
            return out

        monkeypatch.setattr(GenerativeRecommender, "user_embeddings", nan_user_embeddings)
    out = tmp_path / "eval"
    with pytest.raises(ValueError, match=match):
        run_evaluation(run, data, "test", out_dir=out, progress=False, num_resamples=10)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".eval")]


def test_exported_artifact_evaluates_like_its_checkpoint(trained, report, tmp_path):
    from genrec.models.serving.artifact import export_artifact, item_features_from_events
    from genrec.models.config_loader import to_dict
    from genrec.models.runs import load_trained

    run, data = trained
    cfg, model = load_trained(run)
    train = pq.read_table(data / "train", columns=["item_id", "advertiser_id", "category_id"])
    flat = {c: torch.from_numpy(np.concatenate(train.column(c).to_pylist()).astype(np.int64))
            for c in train.column_names}
    side = item_features_from_events(model.item_corpus, flat["item_id"],
                                     {f: flat[f] for f in ("advertiser_id", "category_id")})
    artifact = export_artifact(model, to_dict(cfg), tmp_path / "artifact", dtype="fp32", item_ids=model.item_corpus,
                               version="v1", item_features=side, export_program=False)
    got = _evaluate(artifact, data, tmp_path / "eval")
    want, _ = report
    assert got["retrieval.count"] == want["retrieval.count"]
    assert got["config"]["run"]["artifact"]["dtype"] == "fp32"
    # Ids the model never trained on read a zero row from the artifact but a fresh initial row
    # from the store, so the figures agree closely, not exactly.
    for key in ("retrieval.mrr", "retrieval.hr@50", "ranking.click.auc", "ranking.click.logloss"):
        assert got[key] == pytest.approx(want[key], abs=0.05), key
    assert "corpus" not in got["config"]["run"]  # the data's own corpus
    # An artifact whose item index is not this data's corpus is evaluated, with a warning
    # and the two corpora's sizes in the report.
    part = export_artifact(model, to_dict(cfg), tmp_path / "part", dtype="fp32", item_ids=model.item_corpus[::2],
                           version="v2", item_features={f: v[::2] for f, v in side.items()}, export_program=False)
    other = _evaluate(part, data, tmp_path / "eval-part")
    n = int(model.item_corpus.numel())
    assert other["config"]["run"]["corpus"] == {"artifact_items": (n + 1) // 2, "data_items": n,
                                                "shared": (n + 1) // 2}
