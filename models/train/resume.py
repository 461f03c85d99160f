"""Training again into a run directory: resuming with changed settings, or starting over.

A run that finds a complete checkpoint in its `train.out_dir` resumes from it. Its new
config is compared with the run's saved one (`config.json`, the settings in effect), key by
dotted key:

    train.optim.lr: 0.001 -> 0.0005            applied: the optimizer and schedule follow it
    train.max_steps: 1000 -> 2000              applied: the cosine schedule is re-laid to 2000
    dense.num_layers: 2 -> 4                   refused: the saved weights have 2 layers

A key in `APPLIED` takes effect after the restore (the trainer is built from the new config,
and `apply_optim_settings` overrides what the restored optimizer state would bring back:
lr, betas, eps, weight decay and the schedule); any other change is refused, naming the
keys, before anything is built or written: it would change the parameters' shapes, what the
trained weights compute, the data or its order, or it cannot take effect on a restored run
(the seed: the RNG states and data position come from the checkpoint). `--fresh` starts over
instead, in a directory that is a genrec training run (`run.json`); it removes only what
training writes there.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from genrec.data.files import claim_output_dir, holds_output
from genrec.models.config import JobConfig, OptimConfig
from genrec.models.config_loader import from_dict, to_dict
from genrec.models.runs import (
    BEST_FILE, CHECKPOINTS, CONFIG_FILE, RUN_FORMAT, RUN_MANIFEST, CorruptCheckpoint, latest_checkpoint,
    scan_checkpoints,
)
from genrec.models.train.schedule import warmup_cosine

APPLIED = (
    "train.max_steps", "train.num_epochs", "train.eval_every", "train.eval_every_epochs", "train.eval_max_users",
    "train.early_stop_patience", "train.log_every", "train.tensorboard", "train.checkpoint_every",
    "train.keep_checkpoints", "train.num_threads", "train.cpu_affinity", "train.pipeline", "train.deterministic", "train.precision",
    "train.dense_parallel",
    "train.optim.*",
    "dense.dropout", "dense.input_dropout", "dense.kernel", "dense.attention_block_elems", "dense.bucket_min_fill",
    "dense.activation_checkpointing", "dense.target_micro_batch",
    "model.retrieval_weight", "model.contrastive_weight", "model.contrastive_temperature", "model.task_weights",
    "model.temperature", "model.negatives", "model.num_negatives", "model.in_batch_negatives",
    "model.full_softmax_max_items", "model.mask_seen", "model.min_target_action",
    "data.loader.prefetch_factor", "sparse.ssd_dir", "sparse.kernels", "sparse.read_ahead",
)
"""Keys a resumed run may change: each takes effect after the restore (fnmatch patterns)."""

TRAINING_OUTPUTS = (CHECKPOINTS, CONFIG_FILE, BEST_FILE, "metrics.jsonl", "tensorboard", RUN_MANIFEST)
"""What training writes into its run directory (and `--fresh` removes)."""

_SKIPPED = ("train.out_dir",)
"""Not compared: the run directory is the one being resumed, whatever its spelling."""


def flatten_config(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a config dict; tables are keyed by name (`sparse.tables[item].
    embedding_dim`), other lists are values."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten_config(value, f"{prefix}.{key}" if prefix else key))
        return out
    if isinstance(tree, list) and tree and all(isinstance(t, dict) and "name" in t for t in tree):
        out = {}
        for t in tree:
            out.update(flatten_config({k: v for k, v in t.items() if k != "name"}, f"{prefix}[{t['name']}]"))
        return out
    return {prefix: tree}


def config_changes(saved: dict, now: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, new value) of every key that differs (absent reads None)."""
    old, new = flatten_config(saved), flatten_config(now)
    return [(k, old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys())
            if k not in _SKIPPED and old.get(k) != new.get(k)]


