"""Offline evaluation (`genrec eval`): one pass over a prepared evaluation split -> a report.

    run_evaluation("runs/ml100k", "data/ml100k", split="test", out_dir="runs/ml100k/eval",
                   compare="runs/sasrec")          # -> Path("runs/ml100k/eval")

What is measured, per model, on every evaluation row of the split (one row per user; the
row's last event is the held-out target, everything before it the user's history):

- Retrieval, full corpus: the target's rank among all items of the model's corpus (the
  prepared data's training items), the items of the user's *whole* history removed (not
  only the `data.loader.max_seq_len` window the model reads), pessimistic ties. A target
  that is not in the corpus is a miss at every K (its reciprocal rank 0). HR@K and NDCG@K
  for K in 10, 50, 200; MRR.
- Ranking (models with a ranking head): the row's last `ranking_candidates` events are
  scored as candidates after the history before them, under the target-aware mask as in
  training; AUC, GAUC, log loss, NE, calibration and a reliability curve per task. With one
  candidate per user (the held-out target) no user has two classes, so GAUC (a per-user AUC)
  is undefined; the default therefore scores the last two events on a leave-one-out test
  split, whose second-to-last event is the validation target, also never trained on.
- Slices of both: `user_type` (`new` = fewer than `new_user_events` events before the target,
  else `returning`), `history_length` (events before the target, bucketed at
  `HISTORY_EDGES`), `item_popularity` (the target's / candidate's train count: head, torso,
  tail by `popularity_buckets`; items outside the corpus are tail), and each column of
  `slice_columns` (a sparse feature such as category_id, the value on the target event).
- Baselines in the same table: most-popular items (the prepared data's train counts) for
  retrieval and, through its popularity order, ranking AUC / GAUC (its log loss, NE and
  calibration would mean nothing, so the report leaves them out, and their comparisons
  too). For the ranking tasks, on the same candidates: `ad rate` (each ad's label rates in
  the train split) and, when the source logs carry `genrec synth`'s planted `p_click`,
  `oracle` for the click task (`models/evaluation/baselines.py`). `compare` evaluates a
  second checkpoint on the same rows in the same order and adds a paired bootstrap of the
  differences. Several runs per side (seeds of two recipes) add each pair's comparison
  and that of the two recipes' per-user means over their runs.
- Bootstrap CIs (users resampled) of the headline figures, and of HR@10 / NDCG@10 in every
  retrieval slice (`slices.retrieval.<column>.<value>.ci.<metric>`), deterministic for `seed`.

Memory: one batch of rows at a time plus, per model, one rank per user and one
(user, probability, label) per ranking candidate.

Bad input (a checkpoint whose features are not in the data, an empty split, labels other
than 0 / 1, NaN scores) raises ValueError before the report is written: no report appears.

A checkpoint is a run directory or a step directory (`models.runs.load_trained`), or an
exported serving artifact (`models.serving.artifact`; its fp32 / fp16 / int8 tables are the rows).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
from tqdm import tqdm

from genrec.data.batch import Batch
from genrec.data.config import FeatureSpec
from genrec.data.loader import LoaderConfig, make_loader
from genrec.data.prepare import load_manifest
from genrec.models.evaluation.baselines import AD_RATE, ORACLE, ORACLE_TASK, AdRateScorer, OracleScorer
from genrec.models.evaluation.data_files import manifest_checksums, split_rows, trained_on_data
from genrec.models.evaluation.metrics import (
    MeanOfRuns,
    RankingMetrics,
    RetrievalMetrics,
    bootstrap_ci,
    compare_models,
    headline_cis,
)
from genrec.models.evaluation.slices import (
    POPULARITY_VALUES,
    USER_TYPE_VALUES,
    PopularityScorer,
    SlicedMetrics,
    bucket_labels,
    length_buckets,
    popularity_buckets,
)
from genrec.models.model import GenerativeRecommender, interleave_jagged
from genrec.models.evaluation.report import claim_report_dir, collect_versions, write_report
from genrec.models.build import load_item_corpus
from genrec.models.config import check_seed
from genrec.models.evaluation.validation import target_ranks
from genrec.models.ids import jagged_ranges, sorted_positions

EVAL_KS = (10, 50, 200)
"""Retrieval cutoffs."""
HISTORY_EDGES = (5, 20, 50, 200)
"""History-length bucket edges (events before the target)."""
NEW_USER_EVENTS = 5
"""Default: users with fewer events than this before the target are `new`."""
POPULARITY = "popularity"
"""Name of the most-popular baseline in the report."""
DEFAULT_SLICE_COLUMN = "category_id"
"""Sliced by default when the data has it."""
SLICE_CI_METRICS = ("hr@10", "ndcg@10")
"""Retrieval figures with a bootstrap CI in every slice (the slice plots' error bars)."""
NOT_FOR_ORDER_ONLY = ("logloss", "ne", "calibration", "mean_pred", "reliability")
"""Ranking figures left out for the popularity baseline: its scores are an order, not
probabilities, so only its AUC / GAUC mean something."""
TS = "ts"
"""Key of the timestamps in the jagged event dicts below (never a feature name: prepare
reserves it)."""


# --------------------------------------------------------------------------- models


@dataclass
class _Scored:
    """One model under evaluation and its accumulators."""

    name: str
    source: str
    model: GenerativeRecommender
    features: FeatureSpec
    tasks: list[str]
    """Ranking tasks (empty without a ranking head)."""
    window: int
    """History events the model reads (the most recent)."""
    max_tokens: int
    """The tower's max_seq_len: history + candidates must fit."""
    config: dict
    item_corpus: torch.Tensor = field(default=None)
    item_emb_ND: torch.Tensor = field(default=None)
    retrieval: RetrievalMetrics = field(default=None)
    retrieval_slices: SlicedMetrics = field(default=None)
    ranking: RankingMetrics | None = None
    ranking_slices: SlicedMetrics | None = None


class _ArtifactEmbeddings(torch.nn.Module):
    """TorchRec's embedding contract (kjt -> {feature: JaggedTensor}) over an exported
    artifact's tables, so the recommender's own scoring methods run on artifact rows."""

    def __init__(self, table_of: dict) -> None:
        super().__init__()
        self.table_of = table_of

    def forward(self, kjt: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        return {k: JaggedTensor(values=self.table_of[k].lookup(kjt[k].values()), lengths=kjt[k].lengths())
                for k in kjt.keys()}


def _is_artifact(path: Path) -> bool:
    from genrec.models.serving.artifact import MANIFEST

    return (path / MANIFEST).is_file() and not (path / "config.json").is_file()


def load_scored(path: str | Path, data_dir: Path) -> _Scored:
    """A checkpoint (run or step directory) or an exported artifact, ready to score."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    if _is_artifact(path):
        from genrec.models.serving.ranker import load_artifact

        ranker = load_artifact(path)
        model = ranker.model
        model.embeddings = _ArtifactEmbeddings(ranker.table_of)
        model.set_item_corpus(ranker.item_ids_N)
        job = ranker.manifest.get("job_config") or {}
        max_tokens = int(ranker.manifest["tower"]["max_seq_len"])
        window = int(job.get("data", {}).get("loader", {}).get("max_seq_len", max_tokens - 1))
        config = {"artifact": {k: ranker.manifest[k] for k in ("version", "dtype", "features", "model", "tower")},
                  "job_config": job}
        # An artifact ranks over its own item index, which it may have been exported with from
        # other data: say so, since its figures then compare with no checkpoint's on this data.
        data_items, _ = load_item_corpus(data_dir)
        if not torch.equal(data_items, ranker.item_ids_N):
            shared = int(sorted_positions(data_items, ranker.item_ids_N)[1].sum())
            config["corpus"] = {"artifact_items": int(ranker.item_ids_N.numel()),
                                "data_items": int(data_items.numel()), "shared": shared}
            print(f"genrec eval: warning: {path} ranks over its own item index ({ranker.item_ids_N.numel()} "
                  f"items), not the corpus of {data_dir} ({data_items.numel()} items, {shared} in both): its "
                  "figures are not comparable with a checkpoint's on this data", file=sys.stderr, flush=True)
        name = f"{path.name} ({ranker.dtype})"
        return _Scored(name=name, source=str(path), model=model, features=ranker.features, tasks=ranker.tasks,
                       window=window, max_tokens=max_tokens, config=config)
    from genrec.models.config_loader import to_dict
    from genrec.models.runs import load_trained, read_best, resolve_checkpoint

    step_dir, run_dir = resolve_checkpoint(path)
    best = read_best(run_dir)
    chosen = ("best-validation" if best is not None and step_dir.name == best["checkpoint"] else "latest")
    detail = f" ({best['metric']} = {best['value']:.4f})" if chosen == "best-validation" else ""
    print(f"genrec eval: {path} -> {chosen} checkpoint {step_dir.name}{detail}", file=sys.stderr, flush=True)
    # The item corpus comes from the data being evaluated, not from where the run trained.
    cfg, model = load_trained(step_dir, overrides={"data": {"path": str(data_dir)}})
    trained_on, other_data = trained_on_data(run_dir, Path(data_dir))
    if other_data:
        print(f"genrec eval: warning: {path} trained on {trained_on}, whose prepared files differ from those of "
              f"{data_dir}: its figures are not those of a run trained on this data", file=sys.stderr, flush=True)
    config = {**to_dict(cfg), "checkpoint": {"step_dir": step_dir.name, "chosen": chosen, "trained_on": trained_on,
                                             **({"best": best} if chosen == "best-validation" else {})}}
    return _Scored(name=run_dir.resolve().name, source=str(path), model=model, features=cfg.data.features,
                   tasks=list(cfg.model.ranking_tasks) if cfg.model.ranking else [],
                   window=cfg.data.loader.max_seq_len, max_tokens=cfg.dense.max_seq_len, config=config)


def check_features(scored: _Scored, data: FeatureSpec, manifest_path: Path) -> None:
    """The model must read only columns the prepared data has, with the same roles."""
    model = scored.features
    for role in ("item", "action"):
        if getattr(model, role) != getattr(data, role):
            raise ValueError(f"{scored.source}: data.features.{role} is {getattr(model, role)!r} but the prepared "
                             f"data {manifest_path} has {getattr(data, role)!r}: feature spec does not match the data")
    missing = [c for c in model.sparse if c not in data.sparse]
    if missing:
        raise ValueError(f"{scored.source}: data.features.sparse columns {missing} are not in the prepared data "
                         f"{manifest_path} (its sparse columns: {data.sparse}): feature spec does not match the data")
    missing = [t for t in scored.tasks if t not in data.labels]
    if missing:
        raise ValueError(f"{scored.source}: ranking tasks {missing} are not label columns of the prepared data "
                         f"{manifest_path} (its labels: {data.labels}): feature spec does not match the data")


# --------------------------------------------------------------------------- jagged rows


def _events(kjt: KeyedJaggedTensor, ts_T: torch.Tensor, keys: list[str]) -> dict[str, torch.Tensor]:
    """{feature: values [T], "ts": [T]}: the flat, row-major values of a KJT's keys."""
    return {**{k: kjt[k].values() for k in keys}, TS: ts_T}


def _take(events: dict[str, torch.Tensor], idx_T: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[idx_T] for k, v in events.items()}


def _keep_last(events: dict[str, torch.Tensor], lengths_B: torch.Tensor, n: int):
    """The most recent `n` events of each row: (events, lengths_B)."""
    keep_B = lengths_B.clamp(max=n)
    ends_B = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths_B)[1:]
    return _take(events, jagged_ranges(ends_B - keep_B, keep_B)), keep_B


def _concat_rows(a: dict[str, torch.Tensor], a_len_B: torch.Tensor, b: dict[str, torch.Tensor], b_len_B: torch.Tensor):
    """Row i = a_i followed by b_i: (events, lengths_B)."""
    out = {k: interleave_jagged(a[k], a_len_B, b[k], b_len_B)[0] for k in a}
    return out, a_len_B + b_len_B


def _kjt(events: dict[str, torch.Tensor], lengths_B: torch.Tensor, keys: list[str]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=keys, values=torch.cat([events[k] for k in keys]),
                             lengths=lengths_B.repeat(len(keys)))


@dataclass
class _Rows:
    """One batch of evaluation rows, read with the whole history (no window)."""

    user_ids_B: torch.Tensor
    before_target: dict[str, torch.Tensor]
    """All events before the target, every data column."""
    before_target_len_B: torch.Tensor
    history: dict[str, torch.Tensor]
    """Events before the first ranking candidate."""
    history_len_B: torch.Tensor
    candidates: dict[str, torch.Tensor]
    """The row's last events (the target last), every data column."""
    candidate_len_B: torch.Tensor
    labels_CL: torch.Tensor
    """Candidate labels, data label order."""
    target_B: dict[str, torch.Tensor]
    """Every data column's value on the target event."""

    @staticmethod
    def from_batch(batch: Batch, keys: list[str], split_dir: Path) -> "_Rows":
        cand_len_B = batch.candidates.lengths()[: batch.batch_size].long()
        if bool((cand_len_B == 0).any()):
            user = int(batch.user_ids_B[cand_len_B == 0][0])
            raise ValueError(f"{split_dir}: user {user} has a one-event evaluation row (no history before the target)")
        hist_len_B = batch.history_lengths_B.long()
        history = _events(batch.history, batch.timestamps_T, keys)
        candidates = _events(batch.candidates, batch.candidate_timestamps_C, keys)
        cand_ends_B = torch.ops.fbgemm.asynchronous_complete_cumsum(cand_len_B)[1:]
        is_target_C = torch.zeros(len(candidates[TS]), dtype=torch.bool)
        is_target_C[cand_ends_B - 1] = True
        before, before_len_B = _concat_rows(history, hist_len_B, _take(candidates, ~is_target_C), cand_len_B - 1)
        return _Rows(user_ids_B=batch.user_ids_B, before_target=before, before_target_len_B=before_len_B,
                     history=history, history_len_B=hist_len_B, candidates=candidates, candidate_len_B=cand_len_B,
                     labels_CL=batch.labels_CL, target_B=_take(candidates, cand_ends_B - 1))

    def retrieval_batch(self, scored: _Scored) -> Batch:
        keys = scored.features.sparse
        events, len_B = _keep_last(self.before_target, self.before_target_len_B, scored.window)
        return Batch(user_ids_B=self.user_ids_B, history=_kjt(events, len_B, keys), timestamps_T=events[TS],
                     history_lengths_B=len_B, targets_B=self.target_B[scored.features.item],
                     query_time_B=self.target_B[TS])

    def ranking_batch(self, scored: _Scored) -> Batch:
        keys = scored.features.sparse
        room = min(scored.window, scored.max_tokens - int(self.candidate_len_B.max()))
        events, len_B = _keep_last(self.history, self.history_len_B, room)
        return Batch(user_ids_B=self.user_ids_B, history=_kjt(events, len_B, keys), timestamps_T=events[TS],
                     history_lengths_B=len_B, candidates=_kjt(self.candidates, self.candidate_len_B, keys),
                     candidate_timestamps_C=self.candidates[TS], labels_CL=self.labels_CL)


# --------------------------------------------------------------------------- scoring


@torch.no_grad()
def _score_retrieval(scored: _Scored, rows: _Rows) -> torch.Tensor:
    batch = rows.retrieval_batch(scored)
    user_BD = scored.model.user_embeddings(batch)
    if not bool(torch.isfinite(user_BD).all()):
        bad = int(batch.user_ids_B[~torch.isfinite(user_BD).all(1)][0])
        raise ValueError(f"{scored.source}: the model gives NaN / inf user embeddings (user {bad}): NaN scores")
    # "Seen" is every event before the target, not only the model's window.
    item = scored.features.item
    return target_ranks(user_BD @ scored.item_emb_ND.T, batch.targets_B, scored.item_corpus,
                        rows.before_target[item], rows.before_target_len_B)


@torch.no_grad()
def _score_ranking(scored: _Scored, rows: _Rows) -> torch.Tensor:
    probs_CL = scored.model.rank_probabilities(rows.ranking_batch(scored)).float()
    if not bool(torch.isfinite(probs_CL).all()):
        raise ValueError(f"{scored.source}: the ranking head gives NaN / inf probabilities: NaN scores")
    return probs_CL


def _new_accumulators(tasks: list[str], slice_columns: dict[str, list[str] | None]):
    retrieval = RetrievalMetrics(ks=EVAL_KS)
    retrieval_slices = SlicedMetrics(lambda: RetrievalMetrics(ks=EVAL_KS), slice_columns, method="update_ranks")
    if not tasks:
        return retrieval, retrieval_slices, None, None
    ranking = RankingMetrics(tasks=tasks)
    ranking_slices = SlicedMetrics(lambda: RankingMetrics(tasks=tasks), slice_columns)
    return retrieval, retrieval_slices, ranking, ranking_slices


def _section(retrieval: RetrievalMetrics, retrieval_slices: SlicedMetrics, ranking: RankingMetrics | None,
             ranking_slices: SlicedMetrics | None, *, num_resamples: int, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {"retrieval": retrieval.compute(), "slices": {"retrieval": retrieval_slices.compute()}}
    # Each retrieval slice carries bootstrap CIs of the figures its plot shows (error bars).
    for column, values in out["slices"]["retrieval"].items():
        for value, figures in values.items():
            per_user = retrieval_slices.accumulator(column, value).per_user()
            figures["ci"] = {m: bootstrap_ci(per_user[m], None, num_resamples, seed=seed) for m in SLICE_CI_METRICS}
    if ranking is not None:
        out["ranking"] = ranking.compute()
        out["slices"]["ranking"] = ranking_slices.compute()
    return out


def _order_only(section: dict[str, Any]) -> dict[str, Any]:
    """The popularity baseline's section without the ranking figures that read its scores as
    probabilities (they are a popularity order): only AUC / GAUC and counts stay."""
    def strip(per_task: dict[str, Any]) -> dict[str, Any]:
        return {task: {k: v for k, v in m.items() if k not in NOT_FOR_ORDER_ONLY} for task, m in per_task.items()}

    if "ranking" in section:
        section["ranking"] = strip(section["ranking"])
        section["slices"]["ranking"] = {column: {value: strip(m) for value, m in values.items()}
                                        for column, values in section["slices"]["ranking"].items()}
    return section


def _read_item_counts(data_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted item ids [N], their train counts [N]) from items.parquet."""
    path = data_dir / "items.parquet"
    if not path.is_file():
        raise ValueError(f"{path} not found: is {data_dir} the output of `genrec prepare`?")
    table = pq.read_table(path, columns=["item_id", "count"])
    ids = torch.from_numpy(table.column("item_id").to_numpy().astype(np.int64))
    counts = torch.from_numpy(table.column("count").to_numpy().astype(np.int64))
    order = torch.argsort(ids)
    return ids[order], counts[order]


def _check_labels(rows: _Rows, labels: list[str], split_dir: Path) -> None:
    bad_CL = (rows.labels_CL != 0) & (rows.labels_CL != 1)
    if bool(bad_CL.any()):
        c, j = (int(x) for x in torch.nonzero(bad_CL)[0])
        user = int(torch.repeat_interleave(rows.user_ids_B, rows.candidate_len_B)[c])
        raise ValueError(f"{split_dir}: label column {labels[j]!r} has value {float(rows.labels_CL[c, j]):g} "
                         f"(user {user}); labels must be 0 or 1")


def _run_comparisons(runs_a: list, runs_b: list, boot: dict) -> dict[str, dict]:
    """Paired comparisons of the runs of recipe A with those of recipe B (report keys). One
    run of A: A minus each of B's, keyed by B's name, as always. Several runs on either
    side: each pair (A's i-th run minus B's i-th, when both give as many) and the mean of
    A's runs minus the mean of B's (`MeanOfRuns`; a side of one run is its own mean)."""
    def pair(a, b) -> dict:
        return compare_models(a.retrieval, b.retrieval, a.ranking, b.ranking, **boot)

    if not runs_b:
        return {}
    if len(runs_a) == 1:
        out = {b.name: pair(runs_a[0], b) for b in runs_b}
        if len(runs_b) == 1:
            return out
    else:
        out = ({f"{a.name} minus {b.name}": pair(a, b) for a, b in zip(runs_a, runs_b)}
               if len(runs_a) == len(runs_b) else {})
    # Ranking is averaged only where every run of a side has a ranking head.
    mean_a, mean_b = (MeanOfRuns([r.retrieval for r in runs],
                                 [r.ranking for r in runs] if all(r.ranking is not None for r in runs) else [])
                      for runs in (runs_a, runs_b))
    label = f"mean of {len(runs_a)} run{'s' * (len(runs_a) > 1)} minus mean of {len(runs_b)} compare runs"
    out[label] = compare_models(mean_a, mean_b, mean_a if mean_a.tasks else None, mean_b if mean_b.tasks else None,
                                **boot)
    return out


# --------------------------------------------------------------------------- the run


def run_evaluation(
    checkpoint: str | Path | list[str | Path],
    data_dir: str | Path,
    split: str = "test",
    *,
    out_dir: str | Path,
    compare: str | Path | list[str | Path] | None = None,
    seed: int = 0,
    slice_columns: list[str] | None = None,
    ranking_candidates: int | None = None,
    new_user_events: int = NEW_USER_EVENTS,
    batch_size: int = 128,
    num_resamples: int = 1000,
    progress: bool = True,
) -> Path:
    """Evaluate `checkpoint` (and `compare`) on `data_dir/split`; write the report to `out_dir`.

    Either may be several runs of one recipe (e.g. seeds): the report's model is the first
    checkpoint, every other run is a column beside it, and the comparisons are per pair of
    runs and of the two recipes' means over their runs (`_run_comparisons`).

    slice_columns: sparse data columns to slice by (the target event's value); None: category_id
    when the data has it. ranking_candidates: events per row scored by the ranking head; None:
    2 on a leave-one-out test split (both held out of training), else 1. Returns `out_dir`.
    """
    if split not in ("test", "valid"):
        raise ValueError(f"split must be 'test' or 'valid', got {split!r}")
    check_seed(seed, "seed (--seed)")  # the bootstrap's generator; numpy's message named no option
    claim_report_dir(out_dir)  # refused now, not after the evaluation
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    data_features = FeatureSpec(**manifest["features"])
    split_dir = data_dir / split
    num_rows = split_rows(split_dir)
    if slice_columns is None:
        slice_columns = [DEFAULT_SLICE_COLUMN] if DEFAULT_SLICE_COLUMN in data_features.sparse else []
    for column in slice_columns:
        if column not in data_features.sparse:
            raise ValueError(f"slice column {column!r} is not a sparse column of {data_dir / 'manifest.json'} "
                             f"({data_features.sparse})")
    if ranking_candidates is None:
        loo = manifest.get("split", {}).get("kind") == "leave_one_out"
        ranking_candidates = 2 if loo and split == "test" else 1
    if ranking_candidates < 1:
        raise ValueError(f"ranking_candidates must be >= 1, got {ranking_candidates}")

    runs_a = [checkpoint] if isinstance(checkpoint, (str, Path)) else list(checkpoint)
    runs_b = [] if compare is None else [compare] if isinstance(compare, (str, Path)) else list(compare)
    if not runs_a:
        raise ValueError("checkpoint: no checkpoint given")
    models = [load_scored(c, data_dir) for c in runs_a + runs_b]
    names = {POPULARITY, AD_RATE, ORACLE}  # the baselines' report sections
    for i, scored in enumerate(models):
        if i and scored.name in names:  # a run of a baseline's or another run's (folder) name
            scored.name += " (compare)" if i == len(runs_a) else f" ({i + 1})"
        names.add(scored.name)
    columns = {"user_type": USER_TYPE_VALUES, "history_length": bucket_labels(HISTORY_EDGES),
               "item_popularity": POPULARITY_VALUES, **{c: None for c in slice_columns}}
    for scored in models:
        check_features(scored, data_features, data_dir / "manifest.json")
        scored.item_corpus = scored.model.item_corpus
        scored.item_emb_ND = scored.model.item_embeddings(scored.item_corpus)
        if not bool(torch.isfinite(scored.item_emb_ND).all()):
            raise ValueError(f"{scored.source}: the model gives NaN / inf item embeddings: NaN scores")
        (scored.retrieval, scored.retrieval_slices, scored.ranking,
         scored.ranking_slices) = _new_accumulators(scored.tasks, columns)

    data_corpus, train_counts_N = _read_item_counts(data_dir)
    popularity = PopularityScorer(train_counts_N)
    bucket_N = popularity_buckets(train_counts_N)
    pop_acc = _new_accumulators(list(data_features.labels), columns)
    # Click-task yardsticks on the same candidates: each ad's train rate, and the planted
    # oracle when the logs are synthetic with their truth column (data.synth).
    ad_rate = AdRateScorer(data_dir, data_features.item, list(data_features.labels)) if data_features.labels else None
    oracle = (OracleScorer.from_prepared(manifest, data_features.user_key, data_features.timestamp, data_features.item)
              if ORACLE_TASK in data_features.labels else None)
    ad_rate_acc = RankingMetrics(tasks=list(data_features.labels)) if ad_rate is not None else None
    oracle_acc = RankingMetrics(tasks=[ORACLE_TASK]) if oracle is not None else None

    # The whole history of every row (max_seq_len unbounded): the seen-item filter and the
    # slices need it; each model's window is cut from it below.
    loader_cfg = LoaderConfig(batch_size=batch_size, max_seq_len=2**31 - 1, mode="ranking",
                              num_candidates=ranking_candidates, shuffle=False, drop_last=False)
    loader = make_loader(split_dir, data_features, loader_cfg)
    keys = list(data_features.sparse)
    bar = tqdm(total=num_rows, unit="user", desc=f"eval {split}", file=sys.stderr, disable=not progress)
    for batch in loader:
        rows = _Rows.from_batch(batch, keys, split_dir)
        _check_labels(rows, list(data_features.labels), split_dir)
        target_pos_B, target_found_B = sorted_positions(data_corpus, rows.target_B[data_features.item])
        cand_pos_C, cand_found_C = sorted_positions(data_corpus, rows.candidates[data_features.item])
        n_before_B = rows.before_target_len_B.numpy()
        user_slices = {"user_type": np.where(n_before_B < new_user_events, "new", "returning"),
                       "history_length": length_buckets(n_before_B, HISTORY_EDGES)}
        retrieval_slices = {**user_slices,
                            "item_popularity": np.where(target_found_B.numpy(), bucket_N[target_pos_B.numpy()], "tail"),
                            **{c: rows.target_B[c].numpy() for c in slice_columns}}
        per_candidate = rows.candidate_len_B.numpy()
        ranking_slices = {**{k: np.repeat(v, per_candidate) for k, v in user_slices.items()},
                          "item_popularity": np.where(cand_found_C.numpy(), bucket_N[cand_pos_C.numpy()], "tail"),
                          **{c: rows.candidates[c].numpy() for c in slice_columns}}
        cand_users_C = torch.repeat_interleave(rows.user_ids_B, rows.candidate_len_B)

        for scored in models:
            ranks_B = _score_retrieval(scored, rows)
            scored.retrieval.update_ranks(ranks_B)
            scored.retrieval_slices.update(retrieval_slices, ranks_B)
            if scored.ranking is not None:
                probs_CL = _score_ranking(scored, rows)
                labels_CL = rows.labels_CL[:, [data_features.labels.index(t) for t in scored.tasks]]
                scored.ranking.update(cand_users_C, probs_CL, labels_CL)
                scored.ranking_slices.update(ranking_slices, cand_users_C, probs_CL, labels_CL)

        pop_ranks_B = target_ranks(popularity.scores(batch.batch_size), rows.target_B[data_features.item],
                                   data_corpus, rows.before_target[data_features.item], rows.before_target_len_B)
        pop_acc[0].update_ranks(pop_ranks_B)
        pop_acc[1].update(retrieval_slices, pop_ranks_B)
        if pop_acc[2] is not None:
            # Items outside the corpus were never seen in training: below every known item.
            pop_probs_C = torch.where(cand_found_C, popularity.candidate_probs(cand_pos_C), torch.zeros(()))
            pop_probs_CL = pop_probs_C[:, None].expand(-1, len(data_features.labels))
            pop_acc[2].update(cand_users_C, pop_probs_CL, rows.labels_CL)
            pop_acc[3].update(ranking_slices, cand_users_C, pop_probs_CL, rows.labels_CL)
        if ad_rate_acc is not None:
            ad_rate_acc.update(cand_users_C, ad_rate.probs(rows.candidates[data_features.item]), rows.labels_CL)
        if oracle_acc is not None:
            oracle_C1 = oracle.probs(cand_users_C, rows.candidates[TS], rows.candidates[data_features.item])
            if oracle_C1 is None:  # candidates missing from the logs: no oracle row rather than a partial one
                oracle, oracle_acc = None, None
            else:
                oracle_acc.update(cand_users_C, oracle_C1,
                                  rows.labels_CL[:, [data_features.labels.index(ORACLE_TASK)]])
        bar.update(batch.batch_size)
    bar.close()

    main = models[0]
    boot = {"num_resamples": num_resamples, "seed": seed}
    report: dict[str, Any] = {"name": main.name, **_section(main.retrieval, main.retrieval_slices, main.ranking,
                                                            main.ranking_slices, **boot)}
    report["ci"] = headline_cis(main.retrieval, main.ranking, num_resamples=num_resamples, seed=seed)
    report["baselines"] = {POPULARITY: _order_only(_section(*pop_acc, **boot))}
    vs_popularity = compare_models(main.retrieval, pop_acc[0], main.ranking, pop_acc[2], **boot)
    report["comparisons"] = {POPULARITY: {k: v for k, v in vs_popularity.items()
                                          if k.rsplit(".", 1)[-1] not in NOT_FOR_ORDER_ONLY}}
    for label, acc in ((AD_RATE, ad_rate_acc), (ORACLE, oracle_acc)):
        if acc is not None:
            report["baselines"][label] = {"ranking": acc.compute()}
    for other in models[1:]:
        report["baselines"][other.name] = _section(other.retrieval, other.retrieval_slices, other.ranking,
                                                   other.ranking_slices, **boot)
    report["comparisons"].update(_run_comparisons(models[: len(runs_a)], models[len(runs_a):], boot))
    report["config"] = {
        "eval": {"checkpoint": str(runs_a[0]), "data": str(data_dir), "split": split,
                 "compare": ([str(c) for c in runs_b] if len(runs_b) > 1 else str(runs_b[0]) if runs_b else None),
                 **({"runs": [str(c) for c in runs_a]} if len(runs_a) > 1 else {}),
                 "seed": seed, "ks": list(EVAL_KS),
                 "num_users": main.retrieval.count, "ranking_candidates": ranking_candidates,
                 "new_user_events": new_user_events, "history_edges": list(HISTORY_EDGES),
                 "slice_columns": slice_columns, "num_resamples": num_resamples,
                 "corpus_items": len(main.item_corpus)},
        "run": main.config,
        **({"compare_run": models[len(runs_a)].config} if runs_b else {}),
    }
    report["data_manifest_checksums"] = manifest_checksums(data_dir, manifest)
    report["versions"] = collect_versions()
    plots = (["calibration"] if report.get("ranking") else []) + ["history_length", "item_popularity", *slice_columns]
    return write_report(out_dir, report, plots=plots)
