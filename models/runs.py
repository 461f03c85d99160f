"""A training run on disk, read side: find, verify and load its checkpoints.

    cfg, model = load_trained("runs/ml100k")          # a run dir: its latest checkpoint
    cfg, model = load_trained("runs/ml100k/checkpoints/step-00001000")

Layout of a run directory (world_size 2), written by `models/train/checkpoint.py`:

    run/run.json                       {"format": "genrec-train-run/1"}: a genrec training run
    run/config.json                    the job config in effect
    run/best.json                      the best-validation checkpoint: step, metric, value
    run/checkpoints/step-00000123/
        dense.pt                       rank 0: model + optimizer + scheduler state dicts
        rank-00000-of-00002/state.pt   per rank: loader position, RNG states, step, ...
        rank-00000-of-00002/extra/     per rank: files only that rank reads back
        shared/                        written by all ranks together, readable under any
                                       world size (the sparse store's snapshot: shared/sparse)
        COMPLETE                       json: step, world_size, sha256 of every file, config
    run/checkpoints/.tmp-step-00000124-4711/   a save in progress (or killed): never read

Every room that reads a checkpoint (evaluation, export, the trainer's resume) goes
through here, never through the training loop. The checkpoint may come from any world
size: dense weights are replicated and the sparse snapshot reshards on load. Nothing is
unpickled (weights_only loading), and every file read is checked against its checksum.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from genrec.data.files import atomic_write_json, sha256_file
from genrec.models.build import build_model, load_item_corpus, unwrap
from genrec.models.config import JobConfig
from genrec.models.config_loader import from_dict
from genrec.models.model import GenerativeRecommender
from genrec.models.ranks import single_process

CONFIG_FILE = "config.json"
BEST_FILE = "best.json"
RUN_MANIFEST = "run.json"
RUN_FORMAT = "genrec-train-run/1"
"""run.json says "this folder is a genrec training run" (what `genrec train --fresh` may clear)."""
CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
DENSE_FILE = "dense.pt"
RANK_STATE_FILE = "state.pt"
SHARED = "shared"
FORMAT_VERSION = 2
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CorruptCheckpoint(ValueError):
    """A checkpoint file is missing, truncated or fails its checksum (not a config mismatch)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_dir_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}"


def shared_dir(checkpoint: str | Path) -> Path:
    """The folder of a checkpoint that all ranks wrote together (listed in its marker)."""
    return Path(checkpoint) / SHARED


def sparse_snapshot_dir(checkpoint: str | Path) -> Path:
    """Where a checkpoint keeps the sparse store's snapshot (verified by its own CRCs too)."""
    return shared_dir(checkpoint) / "sparse"


def read_marker(path: str | Path) -> dict[str, Any] | None:
    """The parsed COMPLETE marker of a step dir, or None if absent or unreadable."""
    try:
        marker = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    m = _STEP_DIR.match(Path(path).name)
    if not isinstance(marker, dict) or m is None or marker.get("step") != int(m.group(1)):
        return None
    return marker


def verify_file(f: Path, meta: dict[str, Any], *, checksum: bool = True) -> None:
    """Refuse a checkpoint file that is missing or differs from its marker entry (size
    always; sha256 unless `checksum=False`)."""
    if not f.is_file():
        raise CorruptCheckpoint(f"checkpoint file {f} is missing")
    if f.stat().st_size != meta["bytes"] or (checksum and sha256_file(f) != meta["sha256"]):
        raise CorruptCheckpoint(f"checkpoint file {f} is corrupt or truncated (checksum mismatch)")


def verify_shared(path: Path, marker: dict[str, Any], *, checksum: bool) -> None:
    """Check every file of the checkpoint's shared folder against the marker."""
    for rel, meta in sorted(marker["files"].items()):
        if rel.startswith(SHARED + "/"):
            verify_file(path / rel, meta, checksum=checksum)


def complete_steps(root: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every checkpoint under `root` with a valid marker, oldest first."""
    root = Path(root)
    found = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and read_marker(p) is not None:
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: str | Path, *, required: bool = False) -> Path | None:
    """The newest complete checkpoint under `root`, or None. `required=True` (resume
    demanded) raises FileNotFoundError instead, naming what was found."""
    root = Path(root)
    steps = complete_steps(root)
    if steps:
        return steps[-1][1]
    if required:
        others = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        raise FileNotFoundError(
            f"resume requested but {root} holds no complete checkpoint "
            f"(a step-N dir with a valid {MARKER} marker); found: {others or 'nothing'}"
        )
    return None


def read_best(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's best-validation record ({step, metric, value, checkpoint}), or None when
    the run has none. One this code did not write (it writes atomically) is an error naming
    the file and the field."""
    path = Path(run_dir) / BEST_FILE
    try:
        best = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable best-checkpoint record ({e}); remove it to use the latest "
                         "checkpoint") from None
    fields = {"step": int, "checkpoint": str, "metric": str, "value": (int, float)}
    for key, kind in fields.items():
        if not isinstance(best, dict) or not isinstance(best.get(key), kind) or isinstance(best.get(key), bool):
            raise ValueError(f"{path}: field {key!r} is missing or of the wrong type; remove the file to use the "
                             "latest checkpoint")
    return best


def write_best(run_dir: str | Path, best: dict[str, Any]) -> None:
    atomic_write_json(Path(run_dir) / BEST_FILE, best)


def resolve_checkpoint(path: str | Path, *, which: str = "best") -> tuple[Path, Path]:
    """(checkpoint step dir, run dir) for a run dir or a step dir. For a run dir, `which`
    picks its best-validation checkpoint ("best", falling back to the latest when the run
    has none) or its newest ("latest")."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    if which not in ("best", "latest"):
        raise ValueError(f"which checkpoint: 'best' or 'latest', got {which!r}")
    if (path / CONFIG_FILE).is_file():
        best = read_best(path) if which == "best" else None
        if best is not None:
            step_dir = path / CHECKPOINTS / step_dir_name(best["step"])
            if read_marker(step_dir) is not None:
                return step_dir, path
        return latest_checkpoint(path / CHECKPOINTS, required=True), path
    run_dir = path.parent.parent
    if read_marker(path) is None or not (run_dir / CONFIG_FILE).is_file():
        raise ValueError(f"{path} is neither a run directory (with {CONFIG_FILE}) nor a complete checkpoint in one")
    return path, run_dir


def load_trained(path: str | Path, *, overrides: dict | None = None) -> tuple[JobConfig, GenerativeRecommender]:
    """The run's config and its model with the checkpoint's weights and rows, in eval mode."""
    step_dir, run_dir = resolve_checkpoint(path)
    raw = json.loads((run_dir / CONFIG_FILE).read_text())
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update(values)
    cfg = from_dict(JobConfig, raw)
    cfg.sparse.ssd_dir = None  # a private temporary SSD tier, never the training run's
    model, store = build_model(cfg, single_process())
    model = unwrap(model)
    marker = read_marker(step_dir)
    dense_file = step_dir / DENSE_FILE
    verify_file(dense_file, marker["files"][DENSE_FILE])
    verify_shared(step_dir, marker, checksum=True)  # one process reads every shard anyway
    dense = torch.load(dense_file, map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(dense["model"], strict=False)
    if unexpected or any(not k.startswith("embeddings.") for k in missing):
        raise ValueError(f"{dense_file} does not fit the model of {run_dir / CONFIG_FILE}: "
                         f"missing {missing}, unexpected {unexpected}")
    store.load_snapshot(str(sparse_snapshot_dir(step_dir)))
    model.set_item_corpus(*load_item_corpus(cfg.data.path))
    model.eval()
    return cfg, model
