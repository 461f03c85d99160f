"""`Trainer`: the training loop of `genrec train`, one process or many under `torchrun`.

    trainer = Trainer(cfg, init_distributed(), resume=False)
    trainer.train()

Each step: the next batch is already read and collated (a background thread), the
model computes the loss under autocast, backward applies the sparse rows' optimizer
inside the store and leaves dense gradients that DDP all-reduces, then AdamW steps the
dense parameters.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from genrec.data.files import atomic_write_json, atomic_write_text
from genrec.data.loader import SequenceDataset, make_loader
from genrec.data.prepare import load_manifest
from genrec.models.build import (
    build_model, check_runnable, config_fingerprint, dense_named_parameters, dense_state_dict, eval_loader, gathered,
    load_dense_state_dict, load_item_corpus, load_optimizer_state_dict, optimizer_state_dict,
)
from genrec.models.runs import (
    BEST_FILE, CHECKPOINTS, CONFIG_FILE, RUN_FORMAT, RUN_MANIFEST, CorruptCheckpoint, read_best, sparse_snapshot_dir,
    step_dir_name, write_best,
)
from genrec.models.train.checkpoint import (
    CheckpointManager, capture_rng_state, fault_point, install_stop_signals, restore_rng_state,
)
from genrec.models.train.resume import (
    apply_optim_settings, check_fresh, check_resume, check_run_dir, describe_changes, epochs_end, relaid_schedule,
    saved_form, start_fresh,
)
from genrec.models.config import JobConfig
from genrec.models.ranks import DistInfo, all_reduce_sum, any_rank
from genrec.models.train.distributed import bind_to_cores, init_distributed, local_cores, shutdown
from genrec.models.train.guards import check_finite_step
from genrec.models.train.progress import ProgressLogger
from genrec.models.train.schedule import build_dense_optimizer, warmup_cosine
from genrec.models.evaluation.validation import (
    VALIDATION_KS, check_validation_settings, empty_batch, evaluate_retrieval, validation_batch_size,
)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Deterministic mode also fills every new tensor with NaN (a guard against reading
        # memory before writing it): about 1,000 fills in a demo step, a tenth of its time.
        # The kernels stay deterministic without it.
        torch.utils.deterministic.fill_uninitialized_memory = False


class _Prefetcher:
    """Reads and collates the next batches in a thread while batch n computes: n + 1 is
    ready when n starts (the trainer reads its SSD-tier rows ahead), n + 2 is being drawn.

    Nothing here touches the store: its calls are collectives under torch.distributed and
    stay on the main thread, in step order.

    Each batch comes with the loader state captured right after drawing it: the position
    a checkpoint must save after training on it, whatever has been prefetched since.
    """

    def __init__(self, loader, enabled: bool) -> None:
        self.loader = loader
        self.iterator = iter(loader)
        self.pool = ThreadPoolExecutor(1) if enabled else None
        self.pending: list = []

    def _draw(self):
        try:
            batch = next(self.iterator)
        except StopIteration:  # the loader starts its next epoch
            self.iterator = iter(self.loader)
            batch = next(self.iterator, None)
            if batch is None:
                raise ValueError(
                    "the training loader gave this rank no batch for a whole epoch: the split is "
                    "empty or smaller than one batch per rank (lower data.loader.batch_size or use fewer ranks)"
                ) from None
        return batch, self.loader.state_dict()

    def next(self):
        """(batch n, loader state after it, batch n + 1 or None when not pipelined)."""
        if self.pool is None:
            return (*self._draw(), None)
        while len(self.pending) < 3:
            self.pending.append(self.pool.submit(self._draw))
        batch, state_after = self.pending.pop(0).result()
        return batch, state_after, self.pending[0].result()[0]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


class Trainer:
    def __init__(self, cfg: JobConfig, dist_info: DistInfo, *, resume: bool = False, fresh: bool = False) -> None:
        """resume: a complete checkpoint must exist (one is resumed from anyway when there is).
        fresh: start over, clearing a previous training run in `train.out_dir` (models/train/
        resume.py); otherwise a resume refuses settings it cannot change."""
        if resume and fresh:
            raise ValueError("--resume and --fresh exclude each other")
        cfg = resolve_epochs(copy.deepcopy(cfg), dist_info.world_size)
        self.cfg = cfg
        self.dist = dist_info
        tc = cfg.train
        if tc.precision == "fp16" and dist_info.device.type == "cuda":
            raise ValueError("train.precision = 'fp16' needs loss scaling, and the sparse store steps its rows inside "
                             "backward, on the scaled gradients, with no way to skip a step that overflowed: use "
                             "'bf16' (what 'auto' chooses on CUDA)")
        check_validation_settings(tc.best_metric, tc.early_stop_patience, cfg.model.retrieval,
                                  bool(tc.eval_every or tc.eval_every_epochs))
        if tc.optim.warmup_steps > tc.max_steps:
            if dist_info.is_main:
                print(f"genrec train: train.optim.warmup_steps ({tc.optim.warmup_steps}) is longer than the run; "
                      f"warming up over all {tc.max_steps} steps instead", file=sys.stderr, flush=True)
            tc.optim = dataclasses.replace(tc.optim, warmup_steps=tc.max_steps)
        self.out_dir = Path(tc.out_dir)
        check_runnable(cfg, dist_info.device)
        corpus = load_item_corpus(cfg.data.path)  # a wrong data.path is refused before the run dir is touched
        fresh = self._claim_run_dir(fresh=fresh, resume=resume)
        self._bind_cores()
        self.num_threads = tc.num_threads or default_threads()
        torch.set_num_threads(self.num_threads)
        # The same seed on every rank: replicas start equal (and "shared" negatives are rank 0's
        # draw everywhere), so N ranks reproduce one rank's run on the same global batch.
        seed_everything(tc.seed, tc.deterministic)
        self.model, self.store = build_model(cfg, dist_info)
        self.store.defer_row_updates = True  # finished in train_step, after the dense optimizer step
        # With a TTL, every owner stamps and expires rows on the global batch's clock (as one
        # rank): a rank's own half put the rows it owns for every rank on its own time.
        self.shared_clock = dist_info.world_size > 1 and any(t.ttl_seconds for t in cfg.sparse.tables)
        mode = cfg.sparse.read_ahead
        self.read_ahead = tc.pipeline and (mode == "on" or (mode == "auto" and dist_info.world_size == 1))
        self.model.set_item_corpus(*corpus)
        self.optimizer = build_dense_optimizer(dense_named_parameters(self.model), tc.optim)
        self.scheduler = warmup_cosine(
            self.optimizer, warmup_steps=tc.optim.warmup_steps, total_steps=tc.max_steps,
            min_lr_ratio=tc.optim.min_lr_ratio,
        )
        self.scaler = torch.amp.GradScaler(enabled=tc.precision == "fp16")
        self.loader = make_loader(
            Path(cfg.data.path) / "train", cfg.data.features, cfg.data.loader,
            rank=dist_info.rank, world_size=dist_info.world_size,
        )
        if fresh:  # the old run is cleared only now that the new one could be built
            self._claim_run_dir(fresh=True, resume=False, clear=True)
        if dist_info.is_main:  # marked a run once it could be built: a refused start writes nothing
            atomic_write_json(self.out_dir / RUN_MANIFEST, {"format": RUN_FORMAT})
        self.checkpoints = CheckpointManager(
            self.out_dir / CHECKPOINTS, keep_last=tc.keep_checkpoints,
            rank=dist_info.rank, world_size=dist_info.world_size,
        )
        self.fingerprint = config_fingerprint(cfg)
        self.step = 0
        self.best = read_best(self.out_dir)
        if self.best is not None:
            self.checkpoints.pinned.add(int(self.best["step"]))
        self.validations_since_best = 0
        self.validated_step: int | None = None
        """The step validated last (saved with each checkpoint: a finished run is not validated again)."""
        self.saved_step: int | None = None
        self.stopped_by: str | None = None
        """The signal that stopped training early (None: it ran to the end)."""
        self._restore_newest_intact()
        if dist_info.is_main:  # only settings in effect: a resume refused every other change
            atomic_write_text(self.out_dir / CONFIG_FILE, json.dumps(saved_form(cfg), indent=2))

    def _claim_run_dir(self, *, fresh: bool, resume: bool, clear: bool = False) -> bool:
        """`fresh`: check that a previous training run here may be cleared (`clear`: clear it,
        rank 0, once the new run is built); returns False where a restarted torchrun worker
        resumes instead. Otherwise, if there are checkpoints to resume from, refuse what a
        resume cannot change and print the changes it applies; `resume`: refuse when there
        are none. Nothing is written here but what `clear` clears."""
        main = self.dist.is_main
        if fresh and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            if main:
                print("genrec train: a restarted worker resumes; --fresh cleared the run at the first start",
                      file=sys.stderr, flush=True)
            fresh = False
        problem = None
        try:
            if fresh and main:
                (start_fresh if clear else check_fresh)(self.out_dir)
            elif main:
                check_run_dir(self.out_dir)
            if not fresh:
                changes, damaged = check_resume(self.out_dir, saved_form(self.cfg), required=resume)
                for path, why in damaged:
                    if main:
                        print(f"genrec train: warning: skipping checkpoint {path}: {why}", file=sys.stderr, flush=True)
                if changes and main:
                    print(f"genrec train: {describe_changes(self.out_dir, changes)}", file=sys.stderr, flush=True)
        except (ValueError, FileNotFoundError) as e:
            problem = e
        # Collective: no rank looks into the folder before rank 0 has cleared it, and all stop together.
        if any_rank(problem is not None):
            raise problem or ValueError(f"{self.out_dir}: rank 0 refused this run directory")
        return fresh

    def _bind_cores(self) -> None:
        """`train.cpu_affinity`: each local rank on its own cores (CPU training only)."""
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if self.cfg.train.cpu_affinity != "auto" or self.dist.device.type != "cpu":
            return
        cores = local_cores(self.dist.local_rank, local_world)
        if cores is None:
            return
        bind_to_cores(cores)
        if self.dist.is_main:
            print(f"genrec train: each of the {local_world} ranks on this node bound to {len(cores)} core(s) "
                  f"(rank {self.dist.local_rank}: {cores}; train.cpu_affinity = \"off\" leaves it to the OS)",
                  file=sys.stderr, flush=True)

    # ---- the loop -----------------------------------------------------------------------

    def _autocast(self):
        precision = self.cfg.train.precision
        if precision == "auto":
            precision = "bf16" if self.dist.device.type == "cuda" else "fp32"
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        if dtype is None:
            return nullcontext()
        return torch.autocast(self.dist.device.type, dtype=dtype)

    def train_step(self, batch) -> dict[str, float]:
        self.model.train()
        batch = batch.to(self.dist.device, non_blocking=True)
        now = int(batch.timestamps_T.max()) if batch.num_tokens else None  # TTL runs on event time
        if self.shared_clock:
            t = torch.tensor([-(1 << 62) if now is None else now], dtype=torch.int64, device=self.dist.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            now = None if int(t) == -(1 << 62) else int(t)
        if now is not None:
            self.store.set_event_time(now)
        with self._autocast():
            loss, parts = self.model(batch)
        with record_function("genrec.backward"):  # the store's fused sparse update runs in here
            self.scaler.scale(loss).backward()
        with record_function("genrec.optimizer"):
            clip = self.cfg.train.optim.grad_clip_norm
            if clip is not None:
                self.scaler.unscale_(self.optimizer)
                norm = torch.nn.utils.clip_grad_norm_([p for _, p in dense_named_parameters(self.model)], clip)
                parts["grad_norm"] = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            parts["lr"] = self.scheduler.get_last_lr()[0]  # the rate this step used
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.store.finish_row_updates()  # their gradients travelled during the dense step
        parts["loss"] = float(loss.detach())
        check_finite_step(parts, step=self.step + 1)
        return parts

    def read_ahead_next(self, upcoming) -> None:
        """Start the disk reads of the next batch's SSD-tier rows (sparse.read_ahead), from the
        host batch: its ids go to the store on the host, so no device copy."""
        if upcoming is not None and self.read_ahead:
            self.model.read_ahead(upcoming)

    def train(self) -> list[float]:
        """Train to `max_steps`; returns this process's losses (for tests and golden files)."""
        tc = self.cfg.train
        stop = install_stop_signals()
        batches = _Prefetcher(self.loader, enabled=tc.pipeline)
        logger = ProgressLogger(
            self.out_dir, total_steps=tc.max_steps, rank=self.dist.rank,
            enable_tensorboard=tc.tensorboard, start_step=self.step,
        )
        losses = []
        window = {"samples": 0, "tokens": 0, "t0": time.perf_counter()}
        loader_state = self.loader.state_dict()
        # The model, store and imported modules live for the whole run: frozen, the cyclic
        # collector stops rescanning them, which each step's short-lived objects would
        # otherwise trigger (in a profile of the sparse bench's steps, a tenth of the time).
        gc.collect()
        gc.freeze()
        try:
            stopped = False
            # A run that stopped early stays stopped when its command runs again (a larger
            # patience on resume lets it go on).
            finished = bool(tc.early_stop_patience) and self.validations_since_best >= tc.early_stop_patience
            if finished:
                logger.write(f"stopped early at step {self.step} before: no new best {tc.best_metric} in "
                             f"{self.validations_since_best} validations; nothing to train")
            while not finished and self.step < tc.max_steps:
                if stop.should_stop():  # collective: every rank stops at the same step
                    stopped = True
                    break
                batch, loader_state, upcoming = batches.next()
                self.read_ahead_next(upcoming)
                parts = self.train_step(batch)
                self.step += 1
                fault_point("step", self.step)
                losses.append(parts["loss"])
                window["samples"] += batch.batch_size
                window["tokens"] += batch.num_tokens
                if self.step % tc.log_every == 0 or self.step == tc.max_steps:
                    elapsed = time.perf_counter() - window["t0"]
                    parts.update(mean_over_ranks({k: v for k, v in parts.items() if k.endswith("loss")},
                                                 self.dist.world_size))
                    parts["samples_per_s"] = window["samples"] * self.dist.world_size / elapsed
                    parts["tokens_per_s"] = window["tokens"] * self.dist.world_size / elapsed
                    parts.update(store_hit_rates(self.store.stats()))
                    parts["threads"] = self.num_threads
                    window = {"samples": 0, "tokens": 0, "t0": time.perf_counter()}
                    logger.log(self.step, parts)
                if tc.eval_every and self.step % tc.eval_every == 0:
                    self._validate_and_keep_best(logger, loader_state)
                    if tc.early_stop_patience and self.validations_since_best >= tc.early_stop_patience:
                        logger.write(f"early stop at step {self.step}: no new best {tc.best_metric} in "
                                     f"{self.validations_since_best} validations")
                        break
                if self.step % tc.checkpoint_every == 0 and self.step < tc.max_steps and self.saved_step != self.step:
                    self.save(loader_state)
            if not stopped and self.validated_step != self.step:  # not validated just now, nor before a resume
                self._validate_and_keep_best(logger, loader_state)
            if self.saved_step != self.step:
                self.save(loader_state)
            if stopped:
                logger.write(f"stopped by {stop.signal_name or 'a signal on another rank'} at step {self.step}; "
                             "checkpoint saved")
                self.stopped_by = stop.signal_name or "SIGTERM"
        finally:
            stop.restore()
            batches.close()
            logger.close()
            # Frozen objects are never freed, not even at exit: extension types that check
            # for leaks at shutdown (Triton's, imported by torch where installed) print pages.
            gc.unfreeze()
        return losses

    def _validate_and_keep_best(self, logger, loader_state: dict) -> None:
        """Validate; on a new best `train.best_metric`, checkpoint this step and record it as
        the run's best (kept from pruning)."""
        result = self.validate()
        self.validated_step = self.step
        logger.log(self.step, result)
        metric = self.cfg.train.best_metric
        value = result.get(f"valid/{metric}") if metric else None
        if value is None or value != value:  # no validation split, or NaN
            return
        if self.best is not None and value <= self.best["value"]:
            self.validations_since_best += 1
            return
        self.validations_since_best = 0
        previous = None if self.best is None else int(self.best["step"])
        self.best = {"step": self.step, "metric": f"valid/{metric}", "value": float(value),
                     "checkpoint": step_dir_name(self.step)}
        # The checkpoint records itself as the best: a crash before best.json is written
        # below leaves a record that the resume restores (and writes) from it.
        self.save(loader_state)
        self.checkpoints.pinned = {self.step}
        if self.dist.is_main:
            write_best(self.out_dir, self.best)
            if previous is not None and previous != self.step:
                self.checkpoints.prune()  # the old best may go now

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        valid = Path(self.cfg.data.path) / "valid"
        if not self.cfg.model.retrieval or not any(valid.glob("*.parquet")):
            return {}
        batch_size = self.cfg.train.eval_batch_size or validation_batch_size(
            self.cfg.data.loader.batch_size, int(self.model.item_corpus.numel()))
        max_users, world, rank = self.cfg.train.eval_max_users, self.dist.world_size, self.dist.rank
        if max_users:
            batch_size = min(batch_size, -(-max_users // world))
        # Capped, the batches holding this rank's share are counted below from whole batches:
        # read in order (a few thousand users at most; workers would interleave short batches).
        loader = eval_loader(self.cfg, "valid", rank=rank, world_size=world, full_history=True, batch_size=batch_size,
                             in_order=bool(max_users))
        # Capped: the split's first max_users users, the same ones on any world size (a
        # resumed run's best metric compares like with like), each rank counting its own.
        share = loader.rows_in_first(max_users) if max_users else None
        mine = len(loader) if share is None else min(len(loader), -(-share // batch_size))
        # Every user is scored (no rank's share cut to the smallest): a rank out of users takes
        # empty batches until the others are done, since the store's lookups are collective.
        most = int(max(all_reduce_sum([mine if r == self.dist.rank else 0 for r in range(world)])))
        batches = itertools.chain(itertools.islice(loader, mine),
                                  itertools.repeat(empty_batch(self.cfg.data.features), most - mine))
        self.model.eval()
        # In fp32, as `genrec eval` scores: the two must agree on the best checkpoint's metric.
        with gathered(self.model):
            result = evaluate_retrieval(self.model, batches, ks=VALIDATION_KS,
                                        window=self.cfg.data.loader.max_seq_len, max_users=share)
        self.model.train()
        return {f"valid/{k}": v for k, v in result.items()}

    # ---- checkpoints --------------------------------------------------------------------

    def save(self, loader_state: dict) -> None:
        dense_state = {
            "model": dense_state_dict(self.model),
            "optimizer": optimizer_state_dict(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }
        rank_state = {"step": self.step, "loader": loader_state, "rng": capture_rng_state(),
                      "validations_since_best": self.validations_since_best, "best": self.best,
                      "validated_step": self.validated_step}
        published = self.checkpoints.save(
            self.step, dense_state=dense_state, rank_state=rank_state,
            # One snapshot directory for all ranks (each writes its shards, rank 0 the
            # manifest): that is what makes it loadable under another world size.
            write_shared=lambda shared: self.store.save_snapshot(str(shared / "sparse")),
            config_fingerprint=self.fingerprint,
        )
        self.store.snapshot_moved(str(sparse_snapshot_dir(published)))  # a delta's base, once renamed
        self.saved_step = self.step

    def _restore_newest_intact(self) -> None:
        """Resume from the newest complete checkpoint whose files verify on every rank; a
        corrupt one is skipped with a warning naming it (so `torchrun --max-restarts` does
        not fail the same way on every restart). A config mismatch is still an error."""
        for _, path in reversed(self.checkpoints.complete_steps()):
            problem = None
            try:
                dense_state, rank_state = self.checkpoints.load(path, config_fingerprint=self.fingerprint)
            except CorruptCheckpoint as e:
                problem = str(e)
            if any_rank(problem is not None):
                if self.dist.is_main:
                    print(f"genrec train: warning: skipping checkpoint {path}: "
                          f"{problem or 'another rank found its files corrupt'}", file=sys.stderr, flush=True)
                continue
            try:
                self._restore(path, dense_state, rank_state)
            except CorruptCheckpoint as e:  # the sparse snapshot's own CRCs
                if self.dist.is_main:
                    print(f"genrec train: warning: skipping checkpoint {path}: {e}", file=sys.stderr, flush=True)
                continue
            return
        if self.checkpoints.complete_steps():
            raise CorruptCheckpoint(f"no intact checkpoint in {self.checkpoints.root}: every one failed to verify")

    def _restore(self, path: Path, dense_state: dict, rank_state: dict) -> None:
        load_dense_state_dict(self.model, dense_state["model"])
        load_optimizer_state_dict(self.model, self.optimizer, dense_state["optimizer"])
        self.scheduler.load_state_dict(dense_state["scheduler"])
        apply_optim_settings(self.optimizer, self.scheduler, self.cfg.train.optim)  # the config's, not the saved
        self.scaler.load_state_dict(dense_state["scaler"])
        try:
            self.store.load_snapshot(str(sparse_snapshot_dir(path)))
        except ValueError as e:  # its own CRCs or sizes; the config was checked by the fingerprint
            raise CorruptCheckpoint(f"{sparse_snapshot_dir(path)}: {e}") from e
        self.loader.load_state_dict(rank_state["loader"])
        restore_rng_state(rank_state["rng"])
        self.step = int(rank_state["step"])
        self.saved_step = self.step
        self.validations_since_best = int(rank_state.get("validations_since_best", 0))
        self.validated_step = rank_state.get("validated_step")
        if "best" in rank_state:  # the run's best as of this checkpoint, whatever best.json says
            self.best = rank_state["best"]
            if self.dist.is_main and self.best != read_best(self.out_dir):
                if self.best is None:
                    (self.out_dir / BEST_FILE).unlink(missing_ok=True)
                else:
                    write_best(self.out_dir, self.best)
        elif self.best is not None and int(self.best["step"]) > self.step:
            self.best = None  # recorded by a later part of the run that this resume replays
        self.checkpoints.pinned = set() if self.best is None else {int(self.best["step"])}
        saved_world = int(rank_state["loader"]["world_size"])
        if self.dist.is_main:
            print(f"resumed from {path} at step {self.step}", flush=True)
        if saved_world != self.dist.world_size or self.cfg.train.num_epochs is not None:
            self._follow_new_world(saved_world)

    def _follow_new_world(self, saved_world: int) -> None:
        """After a resume on another world size the loader deals the rest of the epoch to this
        world (data/loader.py); with `train.num_epochs` the run still ends after that many
        epochs, so its last step and the cosine schedule's length are laid anew from the
        loader's position (`epochs_end`), again at each later resume: the config's count
        from step 0 is this world's plan, not the plan that read the earlier epochs."""
        tc, loader, resized = self.cfg.train, self.loader, saved_world != self.dist.world_size
        note = (f"resumed a {saved_world}-rank checkpoint on {self.dist.world_size} rank(s): the rest of "
                f"epoch {loader.epoch} is {len(loader) - loader.batches_done} steps on this world") if resized else ""
        end = None if tc.num_epochs is None else epochs_end(loader, self.step, tc.num_epochs, resized=resized)
        if end is not None and (resized or end != tc.max_steps):
            tc.max_steps = end
            self.scheduler = relaid_schedule(self.optimizer, self.scheduler, tc.optim, end)
            note = (note or "resumed a run that changed world size") + f"; its {tc.num_epochs} epochs end at step {end}"
        if self.dist.is_main and note:
            print(f"genrec train: {note}", file=sys.stderr, flush=True)


def resolve_epochs(cfg: JobConfig, world_size: int) -> JobConfig:
    """`cfg` with `train.num_epochs` / `train.eval_every_epochs` turned into steps (so that
    config.json records the steps in effect): the loader's own batches of each epoch, so a
    run of N epochs ends where the loader's N-th epoch does. With several loader workers an
    epoch's count moves by a batch or so between epochs (each worker ends its rows with a
    short batch of its own): `eval_every` follows the first epoch's."""
    tc = cfg.train
    if tc.num_epochs is None and not tc.eval_every_epochs:
        return cfg
    tc = dataclasses.replace(tc)
    if tc.num_epochs is not None:
        if tc.num_epochs < 1:
            raise ValueError(f"train.num_epochs must be >= 1, got {tc.num_epochs}")
        tc.max_steps = epoch_steps(cfg, world_size, range(tc.num_epochs))
    if tc.eval_every_epochs:
        tc.eval_every = tc.eval_every_epochs * epoch_steps(cfg, world_size)
    return dataclasses.replace(cfg, train=tc)


def epoch_steps(cfg: JobConfig, world_size: int, epochs: Iterable[int] = (0,)) -> int:
    """Training steps of `epochs` (default: the first), summed: the batches the loader's plan
    yields per rank in each (its batches of each worker's rows, cut to the same count on
    every rank). The plan reads the split's parquet footers once for all of them."""
    epochs = list(epochs)
    if not epochs:
        return 0
    plan = SequenceDataset(Path(cfg.data.path) / "train", cfg.data.features, cfg.data.loader, rank=0,
                           world_size=world_size)
    total = 0
    for epoch in epochs:
        steps = min(len(plan.schedule(epoch, rank)) for rank in range(world_size))
        if steps < 1:
            rows = int(load_manifest(cfg.data.path)["counts"]["rows"]["train"])
            raise ValueError(f"train.num_epochs: the training split has {rows} rows, less than one batch "
                             f"of {cfg.data.loader.batch_size} per rank (data.loader.batch_size)")
        total += steps
    return total


def mean_over_ranks(values: dict[str, float], world_size: int) -> dict[str, float]:
    """Each value averaged over the ranks (collective; every rank logs at the same steps)."""
    if world_size == 1 or not values:
        return values
    keys = sorted(values)
    return {k: v / world_size for k, v in zip(keys, all_reduce_sum([values[k] for k in keys]))}


def default_threads() -> int:
    """The cores this process may use, shared by the ranks of this node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // max(1, local_ranks))


def store_hit_rates(stats: dict[str, dict[str, int]]) -> dict[str, float]:
    """Share of row lookups (all tables, this rank, since start) served by each tier."""
    tiers = ("device", "host", "ssd")
    hits = {t: sum(s[f"hits_{t}"] for s in stats.values()) for t in tiers}
    total = sum(hits.values()) + sum(s["misses"] for s in stats.values())
    return {f"hit_{t}": hits[t] / total for t in tiers} if total else {}


class StoppedBySignal(Exception):
    """Training stopped early on SIGTERM / SIGINT, after saving a checkpoint. The command
    line exits with 128 + the signal number (143 for SIGTERM), as a killed process would,
    so that schedulers and torchrun do not read the run as finished."""

    def __init__(self, signal_name: str, step: int) -> None:
        super().__init__(f"stopped by {signal_name} at step {step}; checkpoint saved, resume with the same command")
        self.signal_name = signal_name
        self.exit_code = 128 + int(getattr(signal, signal_name))


def run_training(cfg: JobConfig, *, resume: bool = False, fresh: bool = False) -> list[float]:
    """Train; returns this process's losses. Raises StoppedBySignal after a stop signal."""
    dist_info = init_distributed()
    try:
        trainer = Trainer(cfg, dist_info, resume=resume, fresh=fresh)
        losses = trainer.train()
        if trainer.stopped_by is not None:
            raise StoppedBySignal(trainer.stopped_by, trainer.step)
        return losses
    finally:
        shutdown()
