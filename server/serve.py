"""`kvlease serve`: vLLM's own OpenAI server, with kvlease's pieces configured.

The launcher: one of the modules that import vLLM (the README's architecture lists
them; tests/test_layers.py keeps the list true).

It validates kvlease's configuration first (a bad key or tier file is a
one-line error, exit 2), then runs vLLM's launcher functions (`setup_server`,
`build_async_engine_client`, `build_and_serve`) with:

- `--scheduler-cls kvlease.engine.vllm_scheduler.TenantAwareScheduler` (which becomes
  the async variant where vLLM schedules asynchronously),
- `--middleware kvlease.server.middleware.TenantMiddleware`,
- the `kvlease_admin` endpoint plugin allow-listed in `VLLM_PLUGINS`,
- a fresh engine->API channel address in `KVLEASE_CHANNEL`,
- `--enable-prompt-tokens-details` (cached tokens in usage) and a drain
  deadline for SIGTERM (`--shutdown-timeout`, 30 s unless given);
- for `--data-parallel-size` / `--api-server-count` (`scale_out`): the rank count
  the middleware pins sessions over, one salt key for every API process, and
  vLLM's own multi-process launcher when there is more than one.

vLLM binds the port before the ~30 s engine start but serves nothing until
the engine is up; kvlease answers 503 (OpenAI error shape) meanwhile.
Every other flag goes to vLLM unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TypeVarTuple, Unpack

from kvlease.engine import processes
from kvlease.engine.auth import KEYS_ENV
from kvlease.engine.budgets import BUDGETS_ENV, BudgetConfigError, BudgetTable
from kvlease.engine.labels import HASH_ENV as HASH_LABELS_ENV
from kvlease.engine.labels import MAX_ENV as MAX_LABELS_ENV
from kvlease.engine.policy import blocks_for
from kvlease.engine.runtime import (
    DependencyError,
    VllmVersionError,
    check_dependencies,
    prepare_environment,
    require_vllm,
)
from kvlease.engine.tenancy import TIERS_ENV, TierConfigError, TierTable
from kvlease.exporters.tracing import ENABLE_ENV as OTEL_ENV
from kvlease.server.middleware import (
    DATA_PARALLEL_ENV,
    METRICS_AUTH_ENV,
    SALT_KEY_ENV,
    ConfigError,
    ServerConfig,
    error_body,
)

Ts = TypeVarTuple("Ts")  # a signal callback's arguments

DRAIN_SECONDS = 30  # vLLM's --shutdown-timeout unless given: in-flight requests finish
TEARDOWN_SECONDS = 20  # then the engines and their processes end, or are killed
SCHEDULER = "kvlease.engine.vllm_scheduler.TenantAwareScheduler"
MIDDLEWARE = "kvlease.server.middleware.TenantMiddleware"
ADMIN_PLUGIN = "kvlease_admin"
OWNED_FLAGS = ("--scheduler-cls",)
EXTERNAL_LB_FLAGS = (
    "--headless",
    "--data-parallel-rank",
    "--data-parallel-start-rank",
    "--data-parallel-external-lb",
    "--data-parallel-hybrid-lb",
    "--data-parallel-multi-port-external-lb",
)
STARTING = error_body(503, "the engine is starting; retry shortly", "engine_starting")


@dataclass(frozen=True)
class Flag:
    """One of kvlease serve's own flags, and where it goes: a `KVLEASE_*` variable the
    server's processes read (a path made absolute, a value, or "1" for a switch)."""

    flag: str
    kind: str  # "path", "int", "switch" or "arg" (read here, not passed on)
    env: str | None
    help: str


FLAGS = (
    Flag("--model", "arg", None, "PATH|ID: a local model folder or hub id (default: demo)"),
    Flag("--tiers", "path", TIERS_ENV, "PATH: the tier table TOML"),
    Flag("--jwt-keys", "path", KEYS_ENV, "PATH: a JWKS key ring"),
    Flag("--num-blocks", "int", None, "N: the KV pool, in blocks (vLLM's override)"),
    Flag("--max-tenant-labels", "int", MAX_LABELS_ENV, "N: tenant label values at most"),
    Flag("--otel", "switch", OTEL_ENV, "send OpenTelemetry spans"),
    Flag("--usage-db", "arg", None, "URL: the usage ledger"),
    Flag("--budgets", "path", BUDGETS_ENV, "PATH: the budget file"),
    Flag("--metrics-auth", "switch", METRICS_AUTH_ENV, "/metrics needs a metrics token"),
    Flag("--hash-tenant-labels", "switch", HASH_LABELS_ENV, "tenant ids hashed in labels"),
)


