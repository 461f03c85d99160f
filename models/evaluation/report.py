"""Evaluation report writer: report.json (flat keys), report.md (tables) and PNG plots.

The input is a nested dict, mostly the `compute()` outputs of `genrec.models.evaluation.metrics`:

    {
      "name": "hstu-ml100k",                                   # optional, shown in report.md
      "retrieval": {"count": 943, "hr@10": 0.21, "ndcg@10": 0.11, ..., "mrr": 0.09},
      "ranking": {"click": {"auc": 0.71, "gauc": 0.66, "ne": 0.93, "reliability": [...], ...}},
      "slices": {"retrieval": {"history_length": {"0-4": {"count": 12, "hr@10": ...,
                                                          "ci": {"hr@10": {"low": ..., "high": ...}}}, ...},
                               "item_popularity": {"head": {...}, "torso": {...}, "tail": {...}}},
                 "ranking": {"user_type": {"new": {"click": {...}}, "returning": {...}}}},
      "ci": {"retrieval.hr@10": {"estimate": 0.21, "low": 0.19, "high": 0.23, ...}},
      "baselines": {"popularity": {"retrieval": {...}, "ranking": {...}, "slices": {...}}},
      "comparisons": {"popularity": {"retrieval.hr@10": {"diff": 0.05, "low": ..., "high": ...,
                                                         "p_value": 0.001}}},
      "config": {...}, "data_manifest_checksums": {"train.parquet": "sha256:..."},
      "versions": collect_versions(),
    }

report.json holds every figure under a stable flat key, the nested dicts joined by dots and
lists by index (`retrieval.hr@10`, `ranking.click.auc`, `ranking.click.reliability.3.observed`,
`slices.retrieval.history_length.5-19.hr@10`, `baselines.popularity.retrieval.mrr`,
`ci.retrieval.hr@10.low`), next to the three run-description keys `config`,
`data_manifest_checksums` and `versions`, which stay nested. Undefined figures are null.

report.md shows a p-value at the bootstrap's floor (no resample as extreme as the observed
difference) as `< 1/num_resamples` (`< 0.001` for 1,000 resamples). Slice plots draw a
slice's `ci` as error bars and leave empty buckets as gaps.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from genrec.data.files import claim_output_dir, publish_dir, staging_dir

REPORT_FILE = "report.json"
REPORT_FORMAT = "genrec.report/1"
"""report.json's `format`; with its `files` (the folder's other files), what makes a folder
one that a new report may replace."""

META_KEYS = ("config", "data_manifest_checksums", "versions")
"""Keys every report carries, kept nested in report.json."""

DEFAULT_SLICE_PLOTS = ("history_length", "item_popularity")
"""Slice columns plotted by default when the report has them."""

_SLICE_TABLE_SKIP = ("reliability", "positives", "base_rate", "mean_pred", "gauc_users", "gauc_skipped_users")
"""Per-slice figures left out of the markdown tables (they stay in report.json)."""


def collect_versions() -> dict[str, str]:
    """Versions of the interpreter and the packages that decide the numbers."""
    out = {"python": sys.version.split()[0]}
    for package in ("genrec", "torch", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu", "numpy", "torchmetrics"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return out


def _scalar(value: Any, key: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        value = value.item()  # numpy scalars, 0-d arrays and tensors
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise ValueError(f"report key '{key}': {type(value).__name__} is not a number, string, bool or None")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts / lists -> {"a.b.0.c": scalar}; NaN and inf become None."""
    if isinstance(tree, Mapping):
        items = [(str(k), v) for k, v in tree.items()]
    elif isinstance(tree, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(tree)]
    else:
        return {prefix: _scalar(tree, prefix)}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def _plain(tree: Any, key: str) -> Any:
    """JSON-safe copy of a meta value (numpy scalars to Python, NaN to None)."""
    if isinstance(tree, Mapping):
        return {str(k): _plain(v, f"{key}.{k}") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_plain(v, f"{key}.{i}") for i, v in enumerate(tree)]
    return _scalar(tree, key)


