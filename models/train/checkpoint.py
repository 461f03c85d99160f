"""Atomic, verified, multi-rank training checkpoints; RNG capture; stop signals.

The layout is `models/runs.py`'s (the read side, shared with evaluation and export).
Every rank writes into the one temp dir; after all ranks have fsynced and reported their
checksums, rank 0 writes COMPLETE last and renames the temp dir to step-N. A step dir
without a valid COMPLETE is never trusted, so `kill -9` at any moment leaves the previous
checkpoint as `latest()`. A save in progress (or killed) lives under `.tmp-...` and is
removed by the next save. A save that fails (a full disk: ENOSPC) raises
`CheckpointWriteError` on every rank, naming the checkpoint and the earlier one that stays
the latest, and its partial files are removed at once.

Usage in a training loop:

    ckpt = CheckpointManager(run_dir / "checkpoints", keep_last=3, rank=rank, world_size=world)
    fingerprint = {"model.dim": 64, "model.num_layers": 2, "data.max_seq_len": 200}
    if (path := ckpt.latest(required=cfg.resume)) is not None:
        dense, rank_state = ckpt.load(path, config_fingerprint=fingerprint)
        model.load_state_dict(dense["model"]); optimizer.load_state_dict(dense["optimizer"])
        restore_rng_state(rank_state["rng"]); step = rank_state["step"]
        store.load_snapshot(str(sparse_snapshot_dir(path)))  # models.runs.sparse_snapshot_dir
    stop = install_stop_signals()
    while step < total_steps:
        ...
        if step % every == 0 or stop.should_stop():
            ckpt.save(
                step,
                dense_state={"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                rank_state={"step": step, "loader": loader.state_dict(), "rng": capture_rng_state()},
                write_shared=lambda d: store.save_snapshot(str(d / "sparse")),  # -> files written
                config_fingerprint=fingerprint,
            )
            if stop.should_stop(): break

`save` and `StopFlag.should_stop` are collective when torch.distributed is initialized:
every rank must call them at the same step. `load` reads dense.pt and this rank's own
directory only, and checks the sizes of the shared files (whose owner, e.g. the sparse
snapshot, reads and verifies them under any world size). A checkpoint saved by N ranks
loads on M: the dense state is replicated and every rank takes rank 0's rank_state.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from genrec.data.files import fsync_path, sha256_file
from genrec.models.ranks import any_rank
from genrec.models.runs import (
    DENSE_FILE, FORMAT_VERSION, MARKER, RANK_STATE_FILE, TMP_PREFIX, check_fingerprint, check_marker,
    complete_steps, latest_checkpoint, plain_json, rank_dir_name, shared_dir, step_dir_name, verify_file,
    verify_shared,
)


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            # torch's zip writer turns a failed write of the file (a full disk) into a
            # RuntimeError ("unexpected pos"); the OSError it hit is its context.
            if isinstance(e.__context__, OSError):
                raise e.__context__ from None
            raise
        f.flush()
        os.fsync(f.fileno())


_PLAIN = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)


def _check_weights_only(obj: Any, where: str) -> None:
    """Refuse at save time what `torch.load(weights_only=True)` would refuse at resume time."""
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; use str or int keys")
            _check_weights_only(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_weights_only(v, f"{where}[{i}]")
    else:
        raise TypeError(
            f"{where} is a {type(obj).__name__}; checkpoints hold only tensors, numbers, "
            "strings, None, lists, tuples and dicts (they load with weights_only=True)"
        )


FAULT_ENV = "GENREC_FAULT_AT"
"""Fault-injection hook for tests: `GENREC_FAULT_AT=WHERE:STEP` makes the process kill itself
with SIGKILL at that point (`fault_point`), as a crash or an OOM kill would."""


def fault_point(where: str, step: int) -> None:
    """SIGKILL this process here if `$GENREC_FAULT_AT` is `where:step` (unset: a no-op). Points:
    `step` (after a training step, before its checkpoint) and, inside `CheckpointManager.save`,
    `save-dense` (dense.pt written), `save-shared` (the sparse snapshot written, nothing
    checksummed yet), `save-marker` (COMPLETE written, not yet in place) and `save-published`
    (renamed into place, older ones not yet pruned)."""
    if os.environ.get(FAULT_ENV) == f"{where}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, an I/O error). Its partial files were
    removed; the previous complete checkpoint stays the latest, and a resume starts there."""

    def __init__(self, cause: OSError, path: Path, previous: Path | None) -> None:
        full = cause.errno in _DISK_FULL
        what = "the disk is full (no space left on device)" if full else f"{cause}"
        where = f" writing {cause.filename}" if full and cause.filename else ""
        kept = f"{previous} stays the latest complete checkpoint" if previous else "there is no earlier checkpoint"
        advice = "; free space and resume" if full else ""
        super().__init__(cause.errno, f"checkpoint {path} could not be written: {what}{where}; the partial "
                                      f"checkpoint was removed and {kept}{advice}")