def _kvlease_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="kvlease serve", add_help=False)
    for f in FLAGS:
        if f.kind == "switch":
            parser.add_argument(f.flag, action="store_true")
        else:
            parser.add_argument(f.flag, type=int if f.kind == "int" else str, default=None)
    parser.add_argument("-h", "--help", action="store_true")
    return parser.parse_known_args(list(argv))


def _export(args: argparse.Namespace) -> None:
    """Copy kvlease's flags to the environment every server process reads."""
    for f in FLAGS:
        value = getattr(args, f.flag.removeprefix("--").replace("-", "_"))
        if f.env is None or value is None or value is False:  # unset (0 is a value)
            continue
        if f.kind == "path":
            value = Path(value).resolve()
        os.environ[f.env] = "1" if f.kind == "switch" else str(value)


def _has(flag: str, argv: Sequence[str]) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _allow_plugins() -> str:
    """VLLM_PLUGINS with kvlease's plugin added; unset means "all", so list them all."""
    current = os.environ.get("VLLM_PLUGINS")
    if current is not None:
        names = {n for n in current.split(",") if n}
    else:
        groups = ("vllm.general_plugins", "vllm.stat_logger_plugins", "vllm.io_processor_plugins")
        names = {ep.name for group in groups for ep in entry_points(group=group)}
    return ",".join(sorted(names | {ADMIN_PLUGIN}))


def vllm_argv(args: argparse.Namespace, rest: list[str], model: str, demo: bool) -> list[str]:
    """The vLLM server command line for these kvlease arguments."""
    argv = ["--model", model, *rest, "--scheduler-cls", SCHEDULER, "--middleware", MIDDLEWARE]
    if args.num_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(args.num_blocks)]
    if not _has("--enable-prompt-tokens-details", rest):
        argv.append("--enable-prompt-tokens-details")
    if not _has("--shutdown-timeout", rest):
        argv += ["--shutdown-timeout", str(DRAIN_SECONDS)]
    if demo:
        if not _has("--served-model-name", rest):
            argv += ["--served-model-name", "kvlease-demo"]
        if not _has("--block-size", rest):
            argv += ["--block-size", "32"]
        if not _has("--max-model-len", rest):
            fits = 2048
            if args.num_blocks is not None:  # what the lease caps leave (one null block)
                fits = TierTable.load().max_request_tokens(args.num_blocks - 1, 32)
            argv += ["--max-model-len", str(min(2048, fits))]
    return argv


def check_pool(vllm_args: argparse.Namespace) -> None:
    """vLLM keeps one block back, so a request of max_model_len needs blocks - 1, and the
    tier table's lease caps must leave it unreserved (the scheduler checks the same when
    vLLM sizes the pool itself; here the error comes before the engine starts)."""
    blocks = vllm_args.num_gpu_blocks_override
    block, max_len = vllm_args.block_size, vllm_args.max_model_len
    if blocks is None or not block or not max_len:
        return
    if max_len > (blocks - 1) * block:
        raise ConfigError(
            f"--num-blocks {blocks} of {block} tokens holds at most {(blocks - 1) * block} "
            f"tokens per request (one block is vLLM's null block); lower --max-model-len "
            f"({max_len}) or raise --num-blocks"
        )
    error = TierTable.load().pool_error(blocks - 1, blocks_for(max_len, block))
    if error is not None:
        raise ConfigError(f"--num-blocks {blocks}, --max-model-len {max_len}: {error}")


