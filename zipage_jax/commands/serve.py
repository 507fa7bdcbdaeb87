"""zipage-jax serve: the OpenAI-compatible server.

    zipage-jax serve --model default --port 8000 --kvcache-block-size 32 --max-cache-blocks-per-seq 8

Every EngineConfig and ServerConfig field is a flag (--max-num-seqs, --num-kvcache-blocks,
--port, ...), its help the field's documentation. The engine core (scheduling and the device)
runs in a process of its own, this one keeps HTTP, tokenization and output processing
(server/process_client.py); with --data-parallel-size or --num-processes the core's front stays
in this process (its replicas or its group are processes of their own). The server answers at once; /health is 503
until the model has loaded and the largest compiled program of each kind is built, then 200:
the server warms up in the background (the other programs build behind those) unless
--no-warmup, with which steps compile what they need on first use. Exits
with status 1 if the model fails to load, or once the engine fails for good (a failed device
step it could not recover from). Prompts and stop strings per request are unbounded unless a
--max-* flag below bounds them, as in vLLM; chat messages, their text and the queue have
generous bounds. With --api-key (or ZIPAGE_API_KEY / VLLM_API_KEY) the /v1 and tokenizer
routes need `Authorization: Bearer KEY`. docs/openai-compatibility.md lists every parameter and
route.

SIGTERM or SIGINT drains the server (server/shutdown.py): it stops admitting at once (/health,
generation and tokenizer routes answer 503 "the server is shutting down", the port still open),
lets the requests in flight finish for at most --shutdown-timeout seconds (default 30; 0: none),
aborts those left (a 503, or an error event then `data: [DONE]` ending a stream) and exits with
status 0; a second signal aborts at once. The engine core's process, the data-parallel replicas and the local Ray
stop with it, and process 0 of a group stops the others (a signalled one goes on until then, a
second signal ending it at once).

One model over several processes (hosts): every process runs the same command with its own
--process-id, --coordinator-address HOST:PORT naming process 0's host, and a
--tensor-parallel-size spanning every process's devices. Process 0 serves HTTP and schedules;
the others build the same engine and replay each device call of process 0's, sent over a TCP
connection to process 0's relay port (--relay-port, by default the coordinator's port + 1,
listening on the coordinator's host only). Every process holds the group's secret,
ZIPAGE_RELAY_SECRET or the file --relay-secret-file names (at least 16 characters; process 0
generates one and prints it to stderr when given none): before anything else crosses a relay
connection both ends prove they hold it (HMAC challenge and response), and a connection that
does not is dropped with a warning. The messages are msgpack frames of a fixed schema, bounded in
size, never pickles. The others send process 0 a heartbeat every second; one silent for 10 s
counts as lost. When a process is lost, process 0 fails the requests in flight and exits with
status 1, and the others exit with status 1 when process 0 does, so a supervisor restarts the
group (engine/runner/step_relay.py).

Several replicas of the model behind one server: --data-parallel-size N runs N engines as Ray
actors (a local Ray instance, or the cluster $RAY_ADDRESS names), each with its own devices,
and --routing-policy picks each request's replica (zipage_jax/data_parallel/). A replica that
dies is restarted; its requests run again on another one.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import jax
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zipage_jax.cli_options import (
    add_distributed_arguments,
    add_engine_arguments,
    add_field_argument,
    engine_options,
    start_distributed,
)
from zipage_jax.config import EngineConfig
from zipage_jax.engine.core import EngineCore
from zipage_jax.engine.runner.relay_auth import MIN_SECRET_CHARS, SECRET_ENV, new_secret, relay_secret
from zipage_jax.engine.runner.step_relay import EXIT_STATUS, LeaderRelay, exit_now, follow, relay_address
from zipage_jax.server import create_app
from zipage_jax.server.auth import api_key_from
from zipage_jax.server.config import ServerConfig, server_option_fields
from zipage_jax.server.engine_client import EngineClient, InProcessEngineClient, RequestFailed
from zipage_jax.server.process_client import MultiProcessEngineClient
from zipage_jax.server.shutdown import ENGINE_STOP_S, GracefulServer, defer_signals_to_process_0

logger = logging.getLogger("zipage_jax")

_WARMUP_HELP = ("build every compiled program in the background once the model has loaded, the largest of each "
                "kind first; /health, generation and tokenizer routes answer 503 until those are ready (default: "
                "on; --no-warmup: serve at once, compiling programs when the first requests need them)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for field, kind in server_option_fields():
        add_field_argument(parser, field, kind)
    add_engine_arguments(parser, help={"warmup": _WARMUP_HELP})
    group = add_distributed_arguments(parser)
    group.add_argument("--relay-port", type=int, metavar="PORT",
                       help="the TCP port process 0 listens on, on the coordinator's host, for the other processes, "
                            "which replay its device calls (default: the coordinator's port + 1); a connection must "
                            "prove it holds the group's relay secret before process 0 reads anything else of it")
    group.add_argument("--relay-secret-file", metavar="PATH",
                       help=f"a file holding the group's relay secret, the same in every process (at least "
                            f"{MIN_SECRET_CHARS} characters; default: ${SECRET_ENV}; process 0 generates one and "
                            "prints it when neither is given)")


def run(args: argparse.Namespace) -> int:
    options = engine_options(args)
    options.setdefault("model", "default")
    warmup = options.pop("warmup", True)  # the server warms up in the background, not in the engine's constructor
    options["warmup"] = False

    def stop(exc: BaseException) -> None:  # the model failed to load, or the engine failed
        server.should_exit = True

    def peer_lost(reason: str) -> None:  # the relay's watchdog: another process of the group is gone
        client.fail_requests(RequestFailed(reason))
        server.should_exit = True

    relay: LeaderRelay | None = None
    cluster = None  # data-parallel serving's Ray
    engine_stop: float | None = None  # the engine's time to stop once drained (None: its step in progress ends)

    def core() -> EngineCore:
        built = EngineCore(**options)
        if relay is not None:
            relay.attach(built.runner)  # the other processes have built theirs
        return built

    try:  # bad flags fail here, before binding the port
        engine_config = EngineConfig.from_options(**options)
        config = ServerConfig.from_options(**{field.name: getattr(args, field.name)
                                              for field, _ in server_option_fields()})
        if config.data_parallel_size != 1:
            factory, cluster = _replicated(config, options, args)
            client: EngineClient = InProcessEngineClient(factory)
        elif (args.num_processes or 1) > 1:  # process 0 of a group: the core relays its calls from here
            client = InProcessEngineClient(core)
        else:
            client = MultiProcessEngineClient(engine_config, log_level=config.log_level)
            engine_stop = ENGINE_STOP_S  # then its process is killed
        app = create_app(client, config.served_model_name or [options["model"]],
                         stop, max_n=config.max_n, max_request_bytes=config.max_request_bytes, limits=config.limits,
                         on_engine_error=stop, max_queued_requests=config.max_queued_requests,
                         api_key=api_key_from(config.api_key, os.environ), warmup=warmup,
                         enable_auto_tool_choice=config.enable_auto_tool_choice,
                         tool_call_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser,
                         stream_interval=config.stream_interval)
        address = relay_address(args.coordinator_address, args.relay_port) if (args.num_processes or 1) > 1 else None
        secret = _relay_secret(args) if address is not None else b""
        if address is not None and not args.process_id:  # process 0 listens before the group forms
            relay = LeaderRelay(*address, args.num_processes - 1, on_lost=peer_lost, secret=secret)
        start_distributed(args)
    except ValueError as exc:
        _usage_error(str(exc))
    except OSError as exc:
        _usage_error(f"cannot listen for the other processes on port {address[1]} of {address[0]}: {exc}")

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.process_id:
        defer_signals_to_process_0(force_exit=exit_now)
        return _follow(options, address, args.process_id, warmup, secret)
    served = app if relay is None else _on_shutdown(app, lambda: _stop_group(relay, client))
    serving = app.state.serving
    server = GracefulServer(uvicorn.Config(served, host=config.host, port=config.port, log_level=config.log_level),
                            config.shutdown_timeout, lambda: serving.stop_admitting(engine_stop),
                            serving.abort_in_flight)
    try:
        server.run()
    finally:
        if cluster is not None:
            cluster.stop()
    return 1 if _failed(client) else 0


def _failed(client: EngineClient) -> bool:
    return client.load_error is not None or client.engine_error is not None


def _on_shutdown(app: ASGIApp, shutdown: Callable[[], None]) -> ASGIApp:
    """`app`, calling `shutdown()` once its lifespan has shut down (its engine stopped)."""
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def sending(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                shutdown()
            await send(message)

        await app(scope, receive, sending)

    return wrapped


def _stop_group(relay: LeaderRelay, client: EngineClient) -> None:
    """Process 0's server has shut down: after a clean stop the other processes stop too (status 0);
    after a failure this one exits at once (status 1) and they see its connection close."""
    if relay.lost is not None or _failed(client):
        exit_now()
    relay.close()
    # They leave the jax.distributed group as they exit: this process leaves with them now (its
    # coordination service gone unannounced would abort them).
    jax.distributed.shutdown()


def _relay_secret(args: argparse.Namespace) -> bytes:
    """The group's relay secret (--relay-secret-file, else $ZIPAGE_RELAY_SECRET); process 0 given
    none generates one and prints it once. ValueError for another process given none."""
    secret = relay_secret(os.environ, args.relay_secret_file)
    if secret is not None:
        return secret
    if args.process_id:
        raise ValueError(f"process {args.process_id} needs the group's relay secret, the one process 0 has: set "
                         f"{SECRET_ENV} or pass --relay-secret-file PATH")
    generated = new_secret()
    print(f"zipage-jax serve: the relay's secret, generated as none was given: {generated}\n"
          f"  give every other process of the group the same: {SECRET_ENV}={generated} in its environment, or "
          "--relay-secret-file PATH naming a file that holds it", file=sys.stderr, flush=True)
    return generated.encode()


def _follow(options: dict, address: tuple[str, int], process_id: int, warmup: bool, secret: bytes) -> int:
    """Process 1 .. N-1: builds the engine as process 0 does and replays its device calls until it
    stops (0); exits at once (status 1) when process 0 is gone or a call failed."""
    try:
        status = follow(EngineCore(**options).runner, address, process_id, warmup, secret)
    except Exception:  # noqa: BLE001 - the group cannot serve without this process
        logger.exception("process %d cannot follow process 0", process_id)
        status = EXIT_STATUS
    if status:
        exit_now()
    return 0


def _replicated(config: ServerConfig, options: dict, args: argparse.Namespace):
    """--data-parallel-size N: the factory of N engine replicas on Ray, and the Ray cluster (started
    or connected to here; Ray is imported only for this). ValueError for flags that do not fit."""
    if config.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {config.data_parallel_size}")
    if (args.num_processes or 1) > 1:
        raise ValueError("--data-parallel-size does not combine with --num-processes (each replica is one process)")
    from zipage_jax.data_parallel.ray_cluster import RayCluster, replica_actor_options
    from zipage_jax.data_parallel.replicated_engine import ReplicatedEngine

    size, policy = config.data_parallel_size, config.routing_policy
    cluster = RayCluster.start(num_cpus=max(os.cpu_count() or 1, size))
    try:
        actor_options = replica_actor_options(size, EngineConfig.from_options(**options).tensor_parallel_size)
    except ValueError:
        cluster.stop()
        raise
    return lambda: ReplicatedEngine(data_parallel_size=size, routing_policy=policy, actor_options=actor_options,
                                    **options), cluster


def _usage_error(message: str) -> NoReturn:
    print(f"zipage-jax serve: error: {message}", file=sys.stderr)
    raise SystemExit(2)
