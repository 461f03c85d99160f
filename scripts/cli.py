"""The `genrec` command line: parse, build, run, close. The work lives in the library."""

from __future__ import annotations

import argparse
import sys

BENCHES = ("data", "sparse", "dense", "train", "serve", "quality", "quality-ml100k", "all", "check", "gate", "baseline", "readme")


def _add_config_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--config", required=required, help="run file, e.g. configs/demo.toml")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set train.max_steps=100",
    )


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genrec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write a synthetic ad event log (parquet part-files)")
    _add_output_args(p)
    for flag, default in (("--users", 10_000), ("--items", 20_000), ("--events", 1_000_000), ("--seed", 0)):
        p.add_argument(flag, type=int, default=default)

    p = sub.add_parser("convert", help="convert a public dataset into the event-log schema")
    p.add_argument("--from", dest="source", required=True, choices=["movielens", "sasrec-txt", "s3rec-txt", "criteo"])
    p.add_argument("--input", dest="inputs", nargs="+", required=True)
    _add_output_args(p)

    p = sub.add_parser("prepare", help="event logs -> per-user sequences with a split")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--logs", help="parquet event logs: a directory, file or glob")
    src.add_argument("--from", dest="source", choices=["movielens", "sasrec-txt", "s3rec-txt", "criteo"],
                     help="convert a public dataset first (with --input)")
    p.add_argument("--input", dest="inputs", nargs="+", help="files for --from")
    _add_output_args(p)
    _add_config_args(p)

    p = sub.add_parser("train", help="train a model (torchrun for several ranks)")
    _add_config_args(p, required=True)
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint (required to exist)")
    start.add_argument("--fresh", action="store_true", help="start over: clear the genrec training run in train.out_dir")

    p = sub.add_parser("export", help="checkpoint -> serving artifact")
    p.add_argument("--checkpoint", required=True)
    _add_output_args(p)
    p.add_argument("--dtype", choices=["fp32", "fp16", "int8"],
                   help="storage of the embedding rows and the item index (default fp32; a delta: the base's)")
    p.add_argument("--data", help="prepared data directory (default: the path the run trained on)")
    p.add_argument("--model-version", help="version the artifact reports (default: RUN-STEP-DTYPE)")
    p.add_argument("--retrieval-index", choices=["auto", "exact", "ivf"], default="auto",
                   help="also build an approximate (IVF) retrieval index; auto: above 2M items")
    p.add_argument("--delta-since", help="a base artifact: write only the rows changed since it (apply-delta)")

    p = sub.add_parser("eval", help="offline evaluation report")
    p.add_argument("--checkpoint", nargs="+", required=True, help="checkpoint dir or artifact (several: seeds of one recipe)")
    p.add_argument("--data", required=True, help="prepared data directory")
    p.add_argument("--split", default="test", choices=["valid", "test"])
    p.add_argument("--out", required=True)
    p.add_argument("--compare", nargs="+", help="checkpoint(s) for a paired comparison")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("serve", help="HTTP ranking server")
    p.add_argument("--artifact", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--threads", type=int, default=2, help="CPU threads for scoring, shared by the busy workers")
    p.add_argument("--workers", type=int, default=1, help="batches ranked at once (throughput: one per core)")
    p.add_argument("--max-batch-size", type=int, default=16, help="requests scored together")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="how long a batch waits for requests still being read (a lone request does not wait)")
    p.add_argument("--max-queue", type=int, default=256, help="rank requests in the server at once (503 beyond)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest request body (413 beyond)")
    # ServingConfig's fields; a flag left unset keeps the dataclass default (in the help).
    for flag, kind, text in (
        ("--max-k", int, "largest K (retrieved candidates) a request may ask for (default 1000)"),
        ("--max-n", int, "largest N (returned items) a request may ask for (default 1000)"),
        ("--max-history", int, "history events used per request (default: the tower's max_seq_len - 1)"),
        ("--max-request-events", int, "events a request may send; more is a 422, not a truncation (default 100000)"),
        ("--micro-batch", int, "candidates scored at once against a cached history (default 512)"),
        ("--retrieval-block-rows", int, "item-index rows per retrieval block (default 1048576)"),
        ("--history-dtype", str, "cached history and candidate scores: fp32, bf16 or auto (default: bf16 on bf16 CPUs, large products)"),
        ("--advertiser-feature", str, "item feature that allowed_advertisers filters on (default advertiser_id)"),
        ("--ann-nprobe", int, "lists an approximate index scans per query (default: calibrated at export)"),
        ("--table-cache-mb", float, "hot rows held per table above this size, fp32 MB; 0: none (default 256)"),
    ):
        p.add_argument(flag, type=kind, help=text)
    p.add_argument("--exact-retrieval", action="store_const", const=True, help="ignore an approximate index")
    p.add_argument("--reload-token-file", help="file holding the /admin/reload bearer token (else "
                                               "$GENREC_RELOAD_TOKEN); without a token, no reload endpoint")
    p.add_argument("--reload-dir", dest="reload_dirs", action="append", default=[], metavar="DIR",
                   help="reload only artifacts under DIR (repeatable)")
    p.add_argument("--allowed-hosts", type=lambda s: [h.strip() for h in s.split(",") if h.strip()], default=[],
                   metavar="NAME,...", help="Host header names accepted besides loopback ('*': any)")

    p = sub.add_parser("bench", help="benchmarks (JSON of figures and ratios), and the regression gate")
    p.add_argument("name", choices=BENCHES)
    p.add_argument("results", nargs="*", help="check: one `bench all` JSON; baseline: several")
    p.add_argument("--baseline", help="check / gate: the baseline JSON (configs/bench_baseline.json)")
    p.add_argument("--json", dest="json_out", help="write the figures here")
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes for `all`)")
    p.add_argument("--check", action="store_true", help="readme: only check the README against configs/figures/")
    p.add_argument("--allow-noisy", action="store_true", help="measure even on a busy machine (load > 0.5)")

    p = sub.add_parser("profile", help="profile training, the store or serving: Chrome trace, TensorBoard, summary.md")
    p.add_argument("target", choices=["train", "sparse", "serve"])
    _add_config_args(p)  # train, sparse: --config; serve: --artifact and --data
    p.add_argument("--artifact", help="serve: an exported artifact")
    p.add_argument("--data", help="serve: prepared data; its test users make the requests")
    p.add_argument("--steps", type=int, default=20, help="profiled steps or requests (after one warm-up)")
    _add_output_args(p)

    p = sub.add_parser("demo", help="synthesize -> prepare -> train -> export -> eval -> one query")
    p.add_argument("--out", default="demo", help="working directory of the demo")
    p.add_argument("--overwrite", action="store_true", help="start over in an existing --out")
    p.add_argument("--steps", type=int, help="training steps (default: configs/demo.toml's train.max_steps)")
    return parser


def run_command(args: argparse.Namespace) -> int:
    from genrec.scripts import commands

    return commands.run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from genrec.models.process import keep_large_allocations, passive_openmp_waits, quiet_known_warnings

    passive_openmp_waits()
    keep_large_allocations()
    quiet_known_warnings()
    try:
        return run_command(args)
    except (ValueError, OSError) as e:
        # Bad input, a path through a file, no permission: one line, no traceback.
        print(f"genrec {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
