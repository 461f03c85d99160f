import builtins
import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from train_helpers import FullDisk, free_port

from genrec.models.train import checkpoint as checkpoint_module
from genrec.models.train.checkpoint import (
    MARKER,
    CheckpointManager,
    CheckpointWriteError,
    capture_rng_state,
    install_stop_signals,
    restore_rng_state,
)

FP = {"model.dim": 8, "model.num_layers": 2, "sparse.tables": ["item", "action"]}


def _dense(scale: float) -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(scale)
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _save(mgr: CheckpointManager, step: int, **kw) -> Path:
    def extra(d: Path) -> None:
        (d / "shard.bin").write_bytes(bytes(range(256)) * 4)
    args = dict(rank_state={"step": step, "loader": {"file": 3, "row": 17}},
                write_extra=extra, config_fingerprint=FP)
    args.update(kw)
    if "dense_state" not in args:
        args["dense_state"] = _dense(step)
    return mgr.save(step, **args)


def test_round_trip_and_layout(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    assert mgr.latest() is None
    path = _save(mgr, 7)
    assert path == tmp_path / "step-00000007" and mgr.latest() == path
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    marker = json.loads((path / MARKER).read_text())
    assert marker["step"] == 7 and marker["world_size"] == 1
    assert set(marker["files"]) == {"dense.pt", "rank-00000-of-00001/state.pt",
                                    "rank-00000-of-00001/extra/shard.bin"}
    dense, rank_state = mgr.load(path, config_fingerprint=dict(FP))
    assert rank_state == {"step": 7, "loader": {"file": 3, "row": 17}}
    torch.testing.assert_close(dense["model"]["weight"], torch.full((3, 4), 7.0))
    assert dense["optimizer"]["state"][0]["exp_avg"].shape == (3, 4)
    assert (mgr.extra_dir(path) / "shard.bin").read_bytes() == bytes(range(256)) * 4


def test_shared_files_are_in_the_layout_and_checksummed(tmp_path: Path) -> None:
    from genrec.models.runs import load_trained, shared_dir, verify_shared

    def shared(d: Path) -> list[Path]:
        (d / "sparse").mkdir()
        (d / "sparse" / "t.rank0.rows.bin").write_bytes(b"rows" * 64)
        return [d / "sparse" / "t.rank0.rows.bin"]

    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    path = _save(mgr, 3, write_shared=shared)
    marker = json.loads((path / MARKER).read_text())
    meta = marker["files"]["shared/sparse/t.rank0.rows.bin"]
    assert meta["bytes"] == 256 and len(meta["sha256"]) == 64
    verify_shared(path, marker, checksum=True)
    rows = shared_dir(path) / "sparse" / "t.rank0.rows.bin"
    rows.write_bytes(b"ROWS" * 64)  # same size, other bytes: only the checksum sees it
    mgr.load(path, config_fingerprint=dict(FP))  # the owner (the snapshot's CRCs) checks content
    with pytest.raises(ValueError, match="corrupt or truncated"):
        verify_shared(path, marker, checksum=True)
    rows.write_bytes(b"rows")  # truncated: every load refuses it
    with pytest.raises(ValueError, match="corrupt or truncated"):
        mgr.load(path, config_fingerprint=dict(FP))
    with pytest.raises(ValueError, match="neither a run directory"):
        load_trained(path)  # a bare checkpoint outside a run directory

    def outside(d: Path) -> list[Path]:
        (tmp_path / "elsewhere.bin").write_bytes(b"x")
        return [tmp_path / "elsewhere.bin"]

    with pytest.raises(ValueError, match="not a file under"):
        _save(mgr, 4, write_shared=outside)
    assert mgr.latest() == path


def test_rng_state_survives_weights_only_checkpoint(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    _save(mgr, 1, dense_state={}, rank_state={"rng": capture_rng_state()})
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    _, rank_state = mgr.load(mgr.latest(), config_fingerprint=FP)
    restore_rng_state(rank_state["rng"])
    got = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3))
    assert got[:4] == expected[:4]
    torch.testing.assert_close(got[4], expected[4])


def test_corrupt_or_truncated_file_is_refused_by_name(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    path = _save(mgr, 1)
    dense = path / "dense.pt"
    data = bytearray(dense.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped bit pattern
    dense.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="dense.pt is corrupt"):
        mgr.load(path, config_fingerprint=FP)

    path = _save(mgr, 2)
    shard = mgr.extra_dir(path) / "shard.bin"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match="shard.bin is corrupt or truncated"):
        mgr.load(path, config_fingerprint=FP)
    shard.unlink()
    with pytest.raises(ValueError, match="shard.bin is missing"):
        mgr.load(path, config_fingerprint=FP)