def report_json(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report.json object: flat figures plus the nested meta keys."""
    missing = [k for k in META_KEYS if k not in report]
    if missing:
        raise ValueError(f"report is missing {missing} (every report records {list(META_KEYS)})")
    out = flatten({k: v for k, v in report.items() if k not in META_KEYS})
    for key in META_KEYS:
        out[key] = _plain(report[key], key)
    return out


# --------------------------------------------------------------------------- markdown


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def _fmt_p(p_value: float | None, num_resamples: int | None) -> str:
    """A bootstrap p-value; at its floor (no resample as extreme as the observed difference:
    1 / (num_resamples + 1)) it reads `< 1/num_resamples`, e.g. `< 0.001` for 1,000."""
    if p_value is None:
        return "—"
    if num_resamples and p_value <= 1.0 / (num_resamples + 1) * (1 + 1e-9):
        return f"< {1.0 / num_resamples:.3g}"
    return f"{p_value:.3f}" if p_value >= 1e-3 else f"{p_value:.1e}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(v) if not isinstance(v, str) else v for v in row) + " |" for row in rows]
    return lines + [""]


def _headline(section: Mapping[str, Any]) -> dict[str, Any]:
    """Flat retrieval.* / ranking.* figures without the per-bin reliability curve."""
    flat = flatten({k: section[k] for k in ("retrieval", "ranking") if k in section})
    return {k: v for k, v in flat.items() if ".reliability." not in k}


def _markdown(report: Mapping[str, Any], plot_files: Sequence[str]) -> str:
    name = report.get("name", "model")
    baselines: Mapping[str, Any] = report.get("baselines", {})
    ci: Mapping[str, Any] = report.get("ci", {})
    lines = [f"# Evaluation report: {name}", ""]

    model = _headline(report)
    base_flat = {b: _headline(v) for b, v in baselines.items()}
    if model:
        lines += ["## Model vs baselines", ""]
        level = next((int(round(100 * c["confidence"])) for c in ci.values() if c.get("confidence")), 95)
        header = ["metric", str(name), f"{level}% CI", *baselines]
        rows = []
        for key, value in model.items():
            c = ci.get(key)
            interval = f"[{_fmt(c['low'])}, {_fmt(c['high'])}]" if c else "—"
            rows.append([key, value, interval, *(base_flat[b].get(key) for b in baselines)])
        lines += _table(header, rows)

    for baseline, comparison in report.get("comparisons", {}).items():
        title = baseline if " minus " in baseline else f"{name} minus {baseline}"  # several runs: named in full
        lines += [f"## {title} (paired bootstrap over users)", ""]
        rows = [[key, c.get("diff"), f"[{_fmt(c.get('low'))}, {_fmt(c.get('high'))}]",
                 _fmt_p(c.get("p_value"), c.get("num_resamples"))] for key, c in comparison.items()]
        lines += _table(["metric", "difference", "CI", "p-value"], rows)

    for model_name, model_report in _models(report):
        for section, columns in model_report.get("slices", {}).items():
            lines += _slice_tables(model_name, section, columns)

    if plot_files:
        lines += ["## Plots", ""] + [f"![{Path(f).stem}]({f})" for f in plot_files] + [""]

    lines += ["## Run", "", "Data manifest checksums:", ""]
    lines += _table(["file", "checksum"], [[str(k), str(v)] for k, v in report["data_manifest_checksums"].items()])
    lines += ["Versions:", ""]
    lines += _table(["package", "version"], [[str(k), str(v)] for k, v in report["versions"].items()])
    lines += ["Config:", "", "```json", json.dumps(_plain(report["config"], "config"), indent=2, sort_keys=True),
              "```", ""]
    return "\n".join(lines)


def _slice_tables(model_name: str, section: str, columns: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    for column, values in columns.items():
        lines += [f"## Slices ({model_name}): {section} by {column}", ""]
        flat = {value: {k: v for k, v in flatten(m).items()
                        if not k.startswith("ci.") and not any(s in k for s in _SLICE_TABLE_SKIP)}
                for value, m in values.items()}
        keys: list[str] = []
        for m in flat.values():
            keys += [k for k in m if k not in keys]
        lines += _table([column, *keys], [[str(value), *(m.get(k) for k in keys)] for value, m in flat.items()])
    return lines


# --------------------------------------------------------------------------- plots


def _models(report: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    return [(str(report.get("name", "model")), report), *report.get("baselines", {}).items()]


def _slice_metric(values: Mapping[str, Any]) -> str | None:
    """The figure a slice plot shows: NDCG@10-like retrieval metric first, else a task's AUC."""
    for m in values.values():
        flat = flatten(m)
        for preferred in ("ndcg@10", "hr@10"):
            if preferred in flat:
                return preferred
        for key in flat:
            if key.endswith(".auc") or key.startswith("ndcg@") or key == "mrr":
                return key
    return None


def _slice_series(report: Mapping[str, Any], section: str, column: str, labels: list[str], metric: str,
                  count_key: str):
    """(model name, values, (errors below, errors above)) per model that has this slice; an
    empty bucket (count 0) or an undefined figure is NaN, a bucket without a CI has no bar."""
    out = []
    for name, m in _models(report):
        vals = m.get("slices", {}).get(section, {}).get(column)
        if not vals:
            continue
        ys, below, above = [], [], []
        for label in labels:
            flat = flatten(vals.get(label, {}))
            y = None if flat.get(count_key) == 0 else flat.get(metric)
            low, high = flat.get(f"ci.{metric}.low"), flat.get(f"ci.{metric}.high")
            ys.append(math.nan if y is None else y)
            have_ci = y is not None and low is not None and high is not None
            below.append(max(0.0, y - low) if have_ci else math.nan)
            above.append(max(0.0, high - y) if have_ci else math.nan)
        out.append((name, ys, (below, above)))
    return out


def slice_figure(report: Mapping[str, Any], column: str):
    """The bar chart of one slice column: the slice metric per bucket and model, with the
    bootstrap CI as error bars; empty buckets are gaps (NaN), never bars of height 0."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    section = next((s for s, cols in report.get("slices", {}).items() if column in cols), None)
    if section is None:
        raise ValueError(f"plots: no slice column '{column}' in report['slices']")
    values = report["slices"][section][column]
    metric = _slice_metric(values)
    if metric is None:
        raise ValueError(f"plots: slice column '{column}' has no plottable metric")
    labels = list(values)
    fig = Figure(figsize=(max(5.0, 1.1 * len(labels) + 2), 3.6))
    FigureCanvasAgg(fig)  # Agg: files only, no display and no pyplot global state
    ax = fig.add_subplot()
    # Retrieval slices carry "count"; ranking slices carry one per task ("click.count").
    count_key = "count" if "." not in metric else f"{metric.split('.')[0]}.count"
    series = _slice_series(report, section, column, labels, metric, count_key)
    width = 0.8 / len(series)
    for i, (name, ys, errors) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        has_ci = any(not math.isnan(e) for e in errors[0])
        ax.bar(xs, ys, width=width, label=name, yerr=[errors[0], errors[1]] if has_ci else None, capsize=3)
    counts = [flatten(values[label]).get(count_key) for label in labels]
    ax.set_xticks(range(len(labels)), [f"{label}\n(n={c})" for label, c in zip(labels, counts)])
    ax.set_xlabel(column)
    ax.set_ylabel(metric or "")
    confidence = next((c for c in (flatten(v).get(f"ci.{metric}.confidence") for v in values.values()) if c), None)
    bars = f" (bars: {round(100 * confidence)}% CI)" if confidence else ""
    ax.set_title(f"{section} {metric} by {column}{bars}")
    ax.legend()
    fig.tight_layout()
    return fig


def _plot_slice(path: Path, report: Mapping[str, Any], column: str) -> None:
    slice_figure(report, column).savefig(path, dpi=100)


def _plot_calibration(path: Path, report: Mapping[str, Any]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = list(report.get("ranking", {}))
    if not tasks:
        raise ValueError("plots: 'calibration' needs report['ranking']")
    fig = Figure(figsize=(4.2 * len(tasks), 4.0))
    FigureCanvasAgg(fig)
    for i, task in enumerate(tasks):
        ax = fig.add_subplot(1, len(tasks), i + 1)
        ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect")
        for name, m in _models(report):
            bins = [b for b in m.get("ranking", {}).get(task, {}).get("reliability", []) if b.get("count")]
            if bins:
                ax.plot([b["mean_pred"] for b in bins], [b["observed"] for b in bins], marker="o", label=name)
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("mean predicted probability")
        ax.set_ylabel("observed rate")
        ax.set_title(f"{task} calibration")
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _plot_names(report: Mapping[str, Any], plots: bool | Sequence[str]) -> list[str]:
    if plots is False:
        return []
    if plots is True:
        slice_columns = {c for cols in report.get("slices", {}).values() for c in cols}
        return (["calibration"] if report.get("ranking") else []) + [
            c for c in DEFAULT_SLICE_PLOTS if c in slice_columns]
    return list(plots)


# --------------------------------------------------------------------------- writer


def claim_report_dir(out_dir: str | os.PathLike) -> Path:
    """`out_dir` if a report may be written there: missing, empty, or an earlier report
    whose files are all its own (it is then replaced); anything else is refused, before any
    work starts, since replacing it would delete what genrec did not write."""
    return claim_output_dir(out_dir, overwrite=True, manifest=REPORT_FILE, format=REPORT_FORMAT)


def write_report(out_dir: str | os.PathLike, report: Mapping[str, Any], plots: bool | Sequence[str] = True) -> Path:
    """Write report.json, report.md and PNG plots into `out_dir`, atomically: everything goes
    into a temporary sibling folder first, which replaces `out_dir` only once complete, so an
    error leaves either the previous report or none, never a partial one.

    `plots`: True for the defaults the data supports (calibration when there is ranking, and
    history_length / item_popularity slices when present), False for none, or a list of names:
    "calibration" or any slice column (e.g. a declared categorical column).
    """
    out_dir = claim_report_dir(out_dir)
    body = report_json(report)
    tmp = staging_dir(out_dir)
    try:
        plot_files = []
        for name in _plot_names(report, plots):
            file = f"{name}.png"
            if name == "calibration":
                _plot_calibration(tmp / file, report)
            else:
                _plot_slice(tmp / file, report, name)
            plot_files.append(file)
        (tmp / "report.md").write_text(_markdown(report, plot_files))
        body = {"format": REPORT_FORMAT, "files": sorted(["report.md", *plot_files]), **body}
        (tmp / REPORT_FILE).write_text(json.dumps(body, indent=2, allow_nan=False) + "\n")
        publish_dir(tmp, out_dir, manifest=REPORT_FILE, format=REPORT_FORMAT)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
