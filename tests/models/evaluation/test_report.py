"""Report writer: flat JSON keys, markdown tables, PNG plots, atomic replacement."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from genrec.models.evaluation.metrics import (
    RankingMetrics,
    RetrievalMetrics,
    bootstrap_ci,
    compare_models,
    headline_cis,
)
from genrec.models.evaluation.slices import (
    POPULARITY_VALUES,
    PopularityScorer,
    SlicedMetrics,
    bucket_labels,
    item_counts,
    length_buckets,
    popularity_buckets,
)
from genrec.models.evaluation.report import collect_versions, flatten, report_json, slice_figure, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _evaluate(scores_BN, targets_B, seen_BS, hist_B, pop_bucket_N):
    """What `genrec eval` does per model: ranks once, feed headline + slice accumulators."""
    ret = RetrievalMetrics(ks=(10, 50))
    sliced = SlicedMetrics(lambda: RetrievalMetrics(ks=(10, 50)), method="update_ranks",
                           columns={"history_length": bucket_labels((5, 20, 50, 200)),
                                    "item_popularity": POPULARITY_VALUES})
    for lo in range(0, len(targets_B), 32):
        s = slice(lo, lo + 32)
        ranks = ret.update(scores_BN[s], targets_B[s], seen_BS[s])
        sliced.update({"history_length": length_buckets(hist_B[s]),
                       "item_popularity": pop_bucket_N[targets_B[s].numpy()]}, ranks)
    return ret, sliced


def _with_cis(sliced: SlicedMetrics) -> dict:
    """`sliced.compute()` with each slice's bootstrap CIs, as `genrec eval` writes them."""
    out = sliced.compute()
    for column, values in out.items():
        for value, figures in values.items():
            per_user = sliced.accumulator(column, value).per_user()
            figures["ci"] = {m: bootstrap_ci(per_user[m], None, 100) for m in ("hr@10", "ndcg@10")}
    return out


def make_report() -> dict:
    """A small but complete report: model + popularity baseline, slices, CIs, comparison."""
    g = torch.Generator().manual_seed(0)
    num_users, num_items = 96, 120
    train_items = (torch.rand(2000, generator=g) ** 3 * num_items).long()  # skewed popularity
    counts = item_counts(train_items, num_items)
    targets = (torch.rand(num_users, generator=g) ** 3 * num_items).long()
    seen = torch.randint(-1, num_items, (num_users, 8), generator=g)
    hist = torch.randint(1, 60, (num_users,), generator=g)
    pop_bucket = popularity_buckets(counts)
    model_scores = torch.rand(num_users, num_items, generator=g)
    model_scores[torch.arange(num_users), targets] += 0.5  # a model that knows something
    ret, sliced = _evaluate(model_scores, targets, seen, hist, pop_bucket)
    pop_ret, pop_sliced = _evaluate(PopularityScorer(counts).scores(num_users), targets, seen, hist, pop_bucket)

    users = torch.randint(0, 40, (400,), generator=g)
    labels = (torch.rand(400, 2, generator=g) < 0.3).float()
    probs = 0.7 * torch.rand(400, 2, generator=g) + 0.3 * labels
    rank = RankingMetrics(tasks=["click", "conversion"])
    rank.update(users, probs, labels)
    return {
        "name": "hstu-tiny",
        "retrieval": ret.compute(),
        "ranking": rank.compute(),
        "slices": {"retrieval": _with_cis(sliced)},
        "ci": headline_cis(ret, rank, num_resamples=100),
        "baselines": {"popularity": {"retrieval": pop_ret.compute(), "slices": {"retrieval": _with_cis(pop_sliced)}}},
        "comparisons": {"popularity": compare_models(ret, pop_ret, num_resamples=100)},
        "config": {"eval": {"ks": [10, 50], "seed": 0}},
        "data_manifest_checksums": {"test.parquet": "sha256:abc"},
        "versions": collect_versions(),
    }