def vllm_cli_args():
    """vLLM's (make_arg_parser, validate_parsed_serve_args): 0.33 moved them from
    `entrypoints.launchers.cli_args` to `entrypoints.common.cli_args`."""
    try:
        from vllm.entrypoints.common import cli_args
    except ImportError:  # vLLM 0.32
        from vllm.entrypoints.launchers import cli_args
    return cli_args.make_arg_parser, cli_args.validate_parsed_serve_args


# Configuration errors: one line on stderr and exit status 2, never a traceback.
CONFIG_ERRORS = (
    ConfigError,
    TierConfigError,
    BudgetConfigError,
    VllmVersionError,
    DependencyError,
)


def run_serve(argv: Sequence[str]) -> int:
    args, rest = _kvlease_args(argv)
    if args.help:
        print(__doc__)
        print("kvlease flags:")
        for f in FLAGS:
            print(f"  {f.flag:22} {f.help}")
        print("every other flag is vLLM's: python -m vllm.entrypoints.openai.api_server --help")
        return 0
    if not processes.supervised("serve"):
        return _supervise(argv, rest)
    from kvlease.exporters.ledger import LedgerError

    try:
        vllm_args, api_servers = _configure(args, rest)
    except (*CONFIG_ERRORS, LedgerError) as exc:  # a ledger error's message hides the password
        print(f"kvlease serve: error: {exc}", file=sys.stderr)
        return 2
    if api_servers > 1:
        from vllm.entrypoints.cli.serve import run_multi_api_server

        run_multi_api_server(vllm_args)  # engines here, API processes spawned; blocks
        return 0
    try:
        with asyncio.Runner(loop_factory=_draining_loop()) as runner:
            runner.run(_serve(vllm_args))
    except KeyboardInterrupt:
        return 0
    return 0


def _supervise(argv: Sequence[str], rest: list[str]) -> int:
    """This command as the server's supervisor (kvlease.engine.processes): the server and
    every process vLLM starts end with it, its sockets and temporary files with them."""
    drain = float(_value("--shutdown-timeout", rest) or DRAIN_SECONDS)
    command = [sys.executable, "-m", "kvlease", "serve", *argv]
    return processes.supervise(command, dict(os.environ), "serve", drain + TEARDOWN_SECONDS)


def _value(flag: str, argv: Sequence[str]) -> str | None:
    """The last value `flag` is given in `argv` (as `--flag V` or `--flag=V`)."""
    found = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


def _configure(args: argparse.Namespace, rest: list[str]) -> tuple[argparse.Namespace, int]:
    """Check every setting before the engine starts (a bad one raises one of
    CONFIG_ERRORS), prepare the environment; vLLM's arguments and the API process count."""
    for flag in OWNED_FLAGS:
        if _has(flag, rest):
            raise ConfigError(f"{flag} is set by kvlease serve itself")
    _export(args)
    from kvlease.exporters.ledger import DB_ENV, UsageLedger, default_url

    os.environ[DB_ENV] = args.usage_db or default_url()
    UsageLedger(os.environ[DB_ENV])  # reachable, and migrated, before the engine starts
    ServerConfig.from_env()  # keys, tiers, salt: fail here, not inside the app
    require_vllm()
    check_dependencies()
    if os.environ.get(BUDGETS_ENV):
        BudgetTable.load(os.environ[BUDGETS_ENV])

    from kvlease.engine.channel import ADDRESS_ENV, new_address

    demo = args.model is None
    if demo:
        from kvlease.demo.model import ensure_demo_model

        model = str(ensure_demo_model())
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    else:
        model = args.model
    prepare_environment()
    os.environ[ADDRESS_ENV] = new_address()
    os.environ["VLLM_PLUGINS"] = _allow_plugins()

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser, validate_parsed_serve_args = vllm_cli_args()

    parser = make_arg_parser(FlexibleArgumentParser(prog="kvlease serve"))
    vllm_args = parser.parse_args(vllm_argv(args, rest, model, demo))
    validate_parsed_serve_args(vllm_args)
    check_pool(vllm_args)
    return vllm_args, scale_out(vllm_args)


