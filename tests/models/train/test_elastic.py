"""Parallel layouts: a checkpoint of N ranks resumes on M (1 <-> 2 <-> 4 gloo ranks) and
still ends its epochs where the rows run out; FSDP2 trains like DDP, and their checkpoints
resume under each other; two `torchrun` launchers on loopback (2 nodes x 1 process, c10d
rendezvous) train exactly like 1 node x 2 processes, and when one of them is killed under
`--nnodes 1:2`, the other re-forms the job alone and resumes it on one rank."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from genrec.models.config import JobConfig
from genrec.models.config_loader import to_dict
from test_train import _run_training, _spawn
from train_helpers import free_port, tiny_config


def _train(world_size: int, cfg: JobConfig) -> None:
    _spawn(_run_training, world_size, json.dumps(to_dict(cfg)))


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _logged_steps(run_dir: Path) -> list[int]:
    return [rec["step"] for rec in _records(run_dir) if "loss" in rec]


def _rank_dirs(checkpoint: Path) -> list[str]:
    return sorted(p.name for p in checkpoint.iterdir() if p.name.startswith("rank-"))


def test_two_rank_checkpoint_resumes_on_one_rank_to_the_end_of_its_epoch(prepared, tmp_path):
    run = tmp_path / "run"
    _train(2, tiny_config(prepared, run, max_steps=3, checkpoint_every=3))
    assert _rank_dirs(run / "checkpoints" / "step-00000003") == ["rank-00000-of-00002", "rank-00001-of-00002"]
    # One epoch on 1 rank: the 2 ranks read 2 x 3 batches of 8 rows; the rest of the epoch
    # is every row they had not read, in batches of 8 on the one rank that is left.
    _train(1, tiny_config(prepared, run, num_epochs=1, checkpoint_every=100))
    rows = json.loads((prepared / "manifest.json").read_text())["counts"]["rows"]["train"]
    last = 3 + math.ceil((rows - 2 * 3 * 8) / 8)
    assert _logged_steps(run) == list(range(1, last + 1))
    assert _rank_dirs(run / "checkpoints" / f"step-{last:08d}") == ["rank-00000-of-00001"]
    assert json.loads((run / "config.json").read_text())["train"]["max_steps"] == last


def test_a_resized_run_resumed_again_on_its_new_world_still_ends_after_its_epochs(prepared, tmp_path):
    """The end a resize lays for `train.num_epochs` (epoch 0 begun by 2 ranks, ended by 1) is
    laid again from the loader's position at the next resume on 1 rank: counted from step 0
    on 1 rank, the run would go on past its 2 epochs, on another cosine schedule."""
    run = tmp_path / "run"
    _train(2, tiny_config(prepared, run, max_steps=3, checkpoint_every=3))
    cfg = tiny_config(prepared, run, num_epochs=2, checkpoint_every=4)
    _train(1, cfg)
    last = json.loads((run / "config.json").read_text())["train"]["max_steps"]
    want = dict(zip(_logged_steps(run), _losses(run)))
    # A crash after the checkpoint before the last, in epoch 1: the 1-rank plan's own.
    shutil.rmtree(max((run / "checkpoints").glob("step-*")))
    _train(1, cfg)
    got = dict(zip(_logged_steps(run), _losses(run)))  # each step's last logged loss
    assert max(got) == last and got == want
    assert json.loads((run / "config.json").read_text())["train"]["max_steps"] == last


def test_one_rank_checkpoint_resumes_on_four_ranks(prepared, tmp_path):
    run = tmp_path / "run"
    _train(1, tiny_config(prepared, run, max_steps=2, checkpoint_every=2))
    _train(4, tiny_config(prepared, run, max_steps=4, checkpoint_every=2))
    assert _logged_steps(run) == [1, 2, 3, 4]
    assert _rank_dirs(run / "checkpoints" / "step-00000004") == [f"rank-0000{r}-of-00004" for r in range(4)]
    # And back to 2 ranks from the 4-rank checkpoint.
    _train(2, tiny_config(prepared, run, max_steps=5, checkpoint_every=5))
    assert _logged_steps(run) == [1, 2, 3, 4, 5]


def _losses(run_dir: Path) -> list[float]:
    return [rec["loss"] for rec in _records(run_dir) if "loss" in rec]


def _validations(run_dir: Path) -> dict[int, float]:
    return {rec["step"]: rec["valid/ndcg@10"] for rec in _records(run_dir) if "valid/ndcg@10" in rec}


def test_fsdp2_trains_like_ddp_and_their_checkpoints_resume_under_each_other(prepared, tmp_path):
    def cfg(run, parallel, steps):
        # A constant learning rate: the legs below stop at 10, 15 and 20, and a schedule
        # laid over each leg's max_steps would differ from the one laid over 20.
        return tiny_config(prepared, run, max_steps=steps, checkpoint_every=5, eval_every=10,
                           dense_parallel=parallel, optim={"warmup_steps": 0, "min_lr_ratio": 1.0})

    ddp = tmp_path / "ddp"
    _train(2, cfg(ddp, "ddp", 20))
    # 20 steps as FSDP2 -> DDP -> FSDP2, each resuming the other's checkpoint.
    mixed = tmp_path / "mixed"
    for parallel, steps in (("fsdp2", 10), ("ddp", 15), ("fsdp2", 20)):
        _train(2, cfg(mixed, parallel, steps))
    assert len(_losses(ddp)) == 20
    # The golden test's tolerance: the same math, summed in another order.
    assert _losses(mixed) == pytest.approx(_losses(ddp), rel=1e-4)
    # Validation scores through the gathered weights (each leg also validates at its end).
    ddp_valid, mixed_valid = _validations(ddp), _validations(mixed)
    assert sorted(ddp_valid) == [10, 20] and sorted(mixed_valid) == [10, 15, 20]
    assert [mixed_valid[10], mixed_valid[20]] == pytest.approx([ddp_valid[10], ddp_valid[20]], rel=1e-4)


_LAUNCHED = """
import json, sys
from genrec.models.config import JobConfig
from genrec.models.config_loader import from_dict
from genrec.models.train.trainer import run_training
run_training(from_dict(JobConfig, json.loads(open(sys.argv[1]).read())))
"""


def _torchrun(script: Path, cfg: JobConfig, cfg_path: Path, *launcher: str) -> subprocess.Popen:
    cfg_path.write_text(json.dumps(to_dict(cfg)))
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, str(script), str(cfg_path)]
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_two_launchers_on_loopback_train_like_one_node(prepared, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_LAUNCHED)
    single = _torchrun(script, tiny_config(prepared, tmp_path / "one", max_steps=4, num_threads=1),
                       tmp_path / "one.json", "--nnodes", "1", "--nproc-per-node", "2",
                       "--master-port", str(free_port()))
    out = single.communicate(timeout=300)[0]
    assert single.returncode == 0, out
    endpoint = f"127.0.0.1:{free_port()}"
    cfg = tiny_config(prepared, tmp_path / "two", max_steps=4, num_threads=1)
    nodes = [_torchrun(script, cfg, tmp_path / "two.json", "--nnodes", "2", "--nproc-per-node", "1",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "genrec-test")
             for _ in range(2)]
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs
    assert len(_losses(tmp_path / "one")) == 4
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-6, abs=1e-7)


def _kill_tree(pid: int) -> None:
    """SIGKILL pid and its descendants, parents first (torchrun starts its workers in
    sessions of their own, so a process group would miss them)."""
    todo = [pid]
    while todo:
        p = todo.pop()
        children = []
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children += [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # gone meanwhile
                pass
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
        todo += children


def test_a_lost_node_leaves_the_other_to_resume_the_job_on_one_rank(prepared, tmp_path):
    """Two launchers under `--nnodes 1:2`; once a 2-rank checkpoint is complete, one
    launcher and its worker are killed (a node lost). The other's worker fails in its next
    collective, its launcher re-forms the job alone (the dead node drops out of the c10d
    rendezvous) and the restarted worker resumes the last complete checkpoint on 1 rank,
    running to max_steps with every step logged once after the resume point."""
    script = tmp_path / "train.py"
    script.write_text(_LAUNCHED)
    run, steps = tmp_path / "run", 400
    cfg = tiny_config(prepared, run, max_steps=steps, checkpoint_every=10, eval_every=0, num_threads=1)
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv = "last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
    launcher = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", "genrec-node-loss"]
    # The survivor hosts the rendezvous store: the lost node must not take it along.
    survivor = _torchrun(script, cfg, tmp_path / "a.json", *launcher, "--rdzv-conf", f"is_host=1,{rdzv}")
    lost = _torchrun(script, cfg, tmp_path / "b.json", *launcher, "--rdzv-conf", f"is_host=0,{rdzv}")
    try:
        first = run / "checkpoints" / "step-00000020"
        deadline = time.monotonic() + 240
        while not (first / "COMPLETE").exists():
            assert survivor.poll() is None and lost.poll() is None, "a launcher ended before the node loss"
            assert time.monotonic() < deadline, "no 2-rank checkpoint in time"
            time.sleep(0.05)
        assert _rank_dirs(first) == ["rank-00000-of-00002", "rank-00001-of-00002"]
        _kill_tree(lost.pid)  # the node's launcher and its worker, at once
        lost.wait(timeout=30)
        try:
            out = survivor.communicate(timeout=300)[0]
        except subprocess.TimeoutExpired:
            _kill_tree(survivor.pid)
            log = [line for line in survivor.communicate()[0].replace("\r", "\n").splitlines() if "train:" not in line]
            pytest.fail("the surviving launcher did not finish:\n" + "\n".join(log[-80:]))
    finally:
        for p in (survivor, lost):
            if p.poll() is None:
                _kill_tree(p.pid)
    assert survivor.returncode == 0, out
    resumed = re.search(r"resumed from \S*step-(\d+) at step (\d+)", out)
    assert resumed and "resumed a 2-rank checkpoint on 1 rank(s)" in out, out
    at = int(resumed.group(2))
    assert 20 <= at < steps
    logged = _logged_steps(run)
    # The first run logged steps up to at least `at` (some maybe past it, replayed after
    # the resume); from the resume on, each step once, to the end.
    tail = logged[len(logged) - (steps - at):]
    assert tail == list(range(at + 1, steps + 1)), logged[-(steps - at) - 5:]
    assert set(range(1, at + 1)) <= set(logged)
    last = run / "checkpoints" / f"step-{steps:08d}"
    assert _rank_dirs(last) == ["rank-00000-of-00001"]
