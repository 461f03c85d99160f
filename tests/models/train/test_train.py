"""The real trainer on a tiny synthetic ad log: golden losses, exact resume after kill -9 at
seeded points (inside checkpoint writes too), 2 gloo ranks equal to 1 rank on the same
global batch, and an end-to-end 2-rank run."""

import builtins
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from genrec.data.batch import Batch
from genrec.models.config import JobConfig
from genrec.models.config_loader import from_dict, to_dict
from train_helpers import FullDisk, free_port, tiny_config

GOLDEN = Path(__file__).parents[2] / "assets" / "golden_losses.json"



def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def test_golden_losses(prepared, tmp_path):
    from genrec.models.train.trainer import run_training

    losses = run_training(tiny_config(prepared, tmp_path / "run"))
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    if os.environ.get("GENREC_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"losses": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    # fp32 on CPU; the tolerance covers kernel differences between CPU generations only.
    assert losses == pytest.approx(golden, rel=1e-4), "the math changed: regenerate with GENREC_WRITE_GOLDEN=1 only if intended"


KILL_KINDS = ("step", "save-dense", "save-shared", "save-marker", "save-published")
"""Where `GENREC_FAULT_AT` kills the trainer (models/train/checkpoint.py: fault_point): after
a training step, and at four points inside a checkpoint write."""


def _kill_points(seed: int, *, steps: int, every: int) -> list[str]:
    """One kill per kind, in an order and at steps drawn from `seed`, steps increasing (so
    every restart gets further). Save kinds land on checkpoint steps, "step" between them."""
    rng = random.Random(seed)
    kinds = list(KILL_KINDS)
    rng.shuffle(kinds)
    saves = sorted(rng.sample(range(every, steps, every), len(kinds)))
    return [f"{kind}:{s if kind != 'step' else s - rng.randrange(1, every)}" for kind, s in zip(kinds, saves)]


def _final_state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Dense weights and optimizer state, and every sparse row (with its optimizer state) by
    id, of checkpoint `step`."""
    import numpy as np

    ckpt = run_dir / "checkpoints" / f"step-{step:08d}"
    dense = torch.load(ckpt / "dense.pt", weights_only=True)
    out = {f"dense.{k}": v for k, v in dense["model"].items()}
    out.update({f"adam.{i}.{k}": v for i, st in dense["optimizer"]["state"].items() for k, v in st.items()})
    snapshot = ckpt / "shared" / "sparse"
    manifest = json.loads((snapshot / "MANIFEST.json").read_text())
    for table, meta in manifest["tables"].items():
        for shard in meta["shards"]:
            files = {k: snapshot / f"v{manifest['version']}" / f["file"] for k, f in shard["files"].items()}
            ids = np.fromfile(files["ids"], dtype=np.int64)
            rows = np.fromfile(files["rows"], dtype=np.float32).reshape(len(ids), meta["row_width"])
            order = np.argsort(ids)
            out[f"ids.{table}"], out[f"rows.{table}"] = torch.from_numpy(ids[order]), torch.from_numpy(rows[order])
    return out


def test_kill_9_at_seeded_points_then_resume_matches_uninterrupted(prepared, tmp_path):
    from genrec.models.train.trainer import run_training

    steps, every = 24, 4
    seed = int(os.environ.get("GENREC_FAULT_SEED", "0"))
    points = _kill_points(seed, steps=steps, every=every)
    reference = run_training(tiny_config(prepared, tmp_path / "ref", max_steps=steps, checkpoint_every=every))
    cfg = tiny_config(prepared, tmp_path / "crash", max_steps=steps, checkpoint_every=every)
    config_path = tmp_path / "crash.json"
    config_path.write_text(json.dumps(to_dict(cfg)))
    for point in points:
        env = dict(os.environ, GENREC_FAULT_AT=point)
        proc = subprocess.run([sys.executable, "-c", _RUN_FROM_JSON, str(config_path)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
        assert proc.returncode == -signal.SIGKILL, f"seed {seed}, {point}: not killed there\n{proc.stderr[-2000:]}"
    resumed = run_training(cfg)  # the last restart runs to the end
    first_resumed = steps - len(resumed) + 1
    assert resumed == reference[first_resumed - 1 :], f"seed {seed}, points {points}"  # bit-identical
    logged = _losses(tmp_path / "crash")  # every step's loss, from whichever attempt logged it last
    assert [logged[s] for s in range(1, steps + 1)] == reference, f"seed {seed}, points {points}"
    want, got = _final_state(tmp_path / "ref", steps), _final_state(tmp_path / "crash", steps)
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"seed {seed}, points {points}: {name} differs"


def test_disk_full_at_a_checkpoint_then_resume_from_the_previous_one(prepared, tmp_path, monkeypatch):
    from genrec.models.train import checkpoint as checkpoint_module
    from genrec.models.train.checkpoint import CheckpointWriteError
    from genrec.models.train.trainer import run_training

    reference = run_training(tiny_config(prepared, tmp_path / "ref", max_steps=9, checkpoint_every=3))
    cfg = tiny_config(prepared, tmp_path / "full", max_steps=9, checkpoint_every=3)
    disk = FullDisk(budget=2000, match="step-00000006")  # the disk fills up inside step 6's dense.pt
    monkeypatch.setattr(checkpoint_module, "open", disk, raising=False)
    with pytest.raises(CheckpointWriteError, match="the disk is full") as err:
        run_training(cfg)
    assert disk.failed_on.endswith("dense.pt")
    assert str(tmp_path / "full" / "checkpoints" / "step-00000006") in str(err.value)
    assert str(tmp_path / "full" / "checkpoints" / "step-00000003") in str(err.value)
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == ["step-00000003"]
    monkeypatch.setattr(checkpoint_module, "open", builtins.open, raising=False)
    resumed = run_training(cfg, resume=True)  # from step 3, the one that stayed intact
    assert resumed == reference[3:]
    want, got = _final_state(tmp_path / "ref", 9), _final_state(tmp_path / "full", 9)
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


_RUN_FROM_JSON = """
import json, sys
from genrec.models.config import JobConfig
from genrec.models.config_loader import from_dict
from genrec.models.train.trainer import run_training
run_training(from_dict(JobConfig, json.loads(open(sys.argv[1]).read())))
"""


def test_bad_resume_and_incompatible_checkpoint(prepared, tmp_path):
    from genrec.models.train.trainer import run_training

    with pytest.raises(FileNotFoundError, match="checkpoint"):
        run_training(tiny_config(prepared, tmp_path / "empty"), resume=True)
    run_training(tiny_config(prepared, tmp_path / "run", max_steps=3))
    bigger = tiny_config(prepared, tmp_path / "run", max_steps=6)
    bigger.dense.num_layers = 2
    with pytest.raises(ValueError, match="dense.num_layers"):
        run_training(bigger)


# ---- 2 gloo ranks ------------------------------------------------------------------------


def _take_rows(batch: Batch, rows: slice) -> Batch:
    """Rows `rows` of a batch (every user keeps its history, candidates and labels)."""

    def cut(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_jt_dict({k: _cut_jt(kjt[k], rows) for k in kjt.keys()})

    hist_off = batch.history_offsets_B1
    cand_off = torch.ops.fbgemm.asynchronous_complete_cumsum(batch.candidates.lengths()[: batch.batch_size])
    h = slice(int(hist_off[rows.start]), int(hist_off[rows.stop]))
    c = slice(int(cand_off[rows.start]), int(cand_off[rows.stop]))
    return Batch(
        user_ids_B=batch.user_ids_B[rows], history=cut(batch.history), timestamps_T=batch.timestamps_T[h],
        history_lengths_B=batch.history_lengths_B[rows], candidates=cut(batch.candidates),
        candidate_timestamps_C=batch.candidate_timestamps_C[c], labels_CL=batch.labels_CL[c],
    )


def _cut_jt(jt: JaggedTensor, rows: slice) -> JaggedTensor:
    off = jt.offsets()
    return JaggedTensor(values=jt.values()[int(off[rows.start]) : int(off[rows.stop])], lengths=jt.lengths()[rows])


def _later(batch: Batch, users: slice, seconds: int) -> Batch:
    """`batch` with the events of `users` `seconds` later."""
    hist_off = batch.history_offsets_B1
    cand_off = torch.ops.fbgemm.asynchronous_complete_cumsum(batch.candidates.lengths()[: batch.batch_size])
    ts, cts = batch.timestamps_T.clone(), batch.candidate_timestamps_C.clone()
    ts[int(hist_off[users.start]) : int(hist_off[users.stop])] += seconds
    cts[int(cand_off[users.start]) : int(cand_off[users.stop])] += seconds
    return dataclasses.replace(batch, timestamps_T=ts, candidate_timestamps_C=cts)


def _train_on(rank: int, world_size: int, port: int, cfg_json: str, result_path: str, later_s: int = 0) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from genrec.models.build import unwrap
    from genrec.models.train.distributed import init_distributed, shutdown
    from genrec.models.train.trainer import Trainer

    cfg = from_dict(JobConfig, json.loads(cfg_json))
    trainer = Trainer(cfg, init_distributed())
    exchanges = []  # the store's all-to-alls per step
    real = torch.distributed.all_to_all_single

    def counted(*args, **kwargs):
        exchanges[-1] += 1
        return real(*args, **kwargs)

    torch.distributed.all_to_all_single = counted
    losses = []
    for step, batch in enumerate(_equal_length_batches(cfg, 3)):
        if later_s:  # the first step's first half (rank 0's users) later, then everyone
            batch = _later(batch, slice(0, batch.batch_size // (1 if step else 2)), later_s)
        if world_size > 1:
            half = batch.batch_size // world_size
            batch = _take_rows(batch, slice(rank * half, (rank + 1) * half))
        exchanges.append(0)
        losses.append(trainer.train_step(batch)["loss"])
    torch.distributed.all_to_all_single = real
    model = unwrap(trainer.model)
    model.eval()
    with torch.no_grad():
        rows = model.item_rows(model.item_corpus[:50])
    params = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("embeddings.")}
    torch.save({"losses": losses, "rows": rows, "params": params, "exchanges": exchanges}, f"{result_path}.{rank}")
    shutdown()


def _equal_length_batches(cfg: JobConfig, num: int) -> list[Batch]:
    batches = []
    for batch in _all_batches(cfg):
        batches.append(_trim_to_shortest(batch))
        if len(batches) == num:
            return batches
    raise AssertionError("the tiny log has too few batches")


def _all_batches(cfg: JobConfig):
    from genrec.data.loader import make_loader

    return make_loader(Path(cfg.data.path) / "train", cfg.data.features, cfg.data.loader)


def _trim_to_shortest(batch: Batch) -> Batch:
    """Keep each user's last n history events, n the batch's shortest history: both halves
    then carry the same number of retrieval positions and (2 each) candidates."""
    n = int(batch.history_lengths_B.min())
    off = batch.history_offsets_B1
    keep = torch.cat([torch.arange(int(e) - n, int(e)) for e in off[1:]])
    lengths = torch.full_like(batch.history_lengths_B, n)
    history = KeyedJaggedTensor.from_jt_dict({
        k: JaggedTensor(values=batch.history[k].values()[keep], lengths=lengths) for k in batch.history.keys()
    })
    assert bool((batch.candidates.lengths() == 2).all())
    return Batch(
        user_ids_B=batch.user_ids_B, history=history, timestamps_T=batch.timestamps_T[keep],
        history_lengths_B=lengths, candidates=batch.candidates,
        candidate_timestamps_C=batch.candidate_timestamps_C, labels_CL=batch.labels_CL,
    )


def _spawn(fn, world_size: int, *args) -> None:
    mp.start_processes(fn, args=(world_size, free_port(), *args), nprocs=world_size, join=True, start_method="spawn")


@pytest.mark.parametrize("negatives,admit_min_count,ttl", [
    ("shared", 1, False), ("full", 1, False), ("shared", 2, False), ("full", 2, False), ("shared", 1, True)])
def test_two_ranks_equal_one_rank_on_the_same_global_batch(prepared, tmp_path, negatives, admit_min_count, ttl):
    """With admission, every rank's lookup of the negatives all ranks draw alike (or of the
    full corpus) must count as one sighting, as on one rank, not one per rank. With a TTL,
    rows expire on the global batch's clock, not on each rank's half of it (here rank 0's
    users come 20 days after rank 1's, and rows live 10 days)."""
    later_s = 20 * 86400 if ttl else 0
    result = str(tmp_path / "result")
    for world_size, name in ((1, "one"), (2, "two")):
        cfg = tiny_config(prepared, tmp_path / name)
        cfg.model.negatives = negatives
        for t in cfg.sparse.tables:
            t.admit_min_count = admit_min_count
            t.ttl_seconds = 10 * 86400 if ttl else None
        _spawn(_train_on, world_size, json.dumps(to_dict(cfg)), result + str(world_size), later_s)
    one = torch.load(result + "1.0")
    r0, r1 = torch.load(result + "2.0"), torch.load(result + "2.1")
    # One exchange per step for the batch's rows, the corpus of "full" negatives included;
    # "shared" draws its negatives after the tower runs and looks them up in a second
    # exchange. An exchange is 4 all-to-alls while it learns the sizes (split counts, ids,
    # rows, gradients), then 3 (the counts travel with the ids) unless a batch outgrows them.
    lookups = 1 if negatives == "full" else 2
    assert r0["exchanges"] == r1["exchanges"]
    assert r0["exchanges"][0] == 4 * lookups
    assert all(3 * lookups <= n <= 4 * lookups for n in r0["exchanges"])
    assert r0["exchanges"][-1] < 4 * lookups
    two_losses = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    assert two_losses == pytest.approx(one["losses"], rel=1e-5, abs=1e-6)
    # Dense replicas stay identical across ranks and equal to the single-rank run.
    for name, p in one["params"].items():
        torch.testing.assert_close(r0["params"][name], r1["params"][name], rtol=0, atol=0)
        torch.testing.assert_close(r0["params"][name], p, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r0["rows"], one["rows"], rtol=1e-4, atol=1e-5)


def _draw_shared(rank: int, world_size: int, port: int, cfg_json: str, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from genrec.models.build import unwrap
    from genrec.models.train.distributed import init_distributed, shutdown
    from genrec.models.train.trainer import Trainer

    cfg = from_dict(JobConfig, json.loads(cfg_json))
    trainer = Trainer(cfg, init_distributed())
    model, pools = unwrap(trainer.model), []
    rows_of = model.item_rows
    model.item_rows = lambda ids, replicated=False: (pools.append(ids.clone()) if replicated else None,
                                                      rows_of(ids, replicated))[1]
    for _, batch in zip(range(3), _all_batches(cfg)):
        half = batch.batch_size // world_size  # the halves' token counts differ
        trainer.train_step(_take_rows(batch, slice(rank * half, (rank + 1) * half)))
    torch.save(pools, f"{result_path}.{rank}")
    shutdown()


def test_shared_negatives_are_one_pool_on_every_rank_under_dropout(prepared, tmp_path):
    """"shared" is one pool for the global batch, looked up as replicated (its ids counted on
    rank 0 only). Dropout over each rank's own token count moves each rank's torch RNG its
    own way, and the ranks drew different pools from the first step on."""
    cfg = tiny_config(prepared, tmp_path / "run")
    cfg.model.negatives, cfg.dense.dropout = "shared", 0.2
    _spawn(_draw_shared, 2, json.dumps(to_dict(cfg)), str(tmp_path / "pools"))
    r0, r1 = (torch.load(tmp_path / f"pools.{r}") for r in range(2))
    assert len(r0) == len(r1) == 3
    for a, b in zip(r0, r1):
        assert torch.equal(a, b)


def _run_training(rank: int, world_size: int, port: int, cfg_json: str, result_path: str | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from genrec.models.train.trainer import run_training

    losses = run_training(from_dict(JobConfig, json.loads(cfg_json)))
    if result_path is not None:
        torch.save({"losses": losses}, f"{result_path}.{rank}")


def test_eval_max_users_is_the_count_scored_over_three_ranks(prepared, tmp_path):
    """The split's first 16 users, counted by the 3 ranks that hold them, not whole per-rank
    batches of 6 (18)."""
    cfg = tiny_config(prepared, tmp_path / "run", max_steps=1, eval_every=1, checkpoint_every=1000,
                      eval_max_users=16)
    _spawn(_run_training, 3, json.dumps(to_dict(cfg)))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["valid/num_users"] for r in records if "valid/num_users" in r] == [16]


def test_train_end_to_end_on_two_ranks(prepared, tmp_path):
    # Validation batches of 59 users: the ranks' shares (59 and 60 users) take 1 and 2 batches.
    cfg = tiny_config(prepared, tmp_path / "run", max_steps=6, eval_every=3, eval_max_users=0, eval_batch_size=59)
    _spawn(_run_training, 2, json.dumps(to_dict(cfg)), str(tmp_path / "losses"))
    # What the run logs is the mean over ranks, not rank 0's own loss.
    r0, r1 = (torch.load(tmp_path / f"losses.{r}")["losses"] for r in range(2))
    logged = _losses(tmp_path / "run")
    assert r0 != r1
    assert [logged[s] for s in range(1, 7)] == pytest.approx([(a + b) / 2 for a, b in zip(r0, r1)], rel=1e-6)
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000006"
    assert (ckpt / "COMPLETE").exists()
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("rank-")) == [
        "rank-00000-of-00002", "rank-00001-of-00002"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    # Every validation user is scored on two ranks, as `genrec eval` scores them in one.
    from genrec.data.prepare import load_manifest
    from genrec.models.evaluation.evaluate import run_evaluation

    valid = [r for r in records if "valid/hr@10" in r][-1]
    assert valid["step"] == 6 and valid["valid/num_users"] == load_manifest(prepared)["counts"]["rows"]["valid"]
    run_evaluation(ckpt, prepared, "valid", out_dir=tmp_path / "report")
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    for name in ("hr@10", "ndcg@10", "mrr"):
        assert valid[f"valid/{name}"] == pytest.approx(report[f"retrieval.{name}"], abs=1e-6), name


def test_deterministic_mode_keeps_new_tensors_unfilled():
    """train.deterministic turns on torch's deterministic kernels but not its NaN fill of
    every new tensor (about 1,000 fills, a tenth of a demo step)."""
    from genrec.models.train.trainer import seed_everything

    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    try:
        seed_everything(0, True)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = before[1]
