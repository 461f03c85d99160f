"""The training protocol of the literature: epochs, validation, the best-validation
checkpoint kept and evaluated, early stopping; and the retrieval losses' negatives."""

import gc
import json
import math
from pathlib import Path

import pytest
import torch

from genrec.data.prepare import load_manifest
from genrec.models.config_loader import to_dict
from genrec.models.runs import BEST_FILE, check_marker, complete_steps, resolve_checkpoint
from train_helpers import tiny_config



def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_epochs_become_steps_and_config_records_what_ran(prepared, tmp_path):
    from genrec.models.train.trainer import run_training

    cfg = tiny_config(prepared, tmp_path / "run", num_epochs=2, eval_every_epochs=1, checkpoint_every=1000)
    losses = run_training(cfg)
    # Training freezes its long-lived objects for the run only: frozen ones are never freed,
    # and extension types that check for leaks at exit (Triton's) printed pages of them.
    assert gc.get_freeze_count() == 0
    rows = load_manifest(prepared)["counts"]["rows"]["train"]
    per_epoch = -(-rows // cfg.data.loader.batch_size)
    assert len(losses) == 2 * per_epoch
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert saved["max_steps"] == 2 * per_epoch and saved["eval_every"] == per_epoch
    validated = [r["step"] for r in _records(tmp_path / "run") if "valid/ndcg@10" in r]
    assert validated == [per_epoch, 2 * per_epoch]


def test_best_checkpoint_is_kept_and_chosen(prepared, tmp_path):
    from genrec.models.train.trainer import run_training

    run = tmp_path / "run"
    run_training(tiny_config(prepared, run, max_steps=8, eval_every=2, checkpoint_every=1000,
                             keep_checkpoints=1, eval_max_users=0))
    valid = [(r["step"], r["valid/ndcg@10"]) for r in _records(run) if "valid/ndcg@10" in r]
    assert [s for s, _ in valid] == [2, 4, 6, 8]
    best_value = max(v for _, v in valid)
    best_step = next(s for s, v in valid if v == best_value)  # the first to reach it
    best = json.loads((run / BEST_FILE).read_text())
    assert (best["step"], best["value"], best["metric"]) == (best_step, best_value, "valid/ndcg@10")
    step_dir, _ = resolve_checkpoint(run)
    assert step_dir.name == best["checkpoint"]
    check_marker(step_dir)  # a complete checkpoint: raises otherwise
    latest, _ = resolve_checkpoint(run, which="latest")
    assert latest.name == "step-00000008"
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == sorted({step_dir.name, latest.name})  # keep_checkpoints=1 plus the pinned best
    # A record this code did not write is an error naming the file and field, not a KeyError.
    (run / BEST_FILE).write_text(json.dumps({k: v for k, v in best.items() if k != "checkpoint"}))
    with pytest.raises(ValueError, match=r"best\.json: field 'checkpoint'"):
        resolve_checkpoint(run)


def test_eval_reports_the_best_checkpoint_by_default(prepared, tmp_path, capsys):
    from genrec.models.evaluation.evaluate import run_evaluation
    from genrec.models.train.trainer import run_training

    run = tmp_path / "run"
    run_training(tiny_config(prepared, run, max_steps=4, eval_every=2, checkpoint_every=1000))
    best = json.loads((run / BEST_FILE).read_text())
    run_evaluation(run, prepared, "valid", out_dir=tmp_path / "report")
    assert f"best-validation checkpoint {best['checkpoint']}" in capsys.readouterr().err
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["config"]["run"]["checkpoint"] == {"step_dir": best["checkpoint"], "chosen": "best-validation",
                                             "best": best, "trained_on": str(prepared)}


def test_early_stopping_after_patience(prepared, tmp_path):
    from genrec.models.train.trainer import run_training

    cfg = tiny_config(prepared, tmp_path / "run", max_steps=20, eval_every=2, early_stop_patience=2,
                      checkpoint_every=1000)
    cfg.train.optim.lr = 0.0
    for t in cfg.sparse.tables:
        t.learning_rate = 0.0  # nothing learns: no validation can beat the first
    losses = run_training(cfg)
    assert len(losses) == 6  # best at 2, no new best at 4 and 6 -> stop
    # The same command again resumes a run that has stopped: it trains no further.
    assert run_training(cfg) == []
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-00000002", "step-00000006"]


def test_epochs_are_the_loaders_epochs_with_several_workers(prepared, tmp_path):
    """Each loader worker ends its rows with a short batch of its own: N epochs are the
    loader's batches of N epochs, not the split's rows over the batch size."""
    import dataclasses

    from genrec.models.train.distributed import init_distributed
    from genrec.models.train.trainer import Trainer

    cfg = tiny_config(prepared, tmp_path / "run", num_epochs=2, checkpoint_every=1000, eval_every=0, pipeline=False)
    cfg.data.loader = dataclasses.replace(cfg.data.loader, num_workers=2, batch_size=8)
    trainer = Trainer(cfg, init_distributed())
    plan = []
    for epoch in range(2):
        trainer.loader.set_epoch(epoch)
        plan.append(len(trainer.loader))
    trainer.loader.set_epoch(0)
    rows = load_manifest(prepared)["counts"]["rows"]["train"]
    assert sum(plan) != 2 * -(-rows // 8)  # the case the split's row count gets wrong
    assert trainer.cfg.train.max_steps == sum(plan)
    assert len(trainer.train()) == sum(plan)
    assert (trainer.loader.epoch, trainer.loader.batches_done) in ((1, plan[1]), (2, 0))  # two whole epochs


@pytest.mark.parametrize("num_workers, max_users", [(0, 16), (2, 16), (2, 9 * 12)])
def test_validation_scores_at_most_eval_max_users(prepared, tmp_path, num_workers, max_users):
    """Exactly eval_max_users, not rounded up to whole batches of the automatic size (at
    least 2,048 users), nor short of it where worker loaders end each worker's part with a
    short batch (9 batches of 12 here, one of them short from a worker)."""
    from genrec.models.train.trainer import run_training

    assert load_manifest(prepared)["counts"]["rows"]["valid"] > max_users
    cfg = tiny_config(prepared, tmp_path / "run", max_steps=2, eval_every=2, checkpoint_every=1000,
                      eval_max_users=max_users, eval_batch_size=12)
    cfg.data.loader.num_workers = num_workers
    run_training(cfg)
    assert [r["valid/num_users"] for r in _records(tmp_path / "run") if "valid/num_users" in r] == [max_users]


def test_fp16_on_cuda_is_refused_naming_the_key(prepared, tmp_path):
    """fp16 needs loss scaling, and the sparse store would step its rows on the scaled
    gradients inside backward (65,536x too large, and on steps the scaler skips)."""
    from genrec.models.ranks import single_process
    from genrec.models.train.trainer import Trainer

    with pytest.raises(ValueError, match="train.precision = 'fp16'.*'bf16'"):
        Trainer(tiny_config(prepared, tmp_path / "run", precision="fp16"), single_process("cuda"))
    assert not (tmp_path / "run").exists()


def test_unknown_best_metric_is_an_error_naming_the_key(prepared, tmp_path):
    from genrec.models.train.trainer import run_training

    with pytest.raises(ValueError, match="train.best_metric 'auc'"):
        run_training(tiny_config(prepared, tmp_path / "run", best_metric="auc"))


# ---- negatives --------------------------------------------------------------------------------


def _model(prepared, tmp_path, **model):
    from genrec.models.build import build_model, load_item_corpus
    from genrec.models.ranks import single_process

    cfg = tiny_config(prepared, tmp_path / "run")
    cfg.model.ranking = False
    for k, v in model.items():
        setattr(cfg.model, k, v)
    net, _ = build_model(cfg, single_process())
    net.set_item_corpus(*load_item_corpus(prepared))
    return cfg, net


def _batch(cfg, prepared):
    from genrec.data.loader import make_loader

    cfg.data.loader.mode = "retrieval"
    return next(iter(make_loader(prepared / "train", cfg.data.features, cfg.data.loader)))


@pytest.mark.parametrize("setting", [{"best_metric": None}, {"retrieval": False}, {"eval_every": 0}])
def test_an_early_stop_patience_that_could_never_stop_is_an_error_at_start(prepared, tmp_path, setting):
    """Patience counts validations without a new best metric: with no best metric, no
    retrieval head to validate, or no validation before the end, there is none to count,
    and the run silently went on to max_steps."""
    from genrec.models.train.trainer import run_training

    cfg = tiny_config(prepared, tmp_path / "run", max_steps=8, eval_every=setting.get("eval_every", 1),
                      early_stop_patience=1, best_metric=setting.get("best_metric", "ndcg@10"))
    cfg.model.retrieval = setting.get("retrieval", True)
    with pytest.raises(ValueError, match="train.early_stop_patience = 1 would never stop the run"):
        run_training(cfg)
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


@pytest.mark.parametrize("negatives", ["shared", "per_position", "in_batch", "full"])
def test_every_negative_mode_trains(prepared, tmp_path, negatives):
    cfg, net = _model(prepared, tmp_path, negatives=negatives)
    torch.manual_seed(0)
    loss, parts = net(_batch(cfg, prepared))
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    grads = [p.grad for n, p in net.named_parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("retrieval", [True, False])
def test_a_non_finite_loss_stops_the_run_at_its_step_before_any_checkpoint_of_it(prepared, tmp_path, retrieval):
    """Learning rates far too high turn the loss into NaN within a few steps: the run stops
    there with an error naming the step, neither training on NaN (checkpointing NaN weights,
    which a resume would start from) to a validation error that names no step nor, with no
    retrieval validation, to an end that looks like success."""
    from genrec.models.train.trainer import run_training

    cfg = tiny_config(prepared, tmp_path / "run", max_steps=8, checkpoint_every=1, eval_every=4)
    cfg.model.retrieval = retrieval
    cfg.train.optim.lr, cfg.train.optim.grad_clip_norm = 1e30, None
    for table in cfg.sparse.tables:
        table.learning_rate = 1e30
    with pytest.raises(ValueError, match=r"training loss of step \d+ is not finite"):
        run_training(cfg)
    losses = [r["loss"] for r in _records(tmp_path / "run") if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses)
    saved = complete_steps(tmp_path / "run" / "checkpoints")
    assert [step for step, _ in saved] == list(range(1, len(losses) + 1))[-cfg.train.keep_checkpoints:]
    for _, path in saved:
        dense = torch.load(path / "dense.pt", weights_only=True)["model"]
        assert all(torch.isfinite(v).all() for v in dense.values() if v.is_floating_point())


@pytest.mark.parametrize("retrieval", [True, False])
def test_a_batch_without_candidates_or_targets_has_a_zero_loss_not_nan(prepared, tmp_path, retrieval):
    """Windows of one event leave no candidate (ranking) and no next item (retrieval): a
    short last batch of such users must not turn the loss, and every weight after the
    step, into NaN."""
    from genrec.data.loader import make_loader

    cfg, net = _model(prepared, tmp_path, retrieval=retrieval, ranking=True)
    cfg.data.loader.mode, cfg.data.loader.max_seq_len = "ranking", 1
    batch = next(iter(make_loader(prepared / "train", cfg.data.features, cfg.data.loader)))
    assert batch.candidate_timestamps_C.numel() == 0
    loss, parts = net(batch)
    assert torch.isfinite(loss) and float(loss) == 0.0, parts
    assert all(v == v for v in parts.values()), parts  # no NaN part either
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_full_softmax_is_the_exact_cross_entropy_over_the_corpus(prepared, tmp_path, similarity):
    """Cosine: L2-normalized states and rows over the temperature; "dot": raw inner products
    (and the user vector evaluation scores with is the raw state)."""
    import torch.nn.functional as F

    cfg, net = _model(prepared, tmp_path, negatives="full", similarity=similarity, temperature=0.5)
    net.eval()
    batch = _batch(cfg, prepared)
    vec = (lambda x: F.normalize(x, dim=-1)) if similarity == "cosine" else (lambda x: x)
    with torch.no_grad():
        loss, _ = net(batch)
        states, _, _ = net.encode(batch)
        items = batch.history[cfg.data.features.item].values()
        last = batch.history_offsets_B1[1:] - 1
        src = torch.tensor([t for t in range(len(items)) if t not in set(last.tolist())])
        logits = vec(states[src]) @ vec(net.item_rows(net.item_corpus)).T / 0.5
        expected = F.cross_entropy(logits, torch.searchsorted(net.item_corpus, items[src + 1]))
        user = net.user_embeddings(batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(user, vec(states[last]), rtol=1e-5, atol=1e-6)



def test_in_batch_softmax_corrects_every_logit_by_log_q(prepared, tmp_path):
    """`negatives = "in_batch"`: position i's softmax runs over the batch's targets, each
    logit s(i, j) / T - log q(target j), the positive's too (Yi et al., 2019), other
    positions with i's own target left out. A plain per-position loop is the reference; and
    a uniform q, a constant shift of every logit, gives the uncorrected loss."""
    import torch.nn.functional as F

    cfg, net = _model(prepared, tmp_path, negatives="in_batch", temperature=0.5)
    net.eval()
    batch = _batch(cfg, prepared)
    items = batch.history[cfg.data.features.item].values()
    last = set((batch.history_offsets_B1[1:] - 1).tolist())
    src = torch.tensor([t for t in range(len(items)) if t not in last])
    target = items[src + 1]
    corpus = net.item_corpus
    counts = torch.randint(1, 50, (corpus.numel(),), generator=torch.Generator().manual_seed(0))
    net.set_item_corpus(corpus, counts)
    with torch.no_grad():
        loss, _ = net(batch)
        states, _, _ = net.encode(batch)
        q = F.normalize(states[src], dim=-1)
        rows = F.normalize(net.item_rows(target), dim=-1)
        log_q = torch.log(counts.double() / counts.sum()).float()[torch.searchsorted(corpus, target)]
        terms = []
        for i in range(len(src)):
            keep = (target != target[i]) | (torch.arange(len(src)) == i)
            logits = (q[i] @ rows[keep].T) / 0.5 - log_q[keep]
            terms.append(F.cross_entropy(logits[None], keep[: i + 1].sum()[None] - 1))
        expected = torch.stack(terms).mean()
        net.set_item_corpus(corpus, torch.full_like(counts, 7))
        uniform, _ = net(batch)
        net.set_item_corpus(corpus)
        uncorrected, _ = net(batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(uniform, uncorrected, rtol=1e-5, atol=1e-5)
    assert abs(float(loss) - float(uncorrected)) > 1e-3  # the correction is not a no-op here

def test_mask_seen_leaves_a_positions_own_history_out_of_its_softmax(prepared, tmp_path):
    """model.mask_seen: each position's softmax runs over the corpus minus the items of its
    row up to and including its own event, the target kept even when it repeats one of them;
    a plain per-position loop is the reference, forward and backward."""
    import torch.nn.functional as F

    cfg, net = _model(prepared, tmp_path, negatives="full", temperature=0.5, mask_seen=True)
    net.eval()
    batch = _batch(cfg, prepared)
    items = batch.history[cfg.data.features.item].values()
    offsets = batch.history_offsets_B1.tolist()
    # A repeated target: the second event of the first long row becomes its first item.
    row = next(b for b in range(len(offsets) - 1) if offsets[b + 1] - offsets[b] >= 3)
    items[offsets[row] + 2] = items[offsets[row]]
    loss, _ = net(batch)
    loss.backward()
    got = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad()
    states, _, _ = net.encode(batch)
    corpus = F.normalize(net.item_rows(net.item_corpus), dim=-1)
    terms, masked = [], 0
    for b in range(len(offsets) - 1):
        for t in range(offsets[b], offsets[b + 1] - 1):
            target = int(items[t + 1])
            seen = {int(i) for i in items[offsets[b]:t + 1]} - {target}
            keep = [c for c, i in enumerate(net.item_corpus.tolist()) if i not in seen]
            masked += len(net.item_corpus) - len(keep)
            logits = F.normalize(states[t], dim=-1) @ corpus[keep].T / 0.5
            terms.append(-F.log_softmax(logits, dim=0)[keep.index(int(torch.searchsorted(net.item_corpus, target)))])
    expected = torch.stack(terms).mean()
    assert masked > len(terms)  # the mask removed items, more than one per position on average
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-5)
    expected.backward()
    for n, p in net.named_parameters():
        if n in got:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    with pytest.raises(ValueError, match="model.mask_seen needs model.negatives = 'full'"):
        _model(prepared, tmp_path, negatives="shared", mask_seen=True)


def test_contrastive_term_is_the_two_view_infonce(prepared, tmp_path):
    """model.contrastive_weight: the loss is the next-item loss of the first view plus the
    weighted symmetric InfoNCE of an independent transcription, positions of the same row
    left out of each other's negatives; the tower runs twice, the store is read once."""
    import torch.nn.functional as F

    cfg, net = _model(prepared, tmp_path, negatives="full", contrastive_weight=0.3, contrastive_temperature=0.2)
    for m in net.tower.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.3
    batch = _batch(cfg, prepared)
    views, lookups = [], []
    net.tower.register_forward_hook(lambda m, args, out: views.append(out))
    net.embeddings.register_forward_hook(lambda m, args, out: lookups.append(1))
    many = net.embeddings.lookup_many
    net.embeddings.lookup_many = lambda kjts, *rest: (lookups.extend([1] * len(kjts)), many(kjts, *rest))[1]
    net.train()
    torch.manual_seed(0)
    loss, parts = net(batch)
    assert len(views) == 2 and not torch.equal(views[0], views[1])  # two dropout masks
    history_lookups = len(lookups) - 1  # the full softmax looks the corpus up once more
    assert history_lookups == 1
    a, b = F.normalize(views[0], dim=-1), F.normalize(views[1], dim=-1)
    rows = [r for r, n in enumerate(batch.history_lengths_B.tolist()) for _ in range(n)]
    terms = []
    for x, y in ((a, b), (b, a)):
        for t in range(len(rows)):
            keep = [j for j in range(len(rows)) if j == t or rows[j] != rows[t]]
            sims = torch.stack([x[t] @ y[j] for j in keep]) / 0.2
            terms.append(-F.log_softmax(sims, dim=0)[keep.index(t)])
    infonce = torch.stack(terms).mean()
    torch.testing.assert_close(torch.tensor(parts["contrastive_loss"]), infonce.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss.detach(), torch.tensor(parts["retrieval_loss"]) + 0.3 * infonce.detach(),
                               rtol=1e-4, atol=1e-5)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in net.tower.parameters() if p.grad is not None)


def test_unsupported_negatives_are_errors_naming_the_key(prepared, tmp_path):
    from genrec.models.build import build_model
    from genrec.models.ranks import single_process

    cfg = tiny_config(prepared, tmp_path / "run")
    cfg.model.negatives = "in_batch"
    cfg.data.loader.batch_size = 1
    with pytest.raises(ValueError, match="model.negatives = 'in_batch' needs data.loader.batch_size"):
        build_model(cfg, single_process())
    with pytest.raises(ValueError, match="model.full_softmax_max_items"):
        _model(prepared, tmp_path, negatives="full", full_softmax_max_items=10)
    assert to_dict(cfg)["model"]["negatives"] == "in_batch"


@pytest.mark.parametrize("eval_batch_size,precision", [(0, "fp32"), (3, "fp32"), (0, "bf16")])
def test_training_validation_is_genrec_evals_metric(prepared, tmp_path, eval_batch_size, precision):
    """Histories here are longer than the model's window (24): validation must filter every
    seen item, not only the window's, exactly as `genrec eval` does, whatever the number of
    users it scores at once (0: the automatic size, larger than the training batch), and in
    fp32 whatever the training precision (bf16 scores tie, and ties rank the target low)."""
    from genrec.models.evaluation.evaluate import run_evaluation
    from genrec.models.train.trainer import run_training

    run = tmp_path / "run"
    cfg = tiny_config(prepared, run, max_steps=4, checkpoint_every=1000, eval_max_users=0,
                      eval_batch_size=eval_batch_size, precision=precision)
    cfg.model.ranking = False
    run_training(cfg)
    valid = next(r for r in _records(run) if "valid/ndcg@10" in r)
    rows = load_manifest(prepared)["counts"]["rows"]["valid"]
    assert valid["valid/num_users"] == rows
    run_evaluation(run, prepared, "valid", out_dir=tmp_path / "report")
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    for name in ("hr@10", "ndcg@10", "mrr"):
        assert valid[f"valid/{name}"] == pytest.approx(report[f"retrieval.{name}"], abs=1e-9), name


def test_a_kill_between_a_best_checkpoint_and_best_json_keeps_that_best(prepared, tmp_path):
    """kill -9 after a new best's checkpoint is published but before best.json names it: the
    resume must restore the best record with the checkpoint, not compare later validations
    with the older best (which picked another best and let retention delete the true one)."""
    import os
    import signal
    import subprocess
    import sys

    from genrec.models.train.trainer import run_training
    from test_train import _RUN_FROM_JSON

    kw = dict(max_steps=16, eval_every=2, checkpoint_every=1000, keep_checkpoints=1, eval_max_users=0)
    run_training(tiny_config(prepared, tmp_path / "ref", **kw))
    want = json.loads((tmp_path / "ref" / BEST_FILE).read_text())
    valid = [(r["step"], r["valid/ndcg@10"]) for r in _records(tmp_path / "ref") if "valid/ndcg@10" in r]
    earlier = max(v for s, v in valid if s < want["step"])
    # The case that tells: a later validation beats the earlier best but not the best.
    assert any(earlier < v < want["value"] for s, v in valid if s > want["step"])

    cfg = tiny_config(prepared, tmp_path / "run", **kw)
    (tmp_path / "run.json").write_text(json.dumps(to_dict(cfg)))
    proc = subprocess.run([sys.executable, "-c", _RUN_FROM_JSON, str(tmp_path / "run.json")],
                          env=dict(os.environ, GENREC_FAULT_AT=f"save-published:{want['step']}"),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    run_training(cfg)
    assert json.loads((tmp_path / "run" / BEST_FILE).read_text()) == want
    assert (tmp_path / "run" / "checkpoints" / want["checkpoint"]).is_dir()  # pinned, not pruned


def test_a_finished_run_started_again_is_not_validated_again(prepared, tmp_path):
    """The same command on a run that ended at max_steps (not a multiple of eval_every) trains
    nothing, and must not validate its last step a second time (a whole validation pass,
    and a duplicate record in metrics.jsonl)."""
    from genrec.models.train.trainer import run_training

    run = tmp_path / "run"
    cfg = tiny_config(prepared, run, max_steps=5, eval_every=4, checkpoint_every=1000)
    run_training(cfg)
    assert [r["step"] for r in _records(run) if "valid/ndcg@10" in r] == [4, 5]
    assert run_training(cfg) == []
    assert [r["step"] for r in _records(run) if "valid/ndcg@10" in r] == [4, 5]