def scale_out(vllm_args: argparse.Namespace) -> int:
    """Check the data-parallel shape and prepare the environment for it; the number of
    API processes.

    kvlease runs vLLM's internal load balancing on one node: `--data-parallel-size N`
    engines behind `--api-server-count M` API processes (M defaults to N, as with
    `vllm serve`). Every API process pins sessions to ranks (it needs N) and salts
    prefixes with one key (else a session's next turn through another API process
    misses its cache). Across nodes, run replicas behind a router instead."""
    for flag in EXTERNAL_LB_FLAGS:
        value = getattr(vllm_args, flag.removeprefix("--").replace("-", "_"), None)
        if value is not None and value is not False:  # a rank 0 is set too
            raise ConfigError(
                f"{flag} is not supported: kvlease serve runs vLLM's internal data-parallel "
                "load balancing on one node; across nodes run replicas (README: Running a fleet)"
            )
    ranks = vllm_args.data_parallel_size
    if vllm_args.api_server_count is None:
        vllm_args.api_server_count = ranks
    api_servers = vllm_args.api_server_count
    if api_servers < 1:
        raise ConfigError("--api-server-count must be at least 1")
    os.environ[DATA_PARALLEL_ENV] = str(ranks)
    if api_servers > 1:
        os.environ.setdefault(SALT_KEY_ENV, secrets.token_hex(32))
    else:
        vllm_args.api_server_count = None  # as vLLM's single-server path expects
    return api_servers


def _draining_loop() -> type:
    """uvloop's loop, telling the middleware when vLLM's SIGTERM/SIGINT drain begins.

    vLLM keeps accepting connections while it drains, but its renderer is shut down,
    so a request arriving then fails with a 500 ("cannot schedule new futures after
    shutdown"). vLLM installs its drain handler with `loop.add_signal_handler`; this loop
    runs `kvlease.server.middleware.DRAINING.set` first, and the middleware answers new requests
    with 503 and Retry-After from then on (a load balancer retries elsewhere)."""
    import uvloop

    from kvlease.server.middleware import DRAINING

    class Loop(uvloop.Loop):
        def add_signal_handler(
            self, sig: int, callback: Callable[[Unpack[Ts]], object], *args: *Ts
        ) -> None:
            if sig in (signal.SIGTERM, signal.SIGINT):

                def draining(*given: *Ts) -> None:
                    DRAINING.set()
                    callback(*given)

                return super().add_signal_handler(sig, draining, *args)
            return super().add_signal_handler(sig, callback, *args)

    return Loop


async def _serve(args: argparse.Namespace) -> None:
    from vllm.entrypoints.launchers.api_server.entry import (
        build_and_serve,
        build_async_engine_client,
    )
    from vllm.entrypoints.launchers.launcher import setup_server

    from kvlease.exporters.telemetry import TELEMETRY

    def interrupt(*_: object) -> None:  # SIGTERM while the engine starts: stop starting
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt)
    listen_address, sock = setup_server(args, reuse_port=False)
    TELEMETRY.start()  # bind the channel before the engine can send
    try:
        async with contextlib.AsyncExitStack() as engine:
            with _answer_503_while_starting(sock):
                client = await engine.enter_async_context(build_async_engine_client(args))
            shutdown = await build_and_serve(client, listen_address, sock, args)
        await shutdown  # as vLLM does: only after the engine context has exited
    finally:
        await asyncio.sleep(0.3)  # let the channel deliver the engine's last messages
        TELEMETRY.stop()
        sock.close()


@contextlib.contextmanager
def _answer_503_while_starting(sock: socket.socket):
    """Serve 503 on (a duplicate of) the listening socket until the block exits.

    vLLM builds its engine synchronously on the event loop, so the placeholder
    runs on its own thread and loop.
    """
    import uvicorn

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5")],
            }
        )
        await send({"type": "http.response.body", "body": STARTING})

    class Placeholder(uvicorn.Server):
        def capture_signals(self):  # leave SIGTERM/SIGINT to the launcher
            return contextlib.nullcontext()

    dup = socket.socket(fileno=os.dup(sock.fileno()))
    server = Placeholder(uvicorn.Config(app, lifespan="off", log_level="warning"))
    thread = threading.Thread(
        target=lambda: asyncio.run(server.serve(sockets=[dup])), name="kvlease-503", daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        dup.close()