def test_config_and_world_size_mismatch_name_what_differs(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    path = _save(mgr, 1)
    changed = dict(FP, **{"model.dim": 16, "model.heads": 2})
    del changed["model.num_layers"]
    with pytest.raises(ValueError) as e:
        mgr.load(path, config_fingerprint=changed)
    msg = str(e.value)
    assert "model.dim: checkpoint 8, now 16" in msg
    assert "model.heads: not in the checkpoint" in msg
    assert "model.num_layers: checkpoint 2, missing" in msg
    # A tuple in the current config equals the list stored in the json marker.
    mgr.load(path, config_fingerprint=dict(FP, **{"sparse.tables": ("item", "action")}))

    marker = json.loads((path / MARKER).read_text())
    marker["world_size"] = 2
    (path / MARKER).write_text(json.dumps(marker))
    # Another world size reads rank 0's state of the saved one (which this marker lacks).
    with pytest.raises(ValueError, match="lists no .*rank-00000-of-00002"):
        mgr.load(path, config_fingerprint=FP)


def test_keep_last_prunes_only_after_the_new_one_is_complete(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2, rank=0, world_size=1)
    for step in (10, 20, 30):
        _save(mgr, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000030"]

    def boom(d: Path) -> None:
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        _save(mgr, 40, write_extra=boom)
    # The failed save pruned nothing and is not visible; the next save cleans its temp dir.
    assert [s for s, _ in mgr.complete_steps()] == [20, 30]
    _save(mgr, 50)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030", "step-00000050"]


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 0.8, 0.999])
def test_disk_full_during_a_save_is_clear_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fraction):
    counting = FullDisk(budget=1 << 62)  # how many bytes a save writes through `open`
    monkeypatch.setattr(checkpoint_module, "open", counting, raising=False)
    _save(CheckpointManager(tmp_path / "dry", rank=0, world_size=1), 2)
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, keep_last=1, rank=0, world_size=1)
    monkeypatch.setattr(checkpoint_module, "open", builtins.open, raising=False)
    first = _save(mgr, 1)

    disk = FullDisk(budget=int(fraction * counting.written))
    monkeypatch.setattr(checkpoint_module, "open", disk, raising=False)
    with pytest.raises(CheckpointWriteError) as err:
        _save(mgr, 2)
    assert disk.failed_on is not None and err.value.errno == errno.ENOSPC
    message = str(err.value)
    assert str(mgr.step_dir(2)) in message and "disk is full" in message and str(first) in message
    # Nothing half-written is left to trust (or to hold the space), nothing was pruned.
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]
    monkeypatch.setattr(checkpoint_module, "open", builtins.open, raising=False)
    dense, rank_state = mgr.load(mgr.latest(), config_fingerprint=FP)
    assert rank_state["step"] == 1 and torch.equal(dense["model"]["weight"], torch.full((3, 4), 1.0))
    assert _save(mgr, 2) == mgr.latest()  # with space again, the same save goes through


