"""Data-parallel serving benchmark: N engine replicas on Ray behind the HTTP server, cache-aware
routing against round robin, a replica killed mid-workload, and the outputs against one engine's.

    zipage-jax bench data-parallel [--model default] [--replicas 2] [--json] [--out PATH]
    zipage-jax bench data-parallel --quick --model /path/to/tiny_model --json

The workload: --prefixes prompt prefixes of --prefix-tokens tokens (random words, tokenized by
the model's tokenizer), --requests-per-prefix requests each, each with its own short suffix, in a
shuffled order (with two replicas, an interleaved order would let round robin send each prefix
to one replica by chance), sent --concurrency at a time as greedy /v1/completions of
--max-tokens tokens.

  reference    one engine in this process (LLM.generate): the outputs every run must match.
  cache_aware  fresh replicas (empty caches) under --routing-policy cache_aware; a warm-up pass of
  round_robin  the same shapes with other prefixes first (so no compilation is timed), then the
               workload: its prefix-cache hit rate (prompt blocks found cached / looked up,
               summed over the replicas' /metrics), completion tokens per second, requests per
               second.
  fault        fresh replicas, cache_aware; requests of 8 x --max-tokens; every other request
               streams; replica 0's process is killed once it runs requests: how many requests still complete with the
               reference's text, and the seconds until the replica serves again.

"goals": hit rate cache_aware > round_robin; tokens/s cache_aware >= 0.95 x round_robin (5%
tolerance for a noisy machine); every request completes through the fault; the outputs equal the
reference's. Each goal has its value and "met"; the exit status is 1 only when a run failed.
Ray runs locally with --ray-cpus CPUs (a replica asks for one), unless RAY_ADDRESS names a
cluster. --quick (tests): a smaller workload and engine; pass a tiny model with --model.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

from zipage_jax.harness import add_output_arguments, build_llm, emit, log

SERVED_NAME = "bench"
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health").split()
THROUGHPUT_TOLERANCE = 0.95  # cache_aware's tokens/s may be this fraction of round robin's (a noisy machine)
FAULT_TIMEOUT_S = 600.0
# the fault run's requests are this many times longer, so replica 0 is seen running them (the server's
# gauges refresh about ten times a second) before the workload ends
FAULT_LENGTH = 8


@dataclass(frozen=True)
class Workload:
    replicas: int = 2
    prefixes: int = 4
    requests_per_prefix: int = 6
    prefix_tokens: int = 200
    suffix_tokens: int = 16
    max_tokens: int = 16
    concurrency: int = 4
    ray_cpus: int = 2


QUICK = Workload(prefixes=2, requests_per_prefix=4, prefix_tokens=64, suffix_tokens=8, max_tokens=8, concurrency=2)
ENGINE_DEFAULTS = {"kvcache_block_size": 16, "num_kvcache_blocks": 512, "max_num_seqs": 8, "max_model_len": 1024}
QUICK_ENGINE = {"kvcache_block_size": 16, "num_kvcache_blocks": 128, "max_num_seqs": 4, "max_model_len": 256}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from zipage_jax.cli_options import add_engine_arguments

    parser.description, parser.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    for name, default in asdict(Workload()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, metavar="N",
                            help=f"default: {default}; --quick: {getattr(QUICK, name)}")
    parser.add_argument("--quick", action="store_true", help="a small workload and engine (tests; a tiny --model)")
    add_output_arguments(parser)
    # engine options: --model, --kvcache-block-size (default 16: prefixes span blocks), --num-kvcache-blocks, ...
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from zipage_jax.cli_options import engine_options
    from zipage_jax.data_parallel.ray_cluster import RayCluster
    from zipage_jax.sampling_params import SamplingParams

    preset = QUICK if args.quick else Workload()
    workload = Workload(**{name: getattr(args, name) or value for name, value in asdict(preset).items()})
    options = {**(QUICK_ENGINE if args.quick else ENGINE_DEFAULTS), **engine_options(args), "warmup": False}
    model = options.setdefault("model", "default")
    result: dict = {"model": model, "workload": asdict(workload), "engine_options": options}
    errors: list[str] = []
    cluster = RayCluster.start(num_cpus=workload.ray_cpus)  # before JAX runs here: Ray forks processes
    try:
        log(f"reference: one engine of {model} in this process")
        llm = build_llm(**options)
        rng = random.Random(0)
        warmup_prompts, prompts = (shared_prefix_prompts(llm.tokenizer, workload, rng),
                                   shared_prefix_prompts(llm.tokenizer, workload, rng))
        greedy = SamplingParams(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True)
        reference = [r["text"] for r in llm.generate(prompts, greedy, use_tqdm=False)]
        fault_workload = replace(workload, max_tokens=workload.max_tokens * FAULT_LENGTH)
        fault_reference = [r["text"] for r in llm.generate(
            prompts, replace(greedy, max_tokens=fault_workload.max_tokens), use_tqdm=False)]
        del llm
        gc.collect()
        for policy in ("cache_aware", "round_robin"):
            log(f"{policy}: {workload.replicas} fresh replicas")
            result[policy] = _guarded(errors, policy, policy_run, options, workload, policy, warmup_prompts, prompts,
                                      reference)
        log("fault: replica 0 is killed mid-workload")
        result["fault"] = _guarded(errors, "fault", fault_run, options, fault_workload, warmup_prompts, prompts,
                                   fault_reference)
    finally:
        cluster.stop()
    result["goals"] = goals(result)
    result["errors"] = errors
    return emit(result, args, status=1 if errors else 0)


def shared_prefix_prompts(tokenizer, workload: Workload, rng: random.Random) -> list[list[int]]:
    """The workload's prompts (token ids), shuffled."""
    def tokens(n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            ids += tokenizer(" " + " ".join(rng.choice(WORDS) for _ in range(n)), add_special_tokens=False)["input_ids"]
        return ids[:n]

    prefixes = [tokens(workload.prefix_tokens) for _ in range(workload.prefixes)]
    prompts = [prefix + tokens(workload.suffix_tokens) for prefix in prefixes
               for _ in range(workload.requests_per_prefix)]
    rng.shuffle(prompts)
    return prompts


def _guarded(errors: list[str], name: str, fn, *args) -> dict:
    """fn(*args), or the error it raised (also added to `errors`)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a failed run is reported, the others still run
        errors.append(f"{name}: {type(exc).__name__}: {exc}")
        log(f"{name} failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}


def policy_run(options: dict, workload: Workload, policy: str, warmup_prompts: list, prompts: list,
               reference: list[str]) -> dict:
    with ReplicatedServer(options, workload.replicas, policy) as server:
        server.send_all(warmup_prompts, workload)
        before = server.metrics()
        start = time.perf_counter()
        results = server.send_all(prompts, workload)
        seconds = time.perf_counter() - start
        after = server.metrics()
    hits = _delta(before, after, "vllm:prefix_cache_hits_total")
    queries = _delta(before, after, "vllm:prefix_cache_queries_total")
    tokens = sum(n for _, _, n in results)
    return {"prefix_cache_hit_rate": hits / queries if queries else 0.0, "prefix_cache_hits": hits,
            "prefix_cache_queries": queries, "seconds": seconds, "completion_tokens": tokens,
            "tokens_per_s": tokens / seconds, "requests_per_s": len(prompts) / seconds,
            "completion_tokens_per_replica": _delta(before, after, "vllm:generation_tokens_total", per_replica=True),
            "all_succeeded": all(ok for ok, _, _ in results),
            "outputs_equal": [text for _, text, _ in results] == reference}


def fault_run(options: dict, workload: Workload, warmup_prompts: list, prompts: list, reference: list[str]) -> dict:
    with ReplicatedServer(options, workload.replicas, "cache_aware") as server:
        server.send_all(warmup_prompts, workload)
        base = server.metrics().get("vllm:generation_tokens_total", {}).get("0", 0.0)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(server.send_all, prompts, workload, 2)
            killed_at = None
            while not pending.done() and killed_at is None:
                m = server.metrics()
                if m["vllm:num_requests_running"]["0"] >= 1 and m["vllm:generation_tokens_total"]["0"] > base:
                    os.kill(server.engine.replica_pids()[0], signal.SIGKILL)
                    killed_at = time.monotonic()
                time.sleep(0.02)
            results = pending.result(FAULT_TIMEOUT_S)
        back_s = None
        if killed_at is not None:
            deadline = time.monotonic() + FAULT_TIMEOUT_S
            while time.monotonic() < deadline and server.metrics()["zipage:replica_serving"]["0"] != 1:
                time.sleep(0.2)
            back_s = time.monotonic() - killed_at if server.metrics()["zipage:replica_serving"]["0"] == 1 else None
    succeeded = [ok and text == expected for (ok, text, _), expected in zip(results, reference)]
    return {"killed": killed_at is not None, "requests": len(prompts), "succeeded": sum(succeeded),
            "streamed": len(prompts[::2]), "streamed_succeeded": sum(succeeded[::2]),
            "replica_back_s": back_s}


def goals(result: dict) -> dict:
    ca, rr, fault = result.get("cache_aware", {}), result.get("round_robin", {}), result.get("fault", {})

    def goal(what: str, value, target, met) -> dict:
        return {"what": what, "value": value, "goal": target, "met": None if value is None else bool(met)}

    ratio = (ca["tokens_per_s"] / rr["tokens_per_s"]) if "tokens_per_s" in ca and "tokens_per_s" in rr else None
    ca_hits, rr_hits = ca.get("prefix_cache_hit_rate"), rr.get("prefix_cache_hit_rate")
    equal = [run.get("outputs_equal") for run in (ca, rr)]
    return {
        "hit_rate_cache_aware_over_round_robin": goal(
            "prefix-cache hit rate, cache_aware minus round_robin", None if None in (ca_hits, rr_hits)
            else ca_hits - rr_hits, "> 0", ca_hits is not None and rr_hits is not None and ca_hits > rr_hits),
        "throughput_cache_aware_over_round_robin": goal(
            "completion tokens/s, cache_aware / round_robin", ratio, f">= {THROUGHPUT_TOLERANCE}",
            ratio is not None and ratio >= THROUGHPUT_TOLERANCE),
        "requests_through_a_replica_death": goal(
            "requests completed with the reference's output while replica 0 was killed", fault.get("succeeded"),
            f"== {fault.get('requests')}", fault.get("killed") and fault.get("succeeded") == fault.get("requests")),
        "outputs_equal_one_engine": goal(
            "greedy outputs of both runs equal one engine's", None if None in equal else all(equal), "true",
            all(e is True for e in equal)),
    }


def _delta(before: dict, after: dict, name: str, per_replica: bool = False):
    changes = {r: v - before.get(name, {}).get(r, 0.0) for r, v in after.get(name, {}).items()}
    return changes if per_replica else sum(changes.values())


class ReplicatedServer:
    """The OpenAI server over a ReplicatedEngine, in a uvicorn thread on a free port of 127.0.0.1."""

    def __init__(self, options: dict, replicas: int, policy: str):
        import httpx
        import uvicorn

        from zipage_jax.data_parallel.replicated_engine import ReplicatedEngine
        from zipage_jax.server import create_app
        from zipage_jax.server.engine_client import InProcessEngineClient

        self.client = InProcessEngineClient(
            lambda: ReplicatedEngine(data_parallel_size=replicas, routing_policy=policy, **options))
        self.app = create_app(self.client, [SERVED_NAME])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.http = httpx.Client(base_url=self.url, timeout=FAULT_TIMEOUT_S)

    def __enter__(self) -> ReplicatedServer:
        self._thread.start()
        deadline = time.monotonic() + FAULT_TIMEOUT_S
        while not (self._server.started and self.http.get("/health").status_code == 200):
            if self.client.load_error is not None:
                raise RuntimeError(f"the replicas did not load: {self.client.load_error}")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not become ready")
            time.sleep(0.2)
        return self

    @property
    def engine(self):
        """The ReplicatedEngine, once loaded (the client's core)."""
        return self.client.core

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(60)
        if self.engine is not None:
            self.engine.shutdown()

    def metrics(self) -> dict[str, dict[str, float]]:
        """/metrics samples labelled by replica: name -> replica -> value."""
        samples: dict[str, dict[str, float]] = {}
        for line in self.http.get("/metrics").text.splitlines():
            if 'replica="' in line and not line.startswith("#"):
                name, rest = line.split("{", 1)
                replica = rest.split('replica="', 1)[1].split('"', 1)[0]
                samples.setdefault(name, {})
                samples[name][replica] = samples[name].get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
        return samples

    def send_all(self, prompts: list[list[int]], workload: Workload, stream_every: int = 0) -> list[tuple]:
        """Every prompt as a greedy completion, `workload.concurrency` at a time (every
        `stream_every`-th one streamed): (completed, text, completion tokens) each, in order."""
        def send(i: int) -> tuple[bool, str, int]:
            body = dict(model=SERVED_NAME, prompt=prompts[i], max_tokens=workload.max_tokens, temperature=0,
                        ignore_eos=True)
            if stream_every and i % stream_every == 0:
                return self._stream(body)
            r = self.http.post("/v1/completions", json=body)
            if r.status_code != 200:
                return False, "", 0
            return True, r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]

        with ThreadPoolExecutor(workload.concurrency) as pool:
            return list(pool.map(send, range(len(prompts))))

    def _stream(self, body: dict) -> tuple[bool, str, int]:
        text, chunks, done = [], 0, False
        with self.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        return False, "".join(text), chunks
                    text.append(event["choices"][0]["text"])
                    chunks += 1
        return done and r.status_code == 200, "".join(text), chunks