class CheckpointManager:
    """Saves and finds checkpoints under `root_dir`; see the module docstring."""

    def __init__(self, root_dir: str | Path, *, keep_last: int = 3, rank: int, world_size: int) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if world_size > 1 and not _dist_on():
            raise ValueError(f"world_size {world_size} needs torch.distributed initialized")
        if _dist_on() and (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"rank/world_size {rank}/{world_size} differ from torch.distributed's "
                f"{dist.get_rank()}/{dist.get_world_size()}"
            )
        self.root = Path(root_dir)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.pinned: set[int] = set()
        """Steps never pruned (the best-validation checkpoint), beside the last `keep_last`."""
        self.root.mkdir(parents=True, exist_ok=True)

    # ---- paths -------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def rank_dir(self, path: str | Path) -> Path:
        """This rank's subdirectory of a checkpoint."""
        return Path(path) / rank_dir_name(self.rank, self.world_size)

    def extra_dir(self, path: str | Path) -> Path:
        """Where `write_extra` wrote this rank's files (e.g. the sparse store snapshot)."""
        return self.rank_dir(path) / "extra"

    def complete_steps(self) -> list[tuple[int, Path]]:
        """(step, dir) of every checkpoint with a valid marker, oldest first."""
        return complete_steps(self.root)

    def latest(self, *, required: bool = False) -> Path | None:
        """The newest complete checkpoint, or None (`required=True`: FileNotFoundError)."""
        return latest_checkpoint(self.root, required=required)

    # ---- save --------------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        dense_state: dict[str, Any] | None,
        rank_state: dict[str, Any],
        write_extra: Callable[[Path], None] | None = None,
        write_shared: Callable[[Path], list[str]] | None = None,
        config_fingerprint: dict[str, object],
    ) -> Path:
        """Write checkpoint `step` atomically on every rank and return its directory.

        dense_state: rank 0's model/optimizer/scheduler state dicts (ignored elsewhere).
        rank_state: this rank's loader position, RNG states, step, ... (tensors and
            plain values only, so loading never unpickles code).
        write_extra: called with this rank's empty `extra/` dir to write more files.
        write_shared: called on every rank (collectively) with the checkpoint's `shared/`
            dir, which all ranks write together; returns the files this rank wrote there,
            which this rank then fsyncs and checksums into the marker.
        config_fingerprint: flat {config key: value} of everything that must match on
            resume (model shapes, tables, world layout); JSON values only.
        """
        if self.rank == 0:
            if dense_state is None:
                raise ValueError("rank 0 must pass dense_state to CheckpointManager.save")
            _check_weights_only(dense_state, "dense_state")
        _check_weights_only(rank_state, "rank_state")
        fingerprint = plain_json(config_fingerprint)

        tmp = self._make_tmp_dir(step)
        final = self.step_dir(step)
        manifest: dict[str, dict[str, object]] = {}
        failure: OSError | None = None
        try:
            self._write_files(tmp, step, dense_state, rank_state, write_extra, manifest)
        except OSError as e:  # e.g. a full disk: every rank must learn it at the gather below
            failure = e
        if write_shared is not None:
            # write_shared holds collectives of its own (the sparse snapshot's): every rank
            # calls it, or none does when any rank's own files failed (rank 0's dense.pt).
            # The agreement doubles as the barrier: the folder exists before anyone writes there.
            shared = shared_dir(tmp)
            if failure is None:
                try:
                    shared.mkdir(exist_ok=True)
                except OSError as e:
                    failure = e
            if not any_rank(failure is not None):
                try:
                    self._write_shared(tmp, step, shared, write_shared, manifest)
                except OSError as e:
                    failure = e

        # The gather doubles as the barrier: no rank reports until its files are durable.
        mine = {"files": manifest, "error": None if failure is None else (failure.errno, str(failure))}
        reports = [mine]
        if _dist_on():
            reports = [None] * self.world_size
            dist.all_gather_object(reports, mine)
        try:
            errors = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"] is not None]
            if errors:
                rank, (code, text) = errors[0]
                raise failure or OSError(code, f"rank {rank}: {text}")
            if self.rank == 0:
                try:
                    self._publish(tmp, final, step, fingerprint,
                                  {k: v for rep in reports for k, v in rep["files"].items()})
                except OSError as e:  # its marker on a full disk: the other ranks learn it just below
                    failure = e
            if _dist_on():
                # Rank 0 alone publishes; every rank waits here for its outcome, so that all
                # raise together instead of the others waiting for rank 0 in the barrier below.
                box = [None if failure is None else (failure.errno, str(failure))]
                dist.broadcast_object_list(box, src=0)
                if box[0] is not None and failure is None:
                    failure = OSError(box[0][0], f"rank 0: {box[0][1]}")
            if failure is not None:
                raise failure
        except OSError as e:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # never trusted (no marker), and it frees the space
            raise CheckpointWriteError(e, final, self.latest()) from e
        if self.rank == 0:
            self.prune()
        if _dist_on():
            dist.barrier()  # nobody returns before the checkpoint is visible
        return final

    def _write_files(self, tmp: Path, step: int, dense_state, rank_state, write_extra,
                     manifest: dict[str, dict[str, object]]) -> None:
        """This rank's own files of checkpoint `step` into `tmp`, fsynced; their sizes and
        sha256 into `manifest`."""
        if self.rank == 0:
            _torch_save(dense_state, tmp / DENSE_FILE)
            fault_point("save-dense", step)
        rank_dir = self.rank_dir(tmp)
        (rank_dir / "extra").mkdir(parents=True)
        _torch_save(rank_state, rank_dir / RANK_STATE_FILE)
        if write_extra is not None:
            write_extra(rank_dir / "extra")
        mine = [tmp / DENSE_FILE] if self.rank == 0 else []
        mine += sorted(p for p in rank_dir.rglob("*") if p.is_file())
        self._checksum(tmp, mine, manifest)

    def _write_shared(self, tmp: Path, step: int, shared: Path, write_shared, manifest) -> None:
        """The files this rank writes into the checkpoint's `shared/` dir (collective)."""
        mine = []
        for f in write_shared(shared):
            f = Path(f)
            if not f.is_file() or shared.resolve() not in f.resolve().parents:
                raise ValueError(f"write_shared reported {f}, which is not a file under {shared}")
            mine.append(f)
        fault_point("save-shared", step)
        self._checksum(tmp, mine, manifest)

    @staticmethod
    def _checksum(tmp: Path, mine: list[Path], manifest: dict[str, dict[str, object]]) -> None:
        # Checksums are computed by the rank that wrote the files, in parallel.
        for p in mine:
            fsync_path(p)  # extra files were written by other code, maybe without fsync
            manifest[p.relative_to(tmp).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for d in sorted({p.parent for p in mine}):
            fsync_path(d)

    def _publish(self, tmp: Path, final: Path, step: int, fingerprint: dict[str, object],
                 files: dict[str, dict[str, object]]) -> None:
        """Rank 0: write the COMPLETE marker last, then rename `tmp` to `final`."""
        marker = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": self.world_size,
            "created_unix": time.time(),
            "torch_version": torch.__version__,
            "config_fingerprint": fingerprint,
            "config_sha256": hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest(),
            "files": files,
        }
        with open(tmp / (MARKER + ".partial"), "w") as f:
            json.dump(marker, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fault_point("save-marker", step)
        os.replace(tmp / (MARKER + ".partial"), tmp / MARKER)
        fsync_path(tmp)
        replaced = None
        if final.exists():  # re-saving a step (resumed from an older one): move the old aside
            replaced = self.root / f"{TMP_PREFIX}replaced-{final.name}-{os.getpid()}"
            os.replace(final, replaced)
        try:
            os.replace(tmp, final)
        except OSError:
            if replaced is not None:
                os.replace(replaced, final)  # the step's earlier copy stays
            raise
        fsync_path(self.root)
        fault_point("save-published", step)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)

    def _make_tmp_dir(self, step: int) -> Path:
        name = None
        if self.rank == 0:
            # Anything left under a temp name is a save that died (or a pruned dir that was
            # not fully deleted): no save is running now, since every rank is here.
            for p in self.root.iterdir():
                if p.name.startswith(TMP_PREFIX):
                    shutil.rmtree(p, ignore_errors=True)
            name = f"{TMP_PREFIX}step-{step:08d}-{os.getpid()}"
            (self.root / name).mkdir()
        if _dist_on():
            box = [name]
            dist.broadcast_object_list(box, src=0)
            name = box[0]
        return self.root / name

    def prune(self) -> None:
        """Remove complete checkpoints beyond the last `keep_last`, except pinned ones (rank 0)."""
        for step, p in self.complete_steps()[: -self.keep_last]:
            if step in self.pinned:
                continue
            # Rename first: a half-deleted dir must not keep looking like a checkpoint.
            doomed = self.root / f"{TMP_PREFIX}delete-{p.name}"
            os.replace(p, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    # ---- load --------------------------------------------------------------------------
    def load(
        self, path: str | Path, *, config_fingerprint: dict[str, object]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Verify and load (dense_state, this rank's rank_state), both on CPU.

        Saved by another world size (an elastic restart on more or fewer ranks), every rank
        reads rank 0's rank_state: the ranks of a synchronous run hold the same step, loader
        position and (one seed everywhere) RNG streams; the dense state is replicated, and
        the shared files' owners (the sparse snapshot) reshard themselves.

        Raises ValueError when a fingerprint key differs, and CorruptCheckpoint when the
        marker is missing or malformed or a file it reads (dense.pt, the rank's state) is
        missing or fails its checksum. Files of `extra_dir(path)` are verified too; the
        caller reads them itself.
        """
        path = Path(path)
        marker = check_marker(path)
        check_fingerprint(marker["config_fingerprint"], config_fingerprint, path)

        saved_world = marker["world_size"]
        rank = self.rank if saved_world == self.world_size else 0
        prefix = rank_dir_name(rank, saved_world) + "/"
        mine = {k: v for k, v in marker["files"].items() if k == DENSE_FILE or k.startswith(prefix)}
        for rel, meta in sorted(mine.items()):
            verify_file(path / rel, meta)
        verify_shared(path, marker, checksum=False)  # read and CRC-checked by their owner, under any world size
        dense = torch.load(path / DENSE_FILE, map_location="cpu", weights_only=True)
        rank_state = torch.load(path / prefix / RANK_STATE_FILE, map_location="cpu", weights_only=True)
        return dense, rank_state


# ---- RNG ---------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """Python, numpy (global), torch CPU and CUDA generator states, as tensors and numbers
    only, so they survive `torch.load(weights_only=True)`."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    assert np_kind == "MT19937"
    state = {
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss_next": py_gauss},
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`. CUDA states are restored only when CUDA is present
    with the same device count (a CPU resume of a GPU run keeps CPU determinism only)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


# ---- stop signals ------------------------------------------------------------------------
class StopFlag:
    """Set by SIGTERM/SIGINT; the loop polls it, checkpoints, and exits cleanly."""

    POLL_SECONDS = 1.0
    """Under torch.distributed, the ranks agree on a stop about this often (see should_stop)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        self._until_poll = 1  # the first call polls
        self._since_poll = 0
        self.polls = 0
        self._polled_at = time.perf_counter()

    @property
    def requested(self) -> bool:
        """Whether this process got a stop signal."""
        return self.signal_name is not None

    def should_stop(self) -> bool:
        """Whether any rank got a stop signal (called once per step). Under torch.distributed
        the ranks must agree, so that they all checkpoint and stop at the same step: an
        all-reduce, but not every step (one more collective where the ranks wait for each
        other): every call until the next poll returns False on every rank, and each poll
        also agrees on when the next one is, after the steps the slowest rank ran in about
        POLL_SECONDS since the last one (every step where steps take longer)."""
        if not _dist_on():
            return self.requested
        self._since_poll += 1
        self._until_poll -= 1
        if self._until_poll > 0:
            return False
        now = time.perf_counter()
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([int(self.requested), int((now - self._polled_at) * 1e6)], dtype=torch.int64,
                            device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.polls += 1
        stop, slowest_us = (int(x) for x in flag.tolist())
        step_s = max(slowest_us * 1e-6 / self._since_poll, 1e-6)
        self._until_poll = max(1, min(1000, int(self.POLL_SECONDS / step_s)))
        self._since_poll, self._polled_at = 0, now
        return bool(stop)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            self.restore()
            raise KeyboardInterrupt  # second Ctrl-C: stop now, without a checkpoint
        self.signal_name = signal.Signals(signum).name
        print(f"genrec: got {self.signal_name}; checkpointing and stopping "
              "(Ctrl-C again to exit at once)", file=sys.stderr, flush=True)

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def install_stop_signals() -> StopFlag:
    """Route SIGTERM and SIGINT into a `StopFlag` (main thread only)."""
    flag = StopFlag()
    for signum in (signal.SIGTERM, signal.SIGINT):
        flag._previous[signum] = signal.signal(signum, flag._handle)
    return flag
