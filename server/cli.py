"""The `kvlease` command: argument parsing and dispatch only.

Configuration errors end with exit status 2 and a one-line message on stderr,
never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvlease.engine import processes
from kvlease.engine.auth import AuthSettings, KeyConfigError, KeyRing, mint_token
from kvlease.engine.runtime import DependencyError, VllmVersionError
from kvlease.engine.tenancy import TierConfigError, TierTable
from kvlease.replay.command import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS

# Flags several commands share, declared once (argparse parent parsers).
_LEDGER = argparse.ArgumentParser(add_help=False)
_LEDGER.add_argument("--usage-db", default=None, help="ledger URL ($KVLEASE_USAGE_DB)")
_TIERS = argparse.ArgumentParser(add_help=False)
_TIERS.add_argument("--tiers", default=None, help="tier table TOML ($KVLEASE_TIERS)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlease", description="Tenant-aware KV-cache scheduling for a shared vLLM engine."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve",
        help="run vLLM's OpenAI server with kvlease's scheduler, auth and admin routes",
        add_help=False,
    )

    _token_parser(sub)
    _usage_parser(sub)
    _dashboard_parser(sub)
    _grafana_parser(sub)
    _replay_parser(sub)
    _demo_parser(sub)
    return parser


def _token_parser(sub: Any) -> None:
    token = sub.add_parser(
        "token",
        help="mint a tenant JWT signed with the configured key",
        description="Mint a JWT for a tenant. Key: $KVLEASE_JWT_SECRET or --jwt-keys. "
        "Prints only the token.",
        parents=[_TIERS],
    )
    token.add_argument("--tenant", required=True, help="tenant id (the token's tenant_id)")
    token.add_argument("--tier", required=True, help="a tier name from the tier table")
    token.add_argument("--roles", default="", help="comma-separated: admin, finance")
    token.add_argument("--session", default=None, help="chat session id (optional)")
    token.add_argument(
        "--weight", type=float, default=None, help="fair-share weight (<= the tier max_weight)"
    )
    token.add_argument("--ttl", type=float, default=3600.0, help="lifetime in seconds (3600)")
    token.add_argument("--kid", default=None, help="signing key id in the key ring")
    token.add_argument("--jwt-keys", default=None, help="JWKS key-ring file ($KVLEASE_JWT_KEYS)")


def _usage_parser(sub: Any) -> None:
    usage = sub.add_parser("usage", help="the usage ledger")
    usage_sub = usage.add_subparsers(dest="usage_command", required=True)
    export = usage_sub.add_parser(
        "export",
        help="billing export of the ledger: FOCUS 1.2 CSV, raw records or a row per tenant",
        description="Export usage ended in [--from, --to) or in --month (UTC dates or ISO "
        "times; default: this month) as CSV. Exits 1, saying so on stderr, when the window "
        "holds no usage: a scheduled job notices an empty month.",
        parents=[_LEDGER, _TIERS],
    )
    when = export.add_mutually_exclusive_group()
    when.add_argument("--month", default=None, help="a calendar month, e.g. 2026-11")
    when.add_argument("--from", dest="start", default=None, help="start, e.g. 2026-11-01")
    export.add_argument("--to", dest="end", default=None, help="end (exclusive)")
    export.add_argument("--granularity", choices=["hour", "day", "month"], default="month")
    export.add_argument(
        "--format",
        choices=["focus", "raw", "summary"],
        default="focus",
        help="focus: FOCUS rows (default); raw: one row per record; summary: one row per "
        "tenant, its statement's total",
    )
    export.add_argument("--tenant", action="append", default=[], help="repeatable")
    export.add_argument("-o", "--output", default="-", help="file, or - for stdout")
    load = usage_sub.add_parser(
        "import",
        help="load raw records (the --format raw CSV) into the ledger; re-importing adds nothing",
        description="Import raw usage records. Each bad row is one line on stderr (line "
        "number, reason) and is skipped; the good rows are imported. Exit status 1 if any "
        "row was bad.",
        parents=[_LEDGER],
    )
    load.add_argument("file", help="CSV file, or - for stdin")
    load.add_argument(
        "--create",
        action="store_true",
        help="make the ledger if it does not exist (without it, a mistyped URL is an error)",
    )
    prune = usage_sub.add_parser(
        "prune",
        help="delete raw records ended before a date; the hourly rollups (and so every "
        "FOCUS export by hour, day or month) are kept",
        parents=[_LEDGER],
    )
    prune.add_argument("--before", required=True, help="UTC date or whole hour, e.g. 2026-10-01")
    usage_sub.add_parser(
        "rebuild-rollups",
        help="recompute the hourly rollups from the raw records (after the prune horizon)",
        parents=[_LEDGER],
    )


def _dashboard_parser(sub: Any) -> None:
    dash = sub.add_parser(
        "dashboard",
        help="the Streamlit page for SREs and finance",
        description="Live KV occupancy, leases and evictions from one engine's admin API or "
        "a Prometheus server, and usage and the FOCUS CSV from the ledger.",
        parents=[_LEDGER],
    )
    dash.add_argument("--engine", default=None, help="kvlease server URL (http://127.0.0.1:8000)")
    dash.add_argument("--prometheus", default=None, help="Prometheus URL, for a fleet")
    dash.add_argument(
        "--token",
        default=None,
        help="admin JWT for the engine's admin API (better: $KVLEASE_DASHBOARD_TOKEN)",
    )
    dash.add_argument("--port", type=int, default=8501)
    dash.add_argument("--address", default="127.0.0.1")
    dash.add_argument("--refresh", type=float, default=2.0, help="seconds, at least 2")


def _grafana_parser(sub: Any) -> None:
    grafana = sub.add_parser("grafana", help="the bundled Grafana dashboards")
    grafana_sub = grafana.add_subparsers(dest="grafana_command", required=True)
    gbuild = grafana_sub.add_parser(
        "build",
        help="regenerate grafana/dashboards/*.json",
        description="Write the dashboards' JSON; the cost panel uses the tier table's prices.",
        parents=[_TIERS],
    )
    gbuild.add_argument("--out", default=None, help="folder (default: grafana/dashboards)")
    gbuild.add_argument(
        "--runbook",
        default=None,
        help="URL of docs/alerts.md where your team serves it, for the alerts' runbook_url "
        "(default: the relative path docs/alerts.md)",
    )


def _replay_parser(sub: Any) -> None:
    replay = sub.add_parser(
        "replay",
        help="what if: recorded traffic against a proposed tier table or pool, offline",
        description="Replay a ledger window (--usage-db, --from, --to) or a trace CSV "
        "(timestamp, tenant, session, input_tokens, output_tokens[, tier]) through vLLM's "
        "scheduler with kvlease's, on a step clock, twice: under the tier table in force "
        "(current) and under --tiers / --assign / --pool-blocks (proposed). Prints both "
        "side by side; bad input is one line on stderr and exit status 2.",
    )
    source = replay.add_mutually_exclusive_group()
    source.add_argument("--usage-db", default=None, help="ledger URL ($KVLEASE_USAGE_DB)")
    source.add_argument("--trace", default=None, help="trace CSV instead of the ledger")
    replay.add_argument(
        "--from", dest="start", default=None, help="window start, UTC (default: this month)"
    )
    replay.add_argument("--to", dest="end", default=None, help="window end, exclusive")
    replay.add_argument("--tiers", default=None, help="the proposed tier table (TOML)")
    replay.add_argument(
        "--against",
        default="current",
        help="the table to compare with: current (the one in force) or a TOML path",
    )
    replay.add_argument("--assign", default=None, help='TOML [tenants] name = "tier"')
    pool = replay.add_mutually_exclusive_group()
    pool.add_argument("--pool-blocks", type=int, default=None, help="proposed pool (64)")
    pool.add_argument("--kv-gib", type=float, default=None, help="proposed KV memory, GiB")
    replay.add_argument("--model-config", default=None, help="config.json for --kv-gib")
    replay.add_argument(
        "--current-pool-blocks", type=int, default=None, help="current pool (the proposed one)"
    )
    replay.add_argument("--speed", type=float, default=1.0, help="traffic x this rate (1.0)")
    clock = replay.add_mutually_exclusive_group()
    clock.add_argument(
        "--step-cost",
        default=None,
        help="seconds per step as BASE,PREFILL_TOKEN,DECODE_REQUEST, or cpu-demo (default)",
    )
    clock.add_argument(
        "--steps-per-second", type=float, default=None, help="a fixed step clock instead"
    )
    for flag, default in (
        ("--max-num-seqs", MAX_NUM_SEQS),
        ("--max-num-batched-tokens", MAX_NUM_BATCHED_TOKENS),
    ):
        replay.add_argument(flag, type=int, default=default, help=f"vLLM's ({default})")
    replay.add_argument("--json", default=None, help="write the report as JSON here")
    replay.add_argument("-o", "--output", default=None, help="write an HTML report here")
    replay.add_argument("--quiet", action="store_true", help="no table, no progress bar")
    replay.add_argument("--model", default=None, help="model folder (default: demo model)")


def _demo_parser(sub: Any) -> None:
    demo = sub.add_parser(
        "demo",
        help="the whole system, live: server, tenants' traffic, dashboard, Prometheus",
        description="Start kvlease serve on a small pool, Prometheus and the dashboard, and "
        "play a multi-tenant chat workload until --duration or Ctrl-C; then print a summary.",
        parents=[_TIERS],
    )
    demo.add_argument("--duration", type=float, default=None, help="seconds (default: Ctrl-C)")
    demo.add_argument(
        "--requests", type=int, default=None, help="stop after this many completed requests"
    )
    demo.add_argument("--tenants", type=int, default=12, help="tenants across the tiers (12)")
    demo.add_argument("--port", type=int, default=8000, help="API port (8000)")
    demo.add_argument("--dashboard-port", type=int, default=8501)
    demo.add_argument("--prometheus-port", type=int, default=9090)
    demo.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard")
    demo.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    demo.add_argument("--model", default=None, help="local path or hub id (default: demo model)")


def _token(args: argparse.Namespace) -> int:
    tiers = TierTable.load(args.tiers)
    keyring = KeyRing.from_config(args.jwt_keys)
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    print(
        mint_token(
            keyring,
            tiers,
            tenant_id=args.tenant,
            tier=args.tier,
            roles=roles,
            session_id=args.session,
            weight=args.weight,
            ttl_seconds=args.ttl,
            kid=args.kid,
            settings=AuthSettings.from_env(),
        )
    )
    return 0


def _stamp(epoch: float) -> str:
    from kvlease.exporters.periods import stamp

    return stamp(epoch)


def _usage(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from kvlease.exporters.ledger import one_line

    commands = {
        "export": _usage_export,
        "import": _usage_import,
        "prune": _usage_prune,
        "rebuild-rollups": _usage_rebuild,
    }
    try:
        return commands[args.usage_command](args)
    except SQLAlchemyError as exc:
        raise ValueError(f"the ledger failed: {one_line(exc)}") from None


def _usage_export(args: argparse.Namespace) -> int:
    from kvlease.exporters.exports import export_chunks
    from kvlease.exporters.ledger import UsageLedger
    from kvlease.exporters.periods import month_window, parse_window

    tiers = TierTable.load(args.tiers)
    if args.month and args.end:
        raise ValueError("--to goes with --from, not with --month")
    window = month_window(args.month) if args.month else parse_window(args.start, args.end)
    ledger = UsageLedger(args.usage_db, create=False)  # a reader never makes a ledger
    if args.format == "raw" and window[0] < (horizon := ledger.horizon()):
        print(f"kvlease usage: records before {_stamp(horizon)} were pruned", file=sys.stderr)
    chunks = export_chunks(ledger, window, args.format, args.granularity, tiers, args.tenant)
    try:
        out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise ValueError(f"cannot write {args.output}: {exc.strerror}") from None
    lines = 0
    try:
        for chunk in chunks:
            out.write(chunk)
            lines += chunk.count("\n")
    finally:
        if out is not sys.stdout:
            out.close()
    if lines <= 1:  # the header alone (a quoted line break only adds to the count)
        who = f" for {', '.join(args.tenant)}" if args.tenant else ""
        print(
            f"kvlease usage: no usage from {_stamp(window[0])} to {_stamp(window[1])}{who}: "
            "wrote the header only",
            file=sys.stderr,
        )
        return 1
    return 0


IMPORT_BATCH = 20_000  # records a transaction: the import's rate, bounded memory


def _usage_import(args: argparse.Namespace) -> int:
    import io

    from kvlease.exporters.ledger import UsageLedger
    from kvlease.exporters.usage_import import BadRow, read_records

    try:
        raw = sys.stdin.buffer if args.file == "-" else open(args.file, "rb")  # noqa: SIM115
    except OSError as exc:
        raise ValueError(f"cannot read {args.file}: {exc.strerror}") from None
    # Bytes that are not UTF-8 stay in the text as surrogates: their row is refused by line.
    source = io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline="")
    read = new = bad = 0
    batch = []
    with source:
        rows = read_records(source)  # the header is checked before the ledger is opened
        ledger = UsageLedger(args.usage_db, create=args.create)
        for line, item in rows:
            if isinstance(item, BadRow):
                bad += 1
                print(f"{args.file}:{line}: {item}", file=sys.stderr)
                continue
            read += 1
            batch.append(item)
            if len(batch) == IMPORT_BATCH:
                new += ledger.write(batch)
                batch = []
        new += ledger.write(batch)
    print(f"imported {new} new records ({read - new} already in the ledger), {bad} bad rows")
    return 1 if bad else 0


def _usage_prune(args: argparse.Namespace) -> int:
    from kvlease.exporters.ledger import UsageLedger
    from kvlease.exporters.periods import parse_time

    before = parse_time(args.before)
    deleted = UsageLedger(args.usage_db, create=False).prune(before)
    print(f"deleted {deleted} records ended before {_stamp(before)}; rollups kept")
    return 0


def _usage_rebuild(args: argparse.Namespace) -> int:
    from kvlease.exporters.ledger import UsageLedger

    ledger = UsageLedger(args.usage_db, create=False)
    rollups = ledger.rebuild_rollups()
    print(f"rebuilt {rollups} hourly rollups from the records since {_stamp(ledger.horizon())}")
    return 0


def _grafana_build(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvlease.grafana.build import DASHBOARD_DIR, RUNBOOK, build

    out = Path(args.out) if args.out else DASHBOARD_DIR
    for path in build(out, TierTable.load(args.tiers), args.runbook or RUNBOOK):
        print(path)
    return 0


def _replay(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from kvlease.replay import command, render

    plan = command.plan(args)
    total = sum(len(side.turns) for side in plan.sides)
    for note in plan.notes:
        print(f"kvlease replay: {note}", file=sys.stderr)
    with processes.interrupt_on_signals(raise_interrupt=False) as received:
        try:
            if args.quiet:
                report = command.run(plan, stopped=lambda: bool(received))
            else:
                from tqdm import tqdm

                with tqdm(total=total, unit="req", desc="replay", file=sys.stderr) as bar:
                    report = command.run(plan, progress=bar.update, stopped=lambda: bool(received))
        except command.Stopped:  # its workers are ended by now
            print("kvlease replay: stopped, nothing written", file=sys.stderr)
            return 128 + received[0]
    for path, text in (
        (args.json, lambda: json.dumps(report, indent=2) + "\n"),
        (args.output, lambda: render.page(report)),
    ):
        if path:
            try:
                Path(path).write_text(text(), encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"cannot write {path}: {exc.strerror}") from None
    if not args.quiet:
        from rich.console import Console

        console = Console()
        if not console.is_terminal:
            console.width = 140  # a file or a pipe: the whole table, not 80 columns of it
        console.print(render.terminal(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # every flag kvlease does not own goes to vLLM's parser
        from kvlease.server.serve import run_serve

        return run_serve(argv[1:])
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "token":
            return _token(args)
        if args.command == "usage":
            return _usage(args)
        if args.command == "grafana":
            return _grafana_build(args)
        if args.command == "replay":
            return _replay(args)
        if args.command == "dashboard":
            from kvlease.dashboard.launch import run_dashboard

            return run_dashboard(args)
        from kvlease.demo.run import run_demo

        return run_demo(
            duration=args.duration,
            requests=args.requests,
            tenants=args.tenants,
            port=args.port,
            dashboard=not args.no_dashboard,
            dashboard_port=args.dashboard_port,
            prometheus_port=args.prometheus_port,
            model=args.model,
            tiers_path=args.tiers,
            seed=args.seed,
        )
    except (KeyConfigError, TierConfigError, VllmVersionError, DependencyError, ValueError) as exc:
        print(f"kvlease {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