@pytest.fixture(scope="module")
def report():
    return make_report()


def test_report_json_has_stable_flat_keys(report, tmp_path):
    out = write_report(tmp_path / "eval", report)
    got = json.loads((out / "report.json").read_text())
    for key in ("retrieval.hr@10", "retrieval.ndcg@10", "retrieval.mrr", "retrieval.hr@50", "ranking.click.auc",
                "ranking.click.gauc", "ranking.click.ne", "ranking.conversion.calibration",
                "ranking.click.reliability.0.count", "slices.retrieval.history_length.5-19.hr@10",
                "slices.retrieval.item_popularity.head.count", "baselines.popularity.retrieval.mrr",
                "ci.retrieval.hr@10.low", "comparisons.popularity.retrieval.ndcg@10.p_value"):
        assert key in got, key
    assert got["retrieval.hr@10"] == report["retrieval"]["hr@10"]
    assert got["ranking.click.auc"] == report["ranking"]["click"]["auc"]
    # Nobody has a history of 200+: an empty slice is count 0 with null metrics.
    assert got["slices.retrieval.history_length.200+.count"] == 0
    assert got["slices.retrieval.history_length.200+.ndcg@10"] is None
    assert got["config"] == {"eval": {"ks": [10, 50], "seed": 0}}
    assert got["data_manifest_checksums"] == {"test.parquet": "sha256:abc"}
    assert got["versions"]["torch"].startswith("2.")
    nested = [k for k, v in got.items() if isinstance(v, (dict, list)) and k not in
              ("config", "data_manifest_checksums", "versions", "files")]
    assert nested == []
    assert got["format"] == "genrec.report/1"
    assert got["files"] == ["calibration.png", "history_length.png", "item_popularity.png", "report.md"]


