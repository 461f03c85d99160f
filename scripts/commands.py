"""One function per `genrec` subcommand. Each parses nothing (the CLI did) and calls the library.

A handler returns an exit code (None means 0).
Imports are local so `genrec --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    """Run `args.command`'s handler, once every argument is valid UTF-8 (see `check_utf8`)."""
    from genrec.data.files import check_utf8

    check_utf8(vars(args).values())
    return globals()[args.command](args) or 0


def synth(args: argparse.Namespace) -> int:
    from genrec.data.synth import synthesize

    summary = synthesize(
        args.out, num_users=args.users, num_items=args.items, num_events=args.events,
        seed=args.seed, overwrite=args.overwrite,
    )
    print(f"wrote {summary['num_events']:,} events for {summary['num_users']:,} users to {args.out}")
    return 0


def convert(args: argparse.Namespace) -> int:
    from genrec.data.convert import convert as convert_dataset

    summary = convert_dataset(args.source, args.inputs, args.out, overwrite=args.overwrite)
    print(f"wrote {summary['num_events']:,} events ({summary['num_users']:,} users) to {args.out}")
    return 0


def prepare(args: argparse.Namespace) -> int:
    from genrec.data.prepare import prepare as prepare_sequences
    from genrec.data.prepare import prepare_converted
    from genrec.models.config import JobConfig
    from genrec.models.config_loader import load_config

    cfg = load_config(JobConfig, args.config, args.overrides)
    pc = cfg.data.prepare
    settings = dict(memory_budget_mb=pc.memory_budget_mb, num_shards=pc.num_shards,
                    row_group_users=pc.row_group_users, overwrite=args.overwrite)
    if args.source is None:
        if args.inputs:
            raise ValueError("--input only applies with --from (--logs are read as they are)")
        manifest = prepare_sequences(args.logs, args.out, cfg.data.features, pc.split, **settings)
    else:
        if not args.inputs:
            raise ValueError("--from needs --input FILE [FILE ...]")
        # The converted log goes to OUT.logs, beside OUT.
        manifest = prepare_converted(args.source, args.inputs, args.out, cfg.data.features, pc.split, **settings)
    counts = manifest["counts"]
    print(f"prepared {args.out}: " + ", ".join(f"{k}={v:,}" for k, v in counts.items() if isinstance(v, int)))
    return 0


def train(args: argparse.Namespace) -> int:
    from genrec.models.config import JobConfig
    from genrec.models.config_loader import load_config
    from genrec.models.train.checkpoint import CheckpointWriteError
    from genrec.models.train.trainer import StoppedBySignal, run_training

    cfg = load_config(JobConfig, args.config, args.overrides)
    try:
        run_training(cfg, resume=args.resume, fresh=args.fresh)
    except StoppedBySignal as e:
        print(f"genrec train: {e}", file=sys.stderr)
        return e.exit_code
    except CheckpointWriteError as e:  # e.g. a full disk: one clear line, not a traceback
        print(f"genrec train: error: {e.strerror}", file=sys.stderr)
        return 1
    return 0


def export(args: argparse.Namespace) -> int:
    from genrec.models.serving.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, version=args.model_version,
                            data_dir=args.data, overwrite=args.overwrite, retrieval_index=args.retrieval_index,
                            delta_since=args.delta_since)
    print(f"wrote {'delta' if args.delta_since else 'artifact'} {out}")
    return 0


def serve(args: argparse.Namespace) -> int:
    import dataclasses

    from genrec.models.serving.ranker import ServingConfig
    from genrec.models.serving.server import serve as run_server

    # A flag left unset (or not there) keeps ServingConfig's default.
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServingConfig)
             if getattr(args, f.name, None) is not None}
    run_server(args.artifact, host=args.host, port=args.port, threads=args.threads, workers=args.workers,
               max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
               max_body_bytes=args.max_body_bytes, reload_token_file=args.reload_token_file,
               reload_dirs=args.reload_dirs, allowed_hosts=args.allowed_hosts, serving_cfg=ServingConfig(**given))
    return 0


def demo(args: argparse.Namespace) -> int:
    from genrec.scripts.demo import run_demo

    run_demo(args.out, overwrite=args.overwrite, steps=args.steps)
    return 0


def profile(args: argparse.Namespace) -> int:
    from genrec.models.config import JobConfig
    from genrec.models.config_loader import load_config
    from genrec.models.train import profile as prof

    needs = ["artifact", "data"] if args.target == "serve" else ["config"]
    missing = [f"--{n}" for n in needs if getattr(args, n) is None]
    if missing:
        raise SystemExit(f"genrec profile {args.target}: needs {' and '.join(missing)}")
    if args.target == "serve":
        summary = prof.profile_serving(args.artifact, args.data, args.steps, args.out, overwrite=args.overwrite)
    else:
        run = prof.profile_training if args.target == "train" else prof.profile_sparse
        summary = run(load_config(JobConfig, args.config, args.overrides), args.steps, args.out, overwrite=args.overwrite)
    print(f"wrote {args.out}/summary.md, trace.json and tensorboard/ ({summary['step_ms']:.1f} ms per step)")
    return 0


def bench(args: argparse.Namespace) -> int:
    """One benchmark, all of them, or the regression gate (genrec.models.benchgate)."""
    from genrec.models.benchgate import command

    return command(args)


def eval(args: argparse.Namespace) -> int:  # noqa: A001 - the subcommand's name
    from genrec.models.evaluation.evaluate import run_evaluation

    out = run_evaluation(
        args.checkpoint, args.data, split=args.split, out_dir=args.out, compare=args.compare, seed=args.seed
    )
    print(f"wrote {out / 'report.md'}, {out / 'report.json'}")
    return 0
