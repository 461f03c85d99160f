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
import sys
from pathlib import Path
from typing import Any

import torch

from genrec.data.files import atomic_write_json, sha256_file
from genrec.models.build import build_model, config_fingerprint, load_item_corpus, unwrap
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
    """A checkpoint file is missing, truncated or fails its checksum, or its marker is missing
    or malformed (not a config mismatch)."""


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


def check_marker(path: str | Path) -> dict[str, Any]:
    """The parsed COMPLETE marker of step dir `path`, with every field a reader uses present
    and of its type (as `CheckpointManager` writes it: dense.pt and each rank's state listed);
    CorruptCheckpoint naming the marker and what is wrong with it."""
    path = Path(path)
    file = path / MARKER
    try:
        marker = json.loads(file.read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path} is not a complete checkpoint (no {MARKER} marker)") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{file} is not a readable checkpoint marker ({e})") from None
    m = _STEP_DIR.match(path.name)
    if m is None:
        raise CorruptCheckpoint(f"{path} is not a checkpoint (a step-N directory)")
    if not isinstance(marker, dict):
        raise CorruptCheckpoint(f"{file} is not a JSON object")

    def field(container: dict, key: str, kind: type, name: str | None = None) -> Any:
        value = container.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CorruptCheckpoint(f"{file}: field {name or repr(key)} is missing or of the wrong type")
        return value

    if field(marker, "step", int) != int(m.group(1)):
        raise CorruptCheckpoint(f"{file}: field 'step' is {marker['step']}, not the step of {path.name}")
    world_size = field(marker, "world_size", int)
    if world_size < 1:
        raise CorruptCheckpoint(f"{file}: field 'world_size' is {world_size}")
    field(marker, "config_fingerprint", dict)
    files = field(marker, "files", dict)
    for rel, meta in files.items():
        if not isinstance(meta, dict):
            raise CorruptCheckpoint(f"{file}: the entry of {rel!r} is not a JSON object")
        field(meta, "bytes", int, f"files[{rel!r}]['bytes']")
        field(meta, "sha256", str, f"files[{rel!r}]['sha256']")
    for rel in [DENSE_FILE] + [f"{rank_dir_name(r, world_size)}/{RANK_STATE_FILE}" for r in range(world_size)]:
        if rel not in files:
            raise CorruptCheckpoint(f"{file} lists no {rel}")
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


def scan_checkpoints(root: str | Path) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
    """The step dirs under `root`: (step, dir) of each with a valid marker, oldest first,
    and (dir, why) of each without one. A save never publishes a step dir before its marker,
    so one without is damaged, not in progress (a save in progress is a `.tmp-*` dir)."""
    root = Path(root)
    complete, damaged = [], []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if not (m and p.is_dir()):
            continue
        try:
            check_marker(p)
        except CorruptCheckpoint as e:
            damaged.append((p, str(e)))
            continue
        complete.append((int(m.group(1)), p))
    return sorted(complete), damaged


def complete_steps(root: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every checkpoint under `root` with a valid marker, oldest first."""
    return scan_checkpoints(root)[0]


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


def plain_json(d: dict[str, object]) -> dict[str, object]:
    """`d` as it reads back from JSON: a tuple compares equal to the list a marker holds."""
    return json.loads(json.dumps(d, sort_keys=True))


def check_fingerprint(saved: dict[str, object], now: dict[str, object], path: Path) -> None:
    """ValueError naming every key whose value differs between checkpoint `path`'s marker
    (`saved`) and the current config's fingerprint (`now`, `models.build.config_fingerprint`)."""
    now = plain_json(now)
    diffs = []
    for key in sorted(saved.keys() | now.keys()):
        if key not in now:
            diffs.append(f"{key}: checkpoint {saved[key]!r}, missing in the current config")
        elif key not in saved:
            diffs.append(f"{key}: not in the checkpoint, now {now[key]!r}")
        elif saved[key] != now[key]:
            diffs.append(f"{key}: checkpoint {saved[key]!r}, now {now[key]!r}")
    if diffs:
        raise ValueError(f"checkpoint {path} does not match the current config: " + "; ".join(diffs))


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
    picks its best-validation checkpoint ("best", falling back to the latest, with a warning
    when best.json names one that is gone) or its newest ("latest"); step dirs without a
    valid marker are skipped with a warning naming them."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    if which not in ("best", "latest"):
        raise ValueError(f"which checkpoint: 'best' or 'latest', got {which!r}")
    if (path / CONFIG_FILE).is_file():
        best = read_best(path) if which == "best" else None
        complete, damaged = scan_checkpoints(path / CHECKPOINTS)
        for step_dir, why in damaged:
            _warn(f"skipping checkpoint {step_dir}: {why}")
        if not complete:
            raise FileNotFoundError(f"run {path} holds no complete checkpoint to load (a step-N dir with a valid "
                                    f"{MARKER} marker in {path / CHECKPOINTS})")
        latest = complete[-1][1]
        if best is not None:
            step_dir = path / CHECKPOINTS / step_dir_name(best["step"])
            if step_dir in (d for _, d in complete):
                return step_dir, path
            _warn(f"{path / BEST_FILE} names {step_dir.name}, which is not a complete checkpoint; using the "
                  f"latest, {latest.name}")
        return latest, path
    run_dir = path.parent.parent
    if not _STEP_DIR.match(path.name) or not (run_dir / CONFIG_FILE).is_file():
        raise ValueError(f"{path} is neither a run directory (with {CONFIG_FILE}) nor a checkpoint in one")
    check_marker(path)
    return path, run_dir


def _warn(message: str) -> None:
    print(f"genrec: warning: {message}", file=sys.stderr, flush=True)


def load_trained(path: str | Path, *, overrides: dict | None = None) -> tuple[JobConfig, GenerativeRecommender]:
    """The run's config and its model with the checkpoint's weights and rows, in eval mode."""
    step_dir, run_dir = resolve_checkpoint(path)
    marker = check_marker(step_dir)
    raw = json.loads((run_dir / CONFIG_FILE).read_text())
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update(values)
    cfg = from_dict(JobConfig, raw)
    # The model is built from the run's config.json: a step saved under other shapes (copied
    # in from another run) is named here, key by key, before it fails inside load_state_dict.
    check_fingerprint(marker["config_fingerprint"], config_fingerprint(cfg), step_dir)
    cfg.sparse.ssd_dir = None  # a private temporary SSD tier, never the training run's
    model, store = build_model(cfg, single_process())
    model = unwrap(model)
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