def test_report_markdown_and_plots(report, tmp_path):
    out = write_report(tmp_path / "eval", report)
    assert sorted(p.name for p in out.iterdir()) == [
        "calibration.png", "history_length.png", "item_popularity.png", "report.json", "report.md"]
    for png in out.glob("*.png"):
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000
    md = (out / "report.md").read_text()
    assert "| metric | hstu-tiny | 95% CI | popularity |" in md
    row = next(line for line in md.splitlines() if line.startswith("| retrieval.hr@10 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1]) == pytest.approx(report["retrieval"]["hr@10"], abs=1e-4)
    assert cells[2].startswith("[") and float(cells[3]) == pytest.approx(
        report["baselines"]["popularity"]["retrieval"]["hr@10"], abs=1e-4)
    assert "## hstu-tiny minus popularity" in md
    assert "## Slices (hstu-tiny): retrieval by history_length" in md
    assert "## Slices (popularity): retrieval by item_popularity" in md
    assert "| 200+ | 0 | — |" in md
    assert "![calibration](calibration.png)" in md
    assert "sha256:abc" in md


def test_p_value_at_the_bootstrap_floor_reads_as_a_bound(report, tmp_path):
    comparison = report["comparisons"]["popularity"]
    # Where no resample is as extreme as the observed difference, p sits at 1 / (100 + 1).
    at_floor = [k for k, c in comparison.items() if c["p_value"] == pytest.approx(1 / 101)]
    assert at_floor, "the model is far ahead of popularity on some figure"
    md = (write_report(tmp_path / "eval", report, plots=False) / "report.md").read_text()
    section = md.split("## hstu-tiny minus popularity", 1)[1].split("\n## ", 1)[0]
    for key, c in comparison.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| {key} |"))
        p_cell = row.strip().strip("|").split("|")[-1].strip()
        if key in at_floor:
            assert p_cell == "< 0.01", row
        else:
            assert float(p_cell) == pytest.approx(c["p_value"], abs=5e-4), row
    assert "9.90e-03" not in md


def test_slice_plot_has_error_bars_and_leaves_empty_buckets_empty(report):
    fig = slice_figure(report, "history_length")
    ax = fig.axes[0]
    labels = list(report["slices"]["retrieval"]["history_length"])
    models = [report, report["baselines"]["popularity"]]
    bars = [c for c in ax.containers if hasattr(c, "errorbar")]
    assert len(bars) == len(models)
    for container, model in zip(bars, models):
        slices = model["slices"]["retrieval"]["history_length"]
        heights = [p.get_height() for p in container.patches]
        segments = container.errorbar.lines[2][0].get_segments()
        assert len(segments) == len(labels)
        for label, height, segment in zip(labels, heights, segments):
            figures = slices[label]
            if figures["count"] == 0:  # nobody has a history of 200+: a gap, not a bar at 0
                assert math.isnan(height) and np.isnan(segment).all(), label
            else:
                ci = figures["ci"]["ndcg@10"]
                assert height == pytest.approx(figures["ndcg@10"])
                assert sorted(segment[:, 1]) == pytest.approx([ci["low"], ci["high"]]), label
    assert labels[-1] == "200+" and report["slices"]["retrieval"]["history_length"]["200+"]["count"] == 0


def test_report_replaces_atomically_and_leaves_nothing_on_error(report, tmp_path):
    out = tmp_path / "eval"
    write_report(out, report)
    before = (out / "report.json").read_text()

    # Fails while the plots are drawn: the old report stays.
    with pytest.raises(ValueError, match="no slice column 'country'"):
        write_report(out, report, plots=["country"])
    assert (out / "report.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval"]  # no temp folder left behind

    with pytest.raises(ValueError, match="country"):
        write_report(tmp_path / "fresh", report, plots=["country"])
    assert not (tmp_path / "fresh").exists()

    changed = dict(report, name="other")
    write_report(out, changed, plots=False)
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]  # the old report's plots are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval"]


@pytest.mark.parametrize("foreign", ["notes.md", "src/main.py"])
def test_a_report_never_replaces_files_it_did_not_write(report, tmp_path, foreign):
    """A folder holding an earlier report plus a file of someone else's, or any JSON named
    report.json, is refused naming the file; nothing in it is touched."""
    out = tmp_path / "eval"
    write_report(out, report, plots=False)
    (out / foreign).parent.mkdir(exist_ok=True)
    (out / foreign).write_text("mine")
    with pytest.raises(ValueError, match=foreign.split("/")[0]):  # a folder of theirs is named whole
        write_report(out, report, plots=False)
    assert (out / foreign).read_text() == "mine"
    other = tmp_path / "other"
    other.mkdir()
    (other / "report.json").write_text('{"mine": true}')
    (other / foreign.split("/")[0]).write_text("mine")
    with pytest.raises(ValueError, match="not a genrec output of this kind"):
        write_report(other, report, plots=False)
    assert sorted(p.name for p in other.iterdir()) == sorted(["report.json", foreign.split("/")[0]])


def test_report_rejects_bad_input_naming_the_key(report, tmp_path):
    missing = {k: v for k, v in report.items() if k != "versions"}
    with pytest.raises(ValueError, match="versions"):
        write_report(tmp_path / "a", missing)
    with pytest.raises(ValueError, match="retrieval.note"):
        write_report(tmp_path / "b", dict(report, retrieval={"note": object()}))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        write_report(tmp_path / "file", report)


def test_flatten_scalars_nan_and_lists():
    flat = flatten({"a": {"b": np.float32(0.5), "c": [1, {"d": float("nan")}], "e": torch.tensor(3)},
                    "f": math.inf, "g": "x", "h": None, "i": np.int64(7), "j": True})
    assert flat == {"a.b": 0.5, "a.c.0": 1, "a.c.1.d": None, "a.e": 3, "f": None, "g": "x", "h": None, "i": 7,
                    "j": True}
    assert type(flat["i"]) is int
    meta = {"config": {"x": np.float64("nan")}, "data_manifest_checksums": {}, "versions": {}}
    assert report_json(meta)["config"] == {"x": None}
