"""A soak run: mixed traffic against a live server for a bounded time, then checks that nothing
leaked, slowed down or went wrong.

    zipage-jax bench soak [--duration 600] [--warmup-s 30] [--rate 2] [--concurrency 8] [--seed 0]
        [--mix KIND=WEIGHT ...] [--data-parallel-size 1] [--kill-replica-at S] [engine flags]
        [--json] [--out PATH]

`zipage-jax serve` starts on a free port of 127.0.0.1 with the engine flags given (by default
ENGINE_DEFAULTS on the embedded SmolLM2-135M-Instruct: the mix needs a chat template and a fast
tokenizer, which the random-weight models lack). Once /health is 200, the warm-up sends one
request of every kind and every greedy case in turn, then the mix for --warmup-s seconds; at
idle the bench reads the free KV blocks (/metrics: zipage:kv_free_blocks, summed over replicas)
and the RSS of the server's process tree. Then the measured run: the mix (soak_mix.py) for
--duration seconds, Poisson arrivals at --rate per second (--seed, the engine's flag, seeds them
and the requests too), at most --concurrency in flight; with --data-parallel-size >= 2 one
replica's process is SIGKILLed at --kill-replica-at seconds (default: half-way) and Ray
restarts it. The bench stops sending at the end, waits for what is
in flight, and at idle (every replica serving again) reads blocks and RSS again; then stops the
server with SIGTERM (it drains; SIGKILL after its --shutdown-timeout and a grace), and runs the
greedy cases offline (zipage_jax.LLM, the same engine options) to check the server's answers
token for token.

The result (soak_checks.py): requests by kind and outcome, every unexpected one (a status or
body the request did not deserve; the replica-kill rule is in soak_checks.py), greedy answers
against offline, free blocks at the end against after the warm-up, RSS growth after the
warm-up, p50/p99 seconds of whole requests in the run's first and last tenth, and the goals:
0 unexpected, greedy identical, 0 leaked blocks, RSS growth <= 5%, p99 last tenth <= 1.5x the
first. The exit status is 1 when a goal is missed or the run failed. The client needs httpx
(the test extra).

A 30-minute run of two replicas, one killed half-way:

    zipage-jax bench soak --duration 1800 --data-parallel-size 2 --json --out docs/results/bench_soak_dp2.json
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

from zipage_jax.bench.soak_checks import all_met, soak_report, table
from zipage_jax.bench.soak_mix import GREEDY_CASES, GREEDY_TOKENS, KINDS, Mix, parse_weights
from zipage_jax.harness import add_output_arguments, emit, log, usage_error

ENGINE_DEFAULTS = {"kvcache_block_size": 16, "num_kvcache_blocks": 1024, "max_num_seqs": 16, "max_model_len": 1024,
                   "warmup": False}
MAX_REQUEST_BYTES = 64 * 1024  # the server's --max-request-bytes here: an oversize body costs little to send
IDLE_TIMEOUT_S = 300.0
FREE = "zipage:kv_free_blocks"
# the engine's work in the measured run, from /metrics (a killed replica's restart zeroes its own)
RUN_COUNTERS = ("vllm:generation_tokens_total", "zipage:compressions_total", "vllm:num_preemptions_total",
                "vllm:prefix_cache_hits_total")  # for the server to finish its work and its replicas to serve again


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from zipage_jax.cli_options import add_engine_arguments

    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    parser.add_argument("--duration", type=float, default=600.0, metavar="S", help="seconds of measured traffic")
    parser.add_argument("--warmup-s", type=float, default=30.0, metavar="S",
                        help="seconds of traffic before the measured run (after one request of every kind)")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second on average (Poisson arrivals)")
    parser.add_argument("--concurrency", type=int, default=8, help="the most requests in flight")
    parser.add_argument("--mix", nargs="+", default=[], metavar="KIND=WEIGHT",
                        help="weights over the defaults; kinds: " + "; ".join(
                            f"{kind} ({weight:g}): {text}" for kind, (weight, text) in KINDS.items()))
    parser.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                        help="engine replicas on Ray behind the server")
    parser.add_argument("--kill-replica-at", type=float, metavar="S",
                        help="with --data-parallel-size >= 2: SIGKILL a replica's process this many seconds into "
                             "the run (default: half-way)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                        help="the server's --shutdown-timeout (the bench waits that long and a grace for it)")
    add_output_arguments(parser)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from zipage_jax.cli_options import engine_options

    try:
        weights = parse_weights(args.mix)
    except ValueError as exc:
        usage_error("bench soak", str(exc))
    for name in ("duration", "rate"):
        if not getattr(args, name) > 0:
            usage_error("bench soak", f"--{name} must be > 0")
    if args.warmup_s < 0 or args.concurrency < 1 or args.data_parallel_size < 1:
        usage_error("bench soak", "--warmup-s must be >= 0, --concurrency and --data-parallel-size >= 1")
    args.seed = 0 if args.seed is None else args.seed  # the engine's flag: it seeds the traffic too
    kill_at = args.kill_replica_at
    if args.data_parallel_size >= 2:
        kill_at = args.duration / 2 if kill_at is None else kill_at
        if not 0 <= kill_at < args.duration:
            usage_error("bench soak", "--kill-replica-at must be in [0, --duration)")
    elif kill_at is not None:
        usage_error("bench soak", "--kill-replica-at needs --data-parallel-size >= 2")
    options = {**ENGINE_DEFAULTS, **engine_options(args)}
    model = options.setdefault("model", "default")
    server_options = {**options, "data_parallel_size": args.data_parallel_size,
                      "max_request_bytes": MAX_REQUEST_BYTES, "shutdown_timeout": args.shutdown_timeout}
    result: dict = {"model": model, "server_options": server_options, "workload": {
        "duration_s": args.duration, "warmup_s": args.warmup_s, "rate": args.rate, "concurrency": args.concurrency,
        "seed": args.seed, "mix": weights, "data_parallel_size": args.data_parallel_size,
        "kill_replica_at_s": kill_at}}
    start = time.monotonic()
    mix = Mix(weights, args.seed, model, MAX_REQUEST_BYTES)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # a stopped bench stops its server (and its Ray) first
    try:
        observed = _serve(server_options, mix, args, kill_at)
    except (RuntimeError, TimeoutError) as exc:
        log(f"the soak run failed: {exc}")
        return emit({**result, "error": str(exc)}, args, status=1)
    records, blocks, rss = observed.pop("records"), observed.pop("blocks"), observed.pop("rss")
    log("the greedy cases offline")
    offline_start = time.monotonic()
    expected = offline_greedy_tokens(options)
    observed["phase_seconds"]["offline_greedy"] = round(time.monotonic() - offline_start, 1)
    result.update(observed)
    result.update(soak_report(records, expected, args.duration, observed["kill"].get("at_s"), blocks, rss))
    result.update(wall_seconds=round(time.monotonic() - start, 1))
    log(table(result))
    return emit(result, args, status=0 if all_met(result) else 1)


def _exit_on_sigterm(sig: int, frame: object) -> None:
    raise SystemExit(128 + sig)


def _serve(options: dict, mix: Mix, args: argparse.Namespace, kill_at: float | None) -> dict:
    """The warm-up and the measured run against a live server: the records, the free blocks and
    RSS after the warm-up and at the end, the kill, the engine's counters over the run, the
    seconds of each phase and the server's exit status."""
    from zipage_jax.bench.soak_client import Traffic  # httpx: the test extra
    from zipage_jax.bench.soak_server import SoakServer

    replicas = args.data_parallel_size
    kill: dict = {}
    marks = [("start", time.monotonic())]
    with SoakServer(options, args.shutdown_timeout) as server:
        marks.append(("server_start", time.monotonic()))
        try:
            traffic = Traffic(server.url, mix, args.concurrency, time.monotonic())
            log(f"warm-up: every kind once, then {args.warmup_s:g} s of traffic")
            asyncio.run(traffic.sequential(mix.one_of_each(), "warmup"))
            traffic.restart_clock()
            asyncio.run(traffic.poisson(0.0, args.warmup_s, args.rate, args.seed, "warmup"))
            before = server.wait_idle(replicas, IDLE_TIMEOUT_S)
            rss_after_warmup = server.rss_bytes()
            marks.append(("warmup", time.monotonic()))

            def kill_replica() -> None:
                kill.update(at_s=round(traffic.now(), 3), pid=server.kill_replica())
                log(f"killed replica process {kill['pid']} at {kill['at_s']} s")

            log(f"run: {args.duration:g} s at {args.rate:g} requests/s, at most {args.concurrency} in flight")
            traffic.restart_clock()
            asyncio.run(traffic.poisson(0.0, args.duration, args.rate, args.seed + 1, "run",
                                        at=None if kill_at is None else (kill_at, kill_replica)))
            marks.append(("run", time.monotonic()))
            after = server.wait_idle(replicas, IDLE_TIMEOUT_S)
            rss_end = server.rss_bytes()
            marks.append(("idle_after_run", time.monotonic()))
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{exc}\nthe server's log:\n{server.log_tail()}") from exc
    marks.append(("server_stop", time.monotonic()))
    return {"records": traffic.records, "kill": kill, "server_exit_status": server.exit_status,
            "run_counters": {name: after.get(name, 0.0) - before.get(name, 0.0) for name in RUN_COUNTERS},
            "blocks": {"start": int(before[FREE]), "end": int(after[FREE])},
            "rss": {"after_warmup": rss_after_warmup, "end": rss_end},
            "phase_seconds": {name: round(t - marks[i][1], 1) for i, (name, t) in enumerate(marks[1:])}}


def offline_greedy_tokens(options: dict) -> list[list[str]]:
    """Each greedy case's tokens from an engine in this process, as the server shows them
    (logprobs' tokens: each id decoded alone)."""
    from zipage_jax.harness import build_llm
    from zipage_jax.sampling_params import SamplingParams

    llm = build_llm(**options)
    params = [SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, kv_budget=c.kv_budget)
              for c in GREEDY_CASES]
    outs = llm.generate([c.prompt for c in GREEDY_CASES], params, use_tqdm=False)
    return [[llm.tokenizer.decode([t]) for t in out["token_ids"]] for out in outs]