def test_resave_of_an_existing_step_replaces_it(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    _save(mgr, 5)
    _save(mgr, 5, rank_state={"step": 5, "again": True})
    assert mgr.load(mgr.latest(), config_fingerprint=FP)[1]["again"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005"]


def test_untrusted_dirs_and_required_resume(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    (tmp_path / "step-00000009").mkdir()  # no marker
    (tmp_path / ".tmp-step-00000010-123").mkdir()
    assert mgr.latest() is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        mgr.latest(required=True)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        mgr.load(tmp_path / "step-00000009", config_fingerprint=FP)


def test_non_plain_state_is_refused_at_save_time(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, rank=0, world_size=1)
    with pytest.raises(TypeError, match=r"rank_state\['loader'\]\['gen'\] is a Generator"):
        _save(mgr, 1, rank_state={"loader": {"gen": torch.Generator()}})
    assert mgr.latest() is None


_CHILD = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from genrec.models.train.checkpoint import CheckpointManager
    root, mode = Path(sys.argv[1]), sys.argv[2]
    mgr = CheckpointManager(root, keep_last=2, rank=0, world_size=1)
    def slow(d):
        (d / "part.bin").write_bytes(b"x" * 4096)
        (root.parent / "ready").touch()
        time.sleep(120)
    fp = {"model.dim": 8}
    if mode == "stall":
        mgr.save(2, dense_state={"w": torch.full((64,), 2.0)}, rank_state={"step": 2},
                 write_extra=slow, config_fingerprint=fp)
    else:  # save as fast as possible until killed, so the kill lands anywhere in a save
        step = 2
        while True:
            mgr.save(step, dense_state={"w": torch.full((50_000,), float(step))},
                     rank_state={"step": step}, config_fingerprint=fp)
            (root.parent / "ready").touch()
            step += 1
""")


def _run_and_kill(tmp_path: Path, mode: str, extra_delay_s: float) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "ckpt"), mode])
    deadline = time.monotonic() + 120
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None, "child died before it was killed"
        assert time.monotonic() < deadline, "child never reached the save"
        time.sleep(0.05)
    time.sleep(extra_delay_s)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


def test_kill_9_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2, rank=0, world_size=1)
    mgr.save(1, dense_state={"w": torch.ones(64)}, rank_state={"step": 1}, config_fingerprint={"model.dim": 8})
    _run_and_kill(tmp_path, "stall", 0.0)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names[0].startswith(".tmp-step-00000002-") and names[1:] == ["step-00000001"]
    dense, rank_state = mgr.load(mgr.latest(), config_fingerprint={"model.dim": 8})
    assert rank_state["step"] == 1 and torch.equal(dense["w"], torch.ones(64))
    mgr.save(3, dense_state={"w": torch.ones(64)}, rank_state={"step": 3}, config_fingerprint={"model.dim": 8})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000001", "step-00000003"]


def test_kill_9_at_a_random_point_of_back_to_back_saves(tmp_path: Path) -> None:
    _run_and_kill(tmp_path, "loop", random.uniform(0.0, 0.3))
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2, rank=0, world_size=1)
    path = mgr.latest(required=True)
    dense, rank_state = mgr.load(path, config_fingerprint={"model.dim": 8})  # checksums verified
    assert torch.equal(dense["w"], torch.full((50_000,), float(rank_state["step"])))


def test_stop_signals(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the test runs in the background
    stop = install_stop_signals()
    try:
        assert not stop.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # python runs the handler between bytecodes
        assert stop.should_stop() and stop.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        assert signal.getsignal(signal.SIGINT) == before  # handlers restored
    finally:
        stop.restore()


def _two_rank_worker(rank: int, root: str, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mgr = CheckpointManager(root, keep_last=1, rank=rank, world_size=2)
        for step in (5, 6):
            mgr.save(
                step,
                dense_state={"w": torch.full((4,), float(step))} if rank == 0 else None,
                rank_state={"rank": rank, "step": step, "rng": capture_rng_state()},
                write_extra=lambda d: (d / f"rows-{rank}.bin").write_bytes(bytes([rank]) * 100),
                config_fingerprint=FP,
            )
        path = mgr.latest(required=True)
        dense, rank_state = mgr.load(path, config_fingerprint=FP)
        stop = install_stop_signals()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is told to stop ...
            time.sleep(0.01)
        stopped = stop.should_stop()  # ... and both ranks learn it at the same step
        stop.restore()
        result = {"path": path.name, "w": dense["w"].tolist(), "rank": rank_state["rank"],
                  "step": rank_state["step"], "stopped": stopped}
        (Path(root).parent / f"result-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _join(ctx, what: str, seconds: float = 150) -> None:
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what} test timed out")


def _stop_poll_worker(rank: int, out: str, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        stop = install_stop_signals()
        stop.POLL_SECONDS = 0.05
        seen = None
        for call in range(400):
            time.sleep(0.004 if rank == 0 else 0.002)  # rank 0 is the slower one
            if rank == 1 and call == 60:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)
            if stop.should_stop():
                seen = call
                break
        stop.restore()
        Path(f"{out}-{rank}.json").write_text(json.dumps({"seen": seen, "polls": stop.polls}))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_a_stop_at_the_same_step_without_polling_every_step(tmp_path: Path) -> None:
    """Only rank 1 is signalled; both ranks see the stop at the same call, within about
    POLL_SECONDS of steps of the slowest rank (here ~12 of 4 ms), having polled (one
    all-reduce each) at a fraction of the calls."""
    _join(mp.spawn(_stop_poll_worker, args=(str(tmp_path / "r"), free_port()), nprocs=2, join=False), "stop poll")
    r0, r1 = (json.loads((tmp_path / f"r-{rank}.json").read_text()) for rank in (0, 1))
    assert r0 == r1, (r0, r1)
    assert 60 <= r0["seen"] <= 60 + 40 and r0["polls"] < r0["seen"] / 3, r0


def test_two_rank_gloo_save_and_load(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _join(mp.spawn(_two_rank_worker, args=(str(root), free_port()), nprocs=2, join=False), "2-rank checkpoint")
    for rank in (0, 1):
        r = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert r == {"path": "step-00000006", "w": [6.0] * 4, "rank": rank, "step": 6, "stopped": True}
    assert sorted(p.name for p in root.iterdir()) == ["step-00000006"]  # keep_last=1 pruned 5
    step_dir = root / "step-00000006"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        MARKER, "dense.pt", "rank-00000-of-00002", "rank-00001-of-00002"]
    files = json.loads((step_dir / MARKER).read_text())["files"]
    assert set(files) == {
        "dense.pt",
        "rank-00000-of-00002/state.pt", "rank-00000-of-00002/extra/rows-0.bin",
        "rank-00001-of-00002/state.pt", "rank-00001-of-00002/extra/rows-1.bin",
    }


def _disk_full_worker(rank: int, root: str, port: int, match: str, budget: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    try:
        mgr = CheckpointManager(root, keep_last=2, rank=rank, world_size=2)

        def shared(d: Path) -> list[str]:  # collective, as the sparse store's snapshot is
            dist.barrier()
            (d / f"part-{rank}.bin").write_bytes(bytes([rank]) * 64)
            dist.barrier()
            return [str(d / f"part-{rank}.bin")]

        def save(step: int) -> Path:
            return mgr.save(step, dense_state={"w": torch.full((4096,), float(step))} if rank == 0 else None,
                            rank_state={"step": step}, write_shared=shared, config_fingerprint=FP)

        save(1)
        if rank == 0:  # only rank 0 writes dense.pt and the marker, and its disk fills up in one
            checkpoint_module.open = FullDisk(budget=budget, match=match)
        try:
            save(2)
            outcome = "saved"
        except CheckpointWriteError as e:
            outcome = "disk full" if "disk is full" in str(e) else str(e)
        if rank == 0:
            del checkpoint_module.open
        path = save(3)  # with space again
        (Path(root).parent / f"full-{rank}.json").write_text(json.dumps({"outcome": outcome, "then": path.name}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("match,budget", [("dense.pt", 1000), (MARKER, 0)], ids=["dense", "marker"])
def test_a_disk_full_on_rank_0_only_fails_the_save_on_every_rank(tmp_path: Path, match: str, budget: int) -> None:
    """The shared writer's collectives must not wait for a rank whose own files already
    failed (dense.pt), nor the other ranks for rank 0 once it fails to publish (the marker,
    written after every rank reported): every rank raises CheckpointWriteError, none times
    out in a collective."""
    root = tmp_path / "ckpt"
    _join(mp.spawn(_disk_full_worker, args=(str(root), free_port(), match, budget), nprocs=2, join=False),
          "disk full", 120)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"full-{rank}.json").read_text()) == {"outcome": "disk full",
                                                                           "then": "step-00000003"}
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000003"]


def _snapshot_disk_full_worker(rank: int, root: str, port: int, failing_rank: int, match: str) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from genrec.sparse import SparseConfig, TableConfig, TieredEmbeddingCollection
    from genrec.sparse import snapshot as snapshot_module

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    try:
        tec = TieredEmbeddingCollection(SparseConfig(tables=[TableConfig(name="item", embedding_dim=4,
                                                                         feature_names=["item_id"])]))
        ids = torch.arange(rank * 50, rank * 50 + 50)
        tec(KeyedJaggedTensor.from_lengths_sync(keys=["item_id"], values=ids, lengths=torch.tensor([50])))[
            "item_id"].values().sum().backward()
        mgr = CheckpointManager(root, keep_last=2, rank=rank, world_size=2)

        def save(step: int) -> Path:
            return mgr.save(step, dense_state={"w": torch.full((4,), float(step))} if rank == 0 else None,
                            rank_state={"step": step}, write_shared=lambda d: tec.save_snapshot(str(d / "sparse")),
                            config_fingerprint=FP)

        save(1)
        if rank == failing_rank:
            snapshot_module.open = FullDisk(budget=0, match=match)
        try:
            save(2)
            outcome = "saved"
        except CheckpointWriteError as e:
            outcome = "disk full" if "disk is full" in str(e) else str(e)
        if rank == failing_rank:
            del snapshot_module.open
        path = save(3)  # with space again
        (Path(root).parent / f"full-{rank}.json").write_text(json.dumps({"outcome": outcome, "then": path.name}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("failing_rank,match", [(1, ".bin"), (0, "MANIFEST")], ids=["shard", "manifest"])
def test_a_disk_full_in_one_rank_s_sparse_snapshot_fails_the_save_on_every_rank(tmp_path, failing_rank, match):
    """The sparse snapshot's own writes, on one rank (a shard file before the snapshot's
    gather, rank 0's manifest after it): every rank raises CheckpointWriteError, none is
    left in one of the snapshot's collectives, and the next save works."""
    root = tmp_path / "ckpt"
    _join(mp.spawn(_snapshot_disk_full_worker, args=(str(root), free_port(), failing_rank, match), nprocs=2,
                   join=False), "snapshot disk full", 120)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"full-{rank}.json").read_text()) == {"outcome": "disk full",
                                                                           "then": "step-00000003"}
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000003"]