def _refusal(key: str, old: Any, new: Any) -> str | None:
    """Why changing `key` cannot be applied to a resumed run (None: it can)."""
    if key == "train.precision" and "fp16" in (old, new):
        return "the fp16 gradient scaler's state cannot start or stop mid-run"
    if any(fnmatch.fnmatchcase(key, pattern) for pattern in APPLIED):
        return None
    if key.startswith(("dense.", "model.", "sparse.", "data.features")):
        return "the checkpoint's parameters and rows were trained for the saved value"
    if key.startswith("data."):
        return "it changes the training data or its order"
    return "it cannot take effect on a restored run"


def check_resume_changes(run_dir: Path, saved: dict, now: dict) -> list[tuple[str, Any, Any]]:
    """The changes of `now` against the run's `saved` config; ValueError naming every change
    that cannot be applied, with how to start over."""
    changes = config_changes(saved, now)
    refused = [(k, old, new, why) for k, old, new in changes if (why := _refusal(k, old, new)) is not None]
    if refused:
        listed = "; ".join(f"{k}: {_show(old)} -> {_show(new)} ({why})" for k, old, new, why in refused)
        raise ValueError(f"{run_dir} holds checkpoints of a run with other settings, which a resume cannot "
                         f"change: {listed}. Train with --fresh to start over in {run_dir}, or choose a new "
                         "train.out_dir")
    return changes


def describe_changes(run_dir: Path, changes: list[tuple[str, Any, Any]]) -> str:
    return f"resuming {run_dir} with changed settings: " + "; ".join(
        f"{k}: {_show(old)} -> {_show(new)}" for k, old, new in changes)


def _show(value: Any) -> str:
    return "unset" if value is None else json.dumps(value)


def read_saved_config(run_dir: Path) -> dict:
    """The run's config.json with defaults filled in as this version has them (so a key it
    does not record reads as its default, not as a change). ValueError naming the file when
    it is missing or unreadable: the checkpoints' fingerprints cover only shapes, so without
    it a resume would accept a new seed, data order or optimizer settings unchecked."""
    path = run_dir / CONFIG_FILE
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ValueError(f"{run_dir} holds checkpoints but {path} is missing or unreadable ({e}), so a resume "
                         f"cannot check which settings changed: put it back, or train with --fresh to start over "
                         f"in {run_dir}") from None
    try:
        return to_dict(from_dict(JobConfig, saved))
    except ValueError:  # written by another genrec version: compare what it says
        return saved


def check_resume(run_dir: Path, now: dict, *,
                 required: bool) -> tuple[list[tuple[str, Any, Any]], list[tuple[Path, str]]]:
    """Check training into `run_dir` without --fresh, before anything is written there: the
    config changes the resume applies (`check_resume_changes`) and the step dirs it skips for
    want of a valid marker, as (dir, why). Refused: step dirs none of which is a complete
    checkpoint (a run from step 0 would write over them), and `required` (--resume) with no
    checkpoint (FileNotFoundError)."""
    root = run_dir / CHECKPOINTS
    complete, damaged = scan_checkpoints(root)
    if not complete and damaged:
        listed = "; ".join(why for _, why in damaged)
        raise CorruptCheckpoint(f"{root} holds step dirs but no complete checkpoint to resume from ({listed}): "
                                f"training would start over at step 0 and write over them. Train with --fresh to "
                                f"start over in {run_dir}, or choose another train.out_dir")
    if not complete:
        latest_checkpoint(root, required=required)
        return [], []
    return check_resume_changes(run_dir, read_saved_config(run_dir), now), damaged


def apply_optim_settings(optimizer: torch.optim.Optimizer, scheduler, cfg: OptimConfig) -> None:
    """Make the restored optimizer and schedule follow `cfg`, not the saved hyperparameters:
    the peak lr, betas, eps, weight decay of the "decay" group, and the lr of the next step
    from this config's schedule (its lambdas were built from this config's length and
    warmup). With the saved settings unchanged this recomputes the same values."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
        group["betas"] = (cfg.betas[0], cfg.betas[1])
        group["eps"] = cfg.eps
        group["weight_decay"] = cfg.weight_decay if group.get("name") == "decay" else 0.0
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = cfg.lr * lr_lambda(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def epochs_end(loader, step: int, num_epochs: int, *, resized: bool) -> int | None:
    """The step at which a run restored at `step`, with `loader` at its restored position,
    has trained `num_epochs` epochs: the rest of this epoch and the plan's later ones, each
    the batches every rank yields (as `trainer.epoch_steps` counts them). Counted from the
    position, not from step 0: once a run has resumed on another world size, its earlier
    epochs were another plan's, of other lengths. None where the ranks' positions differ
    (several ranks without `equal_batches_per_rank` and no resize: their epochs end at other
    steps, and the count from step 0 is the one all ranks share)."""
    ds = loader.dataset
    if not resized and ds.world_size > 1 and not loader.cfg.equal_batches_per_rank:
        return None
    if loader.epoch >= num_epochs:
        return step

    def steps(epoch: int) -> int:
        return min(len(ds.schedule(epoch, rank)) for rank in range(ds.world_size))

    later = sum(steps(epoch) for epoch in range(loader.epoch + 1, num_epochs))
    return step + steps(loader.epoch) - loader.batches_done + later


def relaid_schedule(optimizer: torch.optim.Optimizer, scheduler, cfg: OptimConfig, total_steps: int):
    """A cosine schedule over `total_steps` in place of restored `scheduler`, at its step."""
    saved = scheduler.state_dict()
    scheduler = warmup_cosine(optimizer, warmup_steps=min(cfg.warmup_steps, max(total_steps, 1)),
                              total_steps=max(total_steps, 1), min_lr_ratio=cfg.min_lr_ratio)
    scheduler.load_state_dict(saved)
    apply_optim_settings(optimizer, scheduler, cfg)
    return scheduler


def check_run_dir(run_dir: Path) -> None:
    """Refuse to train into a folder that holds anything but a genrec training run: it must be
    absent, empty or a run (its `run.json`). A run writes its config.json, best.json and
    checkpoints/ there, over a folder's own files of those names, and marks the folder as a
    run, which `--fresh` may then clear."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"train.out_dir {run_dir} exists and is not a directory")
    if run_dir.is_dir() and any(run_dir.iterdir()) and not holds_output(run_dir, RUN_MANIFEST, RUN_FORMAT):
        raise ValueError(f"train.out_dir {run_dir} is not empty and is not a genrec training run (no {RUN_MANIFEST} "
                         "with its format in it): choose another train.out_dir, or move its files away yourself")


def check_fresh(run_dir: Path) -> None:
    """Refuse, removing nothing, unless `run_dir` is absent, empty or a genrec training run
    (its `run.json`): what `start_fresh` may clear."""
    claim_output_dir(run_dir, overwrite=True, manifest=RUN_MANIFEST, format=RUN_FORMAT, flag="--fresh")


def start_fresh(run_dir: Path) -> None:
    """Remove a previous training run's outputs from `run_dir` (see `TRAINING_OUTPUTS`; other
    files, e.g. a report written there, stay). Refused, removing nothing, unless `check_fresh`
    accepts `run_dir`."""
    check_fresh(run_dir)
    # run.json stays (training writes it again): a crash mid-removal must leave a folder that
    # is still a run, which the next --fresh (or a plain start) accepts.
    present = [run_dir / name for name in TRAINING_OUTPUTS if name != RUN_MANIFEST and (run_dir / name).exists()]
    # What an earlier --fresh killed mid-removal left behind.
    leftovers = [p for p in run_dir.glob(".fresh-removed-*") if p.is_dir() and not p.is_symlink()]
    if present:
        # Moved aside in one folder first: a crash mid-removal leaves no half-deleted checkpoint
        # under its own name, and the folder's name says it is garbage.
        doomed = run_dir / f".fresh-removed-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        doomed.mkdir()
        for path in present:
            os.replace(path, doomed / path.name)
        leftovers.append(doomed)
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)


def saved_form(cfg: JobConfig) -> dict:
    """The config as config.json records it: data.path absolute, so `genrec eval` / `export`
    find the data from any directory."""
    saved = to_dict(cfg)
    saved["data"]["path"] = str(Path(cfg.data.path).resolve())
    return saved
