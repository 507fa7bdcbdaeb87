"""ReplicatedEngine: an engine core (what EngineDriver drives: add_requests, step, abort, ...) over
N engine replicas, each an EngineReplica actor on Ray holding its own devices and its own core.

    client = InProcessEngineClient(lambda: ReplicatedEngine(model="default", data_parallel_size=2))
    app = create_app(client, ["default"])
    # (Ray initialized first: data_parallel.ray_cluster.RayCluster.start); the server is unchanged

The front holds no model: the tokenizer and the ModelInfo are replica 0's. A request goes to the
replica the Router picks among those serving, and `add_requests` waits until that replica has
admitted it, so a bad request raises the engine's ValueError (the server's 400). Each replica's
core numbers its sequences itself: the front gives every sequence a seq id of its own and
translates in both directions (outputs coming back, stop strings' finishes going out). A
collector thread keeps a poll outstanding on every live replica; `step()` hands back what the
polls brought, merged into one EngineCoreOutputs (waiting a little for it).

Faults. A replica whose process dies is restarted by Ray (max_restarts=-1); it is out of the
rotation until it answers a ping again (its model reloaded, and with a warm-up its serving set
built). Its requests run again on another replica with the same parameters (under the same front
seq ids): the Delivery of each holds back the tokens already handed on, so a request whose
tokens are the same in every run (greedy, or seeded) goes on as if nothing happened; one that
had handed on tokens and samples without a seed fails. With no replica serving, requests wait
up to `no_replica_timeout_s`, then fail; the engine is `healthy` while some replica serves and
`failed` once every replica is gone for good (its model no longer loads). A request that fails
here reaches the output stage as one of a step's `failures`.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from zipage_jax.config import EngineConfig
from zipage_jax.data_parallel.delivery import Delivery, Diverged
from zipage_jax.data_parallel.ray_cluster import replica_actor_options
from zipage_jax.data_parallel.replica import Admitted, EngineReplica, ReplicaPoll, ReplicaStatus
from zipage_jax.data_parallel.router import ROUTING_POLICIES, Router
from zipage_jax.engine import driver
from zipage_jax.engine.core import AdmittedRequest, EngineFailed, ModelInfo
from zipage_jax.engine.core_outputs import EngineCoreOutputs
from zipage_jax.engine.stats import EngineStats, WarmupStatus
from zipage_jax.sampling_params import SamplingParams

logger = logging.getLogger("zipage_jax.data_parallel")

NO_REPLICA_TIMEOUT_S = 60.0
_POLL_S = 0.5  # a replica's poll returns after this long without events
_WAIT_S = 0.1  # the collector wakes at least this often (pending requests, pings to retry)
_STEP_WAIT_S = 0.05  # step() waits this long for outputs
_PING_RETRY_S = 0.5  # between pings of a replica that is restarting
_STOP_S = 60.0  # a replica's stop waits this long at most for its warm-up's programs


class ReplicaState(enum.Enum):
    SERVING = "serving"  # takes requests
    WARMING = "warming"  # alive, building its warm-up's serving set
    DOWN = "down"  # its process died; Ray restarts it
    GONE = "gone"  # dead for good


@dataclass
class ReplicatedStats(EngineStats):
    """The replicas' stats summed (usage and hit rate over their sums) when taken, with live views
    (kept current by the collector, also while the server is idle and takes no new snapshot) of
    each replica's latest stats (None before its first) and of whether it serves."""

    replicas: list[EngineStats | None] = field(default_factory=list)
    serving: list[bool] = field(default_factory=list)


@dataclass(eq=False)
class _Replica:
    index: int
    actor: Any
    pid: int
    incarnation: str
    state: ReplicaState = ReplicaState.SERVING
    warmup: WarmupStatus | None = None
    poll_ref: Any = None
    ping_ref: Any = None
    next_ping: float = 0.0
    orphans: list[str] = field(default_factory=list)  # engine ids moved away when it was lost
    lag_told: tuple[str, int] = ("", 0)  # (incarnation, its step) the latest output_lag told it


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    params: SamplingParams
    seq_ids: list[int]  # the front's, by completion index (the same in every run)
    delivery: Delivery
    finished: list[bool]  # by completion index: its sequence ended (its finish handed on, or a stop string)
    replica: int | None = None  # None while pending
    engine_id: str = ""  # its id on its replica: the request id, then "<id>~<run>" for a rerun
    replica_seq_ids: list[int] = field(default_factory=list)  # its seq ids on its replica, once admitted there
    runs: int = 0
    pending_since: float = 0.0

    @property
    def replayable(self) -> bool:
        """Every run produces the same tokens."""
        return self.params.greedy or self.params.seed is not None


@dataclass
class _Batch:
    """Outputs for the front's next step, in front seq ids: of `step` of a replica's incarnation,
    or (replica None) failures decided here."""

    outputs: EngineCoreOutputs
    replica: int | None = None
    incarnation: str = ""
    step: int = 0


class _ReplicatedWarmup:
    """The replicas' background warm-ups, as the driver holds one core's (`stop`)."""

    def __init__(self, engine: ReplicatedEngine):
        self._engine = engine

    @property
    def status(self) -> WarmupStatus | None:
        return self._engine.warmup_status

    def stop(self) -> None:
        """Stops every replica's warm-up and driver (the front's driver is stopping)."""
        for replica in self._engine._replicas:
            if replica.state is not ReplicaState.GONE:
                try:
                    ray.get(replica.actor.stop.remote(), timeout=_STOP_S)
                except (RayActorError, ray.exceptions.GetTimeoutError):
                    pass


class ReplicatedEngine:
    def __init__(self, config: EngineConfig | None = None, *, data_parallel_size: int,
                 routing_policy: str = "cache_aware", no_replica_timeout_s: float = NO_REPLICA_TIMEOUT_S,
                 actor_options: dict | None = None, **options):
        """Starts `data_parallel_size` replicas of the engine `config` (or `options`) and waits
        until each has loaded its model. `actor_options`: the replicas' Ray options (default:
        replica_actor_options). Raises ValueError for a bad value, RuntimeError when a replica
        fails to load."""
        self.config = config = config or EngineConfig.from_options(**options)
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {routing_policy!r}")
        if actor_options is None:
            actor_options = replica_actor_options(data_parallel_size, config.tensor_parallel_size)
        actor_class = ray.remote(EngineReplica).options(**actor_options)
        actors = [actor_class.remote(config) for _ in range(data_parallel_size)]
        try:
            infos = ray.get([actor.info.remote() for actor in actors])
        except RayActorError as exc:
            for actor in actors:
                ray.kill(actor, no_restart=True)  # those that loaded
            raise RuntimeError(f"a replica failed to load its model: {exc}") from exc
        self.tokenizer = infos[0].tokenizer
        self.model_info: ModelInfo = infos[0].model_info
        self.max_model_len = self.model_info.max_model_len
        info = self.model_info
        # without a prefix cache, no match may pass the threshold: the router balances the load alone
        self._router = Router(data_parallel_size, info.block_size, routing_policy,
                              max_cached_blocks=info.num_kv_blocks,
                              **({} if info.enable_prefix_caching else {"cache_threshold": 1.0}))
        self._replicas = [_Replica(i, actor, r.pid, r.incarnation) for i, (actor, r) in enumerate(zip(actors, infos))]
        self._replica_stats: list[EngineStats | None] = [None] * data_parallel_size  # live: ReplicatedStats.replicas
        self._serving = [True] * data_parallel_size  # live: ReplicatedStats.serving
        self._no_replica_timeout_s = no_replica_timeout_s
        self._lock = threading.Lock()  # the requests, their seq ids, the replicas' states, the router
        # held by an add_requests call until it is decided, and by the collector while it hands
        # on what the replicas sent: a call refused in part never has outputs of its other requests
        # handed on (one replica may run a request while another refuses the next)
        self._admission = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._by_engine_id: dict[str, _Request] = {}
        self._pending: dict[str, _Request] = {}  # waiting for a replica, oldest first
        self._by_seq: dict[int, tuple[_Request, int]] = {}  # front seq id -> (request, completion index)
        self._by_replica_seq: dict[tuple[int, int], tuple[_Request, int]] = {}  # (replica, its seq id) -> the same
        self._seq_ids = itertools.count()
        self._outbox: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
        self._steps = 0  # steps handed back (the driver's step count)
        self._marks: deque[tuple[int, int, str, int]] = deque()  # (step, replica, incarnation, its step) (driver)
        self._warmup_started = False
        self.failed: BaseException | None = None  # every replica is gone for good
        self.on_health_change: Callable[[], None] | None = None  # set by the driver
        self.last_step_idle = False
        self._reported_healthy = True
        self._stopping = threading.Event()
        self._collector = threading.Thread(target=self._collect, name="zipage-dp-collector", daemon=True)
        self._collector.start()

    # -- the core API (the driver's thread) --------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Some replica serves."""
        return any(r.state is ReplicaState.SERVING for r in self._replicas)

    @property
    def unhealthy_reason(self) -> str:
        """What /health says while no replica serves."""
        if self.failed is not None:
            return f"every replica failed and cannot serve: {self.failed}"
        return "no replica serves: every replica is starting, warming up or restarting"

    @property
    def warmup_status(self) -> WarmupStatus | None:
        """The replicas' warm-ups together (None before start_warmup): the serving set is ready
        once some replica serves; done once every live replica's grid is built."""
        if not self._warmup_started:
            return None
        live = [r for r in self._replicas if r.state is not ReplicaState.GONE]
        statuses = [r.warmup for r in live if r.warmup is not None]
        done = len(statuses) == len(live) and all(s.done for s in statuses)
        return WarmupStatus(total=sum(s.total for s in statuses), ready=sum(s.ready for s in statuses),
                            serving_ready=self.healthy, done=done, failed=sum(s.failed for s in statuses),
                            seconds=max((s.seconds for s in statuses), default=0.0))

    def start_warmup(self) -> _ReplicatedWarmup:
        """Starts every replica's background warm-up; a replica serves again once its serving set
        is built (as does one that restarts later)."""
        self._warmup_started = True
        with self._lock:
            targets = [r for r in self._replicas if r.state is ReplicaState.SERVING]
            for r in targets:
                self._set_state(r, ReplicaState.WARMING)
        for r in targets:
            try:
                ray.get(r.actor.start_warmup.remote())
            except RayActorError as exc:
                self._lose(r, exc)
        return _ReplicatedWarmup(self)

    def replica_pids(self) -> list[int]:
        """Each replica's process id (its latest)."""
        return [r.pid for r in self._replicas]

    def has_unfinished_requests(self) -> bool:
        """Some request runs or waits, or outputs wait for the next step; and once every replica
        failed, so that the next step reports it."""
        return bool(self._requests) or not self._outbox.empty() or self.failed is not None

    def add_requests(self, requests: Sequence[tuple[str | list[int], SamplingParams | None, str | None]]
                     ) -> list[AdmittedRequest]:
        """Routes each (prompt, params, request_id) and waits until its replica has admitted it;
        all or none: a refusal (the engine's ValueError for bad input, naming the prompt's
        position when there are several) ends every one of them. With no replica serving they
        wait for one (no_replica_timeout_s)."""
        self._check_usable()
        prepared = [self._prepare(i, len(requests), *request) for i, request in enumerate(requests)]
        with self._admission:
            self._admit(prepared)
        return [AdmittedRequest(q.request_id, q.prompt if isinstance(q.prompt, str) else None, q.prompt_token_ids,
                                q.params, list(q.seq_ids)) for q in prepared]

    def _admit(self, prepared: list[_Request]) -> None:
        """Registers the requests and adds each to its replica; on a refusal aborts them all and
        raises it."""
        with self._lock:
            for i, request in enumerate(prepared):
                if request.request_id in self._requests or request.request_id in (q.request_id for q in prepared[:i]):
                    raise _numbered(ValueError(f"request id {request.request_id!r} is already in use"), i,
                                    len(prepared))
            for request in prepared:
                request.seq_ids = [next(self._seq_ids) for _ in range(request.params.n)]
                request.pending_since = time.monotonic()
                self._requests[request.request_id] = request
                self._pending[request.request_id] = request
                for index, seq_id in enumerate(request.seq_ids):
                    self._by_seq[seq_id] = (request, index)
            targets = [t for t in map(self._assign, prepared) if t is not None]
        refused: list[tuple[_Request, BaseException]] = []
        while targets and not refused:
            refused = self._send_adds(targets)
            with self._lock:  # those whose replica was found dead are pending again
                targets = [t for t in map(self._assign, prepared) if t is not None]
        if refused:
            for request in prepared:
                self.abort(request.request_id)
            request, cause = min(refused, key=lambda r: prepared.index(r[0]))
            if isinstance(cause, ValueError) and len(prepared) > 1:
                raise _numbered(cause, prepared.index(request), len(prepared)) from cause
            raise cause

    def abort(self, request_id: str) -> None:
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return
            target = None if request.replica is None else (self._replicas[request.replica].actor, request.engine_id)
            self._forget(request)
        if target is not None:
            actor, engine_id = target
            actor.abort.remote(engine_id)

    def finish_sequences(self, seq_ids: Sequence[int]) -> None:
        """The output stage matched a stop string in these sequences: they end on their replicas."""
        by_replica: dict[_Replica, list[int]] = {}
        with self._lock:
            for seq_id in seq_ids:
                found = self._by_seq.get(seq_id)
                if found is None or found[0].finished[found[1]]:
                    continue
                request, index = found
                request.finished[index] = True
                if request.replica_seq_ids:
                    replica_seq = request.replica_seq_ids[index]
                    self._by_replica_seq.pop((request.replica, replica_seq), None)
                    by_replica.setdefault(self._replicas[request.replica], []).append(replica_seq)
                if all(request.finished):  # its replica's core forgets it too
                    self._forget(request)
        for replica, ids in by_replica.items():
            replica.actor.finish_sequences.remote(ids, replica.incarnation)

    def set_output_lag(self, steps: int) -> None:
        """The output stage is `steps` steps behind: each replica learns the latest of its own
        steps whose outputs it has processed (their order kept by the outbox)."""
        processed = self._steps - steps
        newest: dict[int, tuple[str, int]] = {}
        while self._marks and self._marks[0][0] <= processed:
            _, replica, incarnation, step = self._marks.popleft()
            newest[replica] = (incarnation, step)
        for index, (incarnation, step) in newest.items():
            replica = self._replicas[index]
            told = replica.lag_told
            live = replica.state in (ReplicaState.SERVING, ReplicaState.WARMING)
            if live and replica.incarnation == incarnation and (told[0] != incarnation or step > told[1]):
                replica.lag_told = (incarnation, step)
                replica.actor.output_lag.remote(step, incarnation)

    def step(self) -> EngineCoreOutputs:
        """What the replicas produced since the last step, merged in the order it arrived
        (waiting up to _STEP_WAIT_S for some)."""
        self._check_usable()
        batches: list[_Batch] = []
        try:
            batches.append(self._outbox.get(timeout=_STEP_WAIT_S))
            while True:
                batches.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        merged = EngineCoreOutputs()
        for batch in batches:
            merged.extend(batch.outputs)
        self.last_step_idle = False  # it waited for the replicas already
        self._steps += not merged.empty  # the driver counts the steps it publishes
        for batch in batches:
            if batch.replica is not None:
                self._marks.append((self._steps, batch.replica, batch.incarnation, batch.step))
        return merged

    def get_stats(self) -> ReplicatedStats:
        total = ReplicatedStats(replicas=self._replica_stats, serving=self._serving)
        known = [s for s in self._replica_stats if s is not None]
        for f in dataclasses.fields(EngineStats):
            setattr(total, f.name, sum(getattr(s, f.name) for s in known))
        if total.num_kv_blocks:
            total.kv_usage = 1.0 - total.num_free_blocks / total.num_kv_blocks
        if total.prefix_cache_queries:
            total.prefix_cache_hit_rate = total.prefix_cache_hits / total.prefix_cache_queries
        return total

    def shutdown(self) -> None:
        """Stops the collector and ends every replica's process."""
        self._stopping.set()
        self._collector.join(10)
        for r in self._replicas:
            ray.kill(r.actor, no_restart=True)

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise EngineFailed(f"every replica failed and cannot serve: {self.failed}") from self.failed

    def _prepare(self, i: int, count: int, prompt: str | list[int], params: SamplingParams | None,
                 request_id: str | None) -> _Request:
        """The request as the front follows it (not yet registered); ValueError for what the
        front itself can tell is wrong (the replica checks the rest)."""
        params = SamplingParams() if params is None else params
        try:
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("prompt is empty")
                token_ids = list(self.tokenizer(prompt)["input_ids"])
            elif isinstance(prompt, (list, tuple)) and prompt:
                token_ids = list(prompt)
            else:
                raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        except ValueError as exc:
            raise _numbered(exc, i, count) from None
        prompt = prompt if isinstance(prompt, str) else token_ids
        return _Request(request_id or f"req-{uuid.uuid4().hex}", prompt, token_ids, params, [], Delivery(params.n),
                        [False] * params.n)

    # -- routing and the requests' seq ids (under the lock) --------------------------------------------

    def _assign(self, request: _Request) -> tuple[_Request, int, str] | None:
        """A pending request's replica (and its id there), None while none serves or when the
        request is no longer pending."""
        if request.request_id not in self._pending:
            return None
        eligible = [r.index for r in self._replicas if r.state is ReplicaState.SERVING]
        if not eligible:
            return None
        params = request.params
        replica = self._router.route(request.request_id, request.prompt_token_ids, params.max_tokens * params.n,
                                     eligible)
        request.runs += 1
        request.engine_id = request.request_id if request.runs == 1 else f"{request.request_id}~{request.runs}"
        request.replica = replica
        del self._pending[request.request_id]
        self._by_engine_id[request.engine_id] = request
        return request, replica, request.engine_id

    def _bind(self, request: _Request, replica_seq_ids: list[int]) -> list[int]:
        """Its replica admitted the request's current run under `replica_seq_ids`: their outputs
        are the request's from now on. Returns those to finish there at once (their sequence
        already ended)."""
        if request.replica_seq_ids:
            return []
        request.replica_seq_ids = list(replica_seq_ids)
        finish = []
        for index, replica_seq in enumerate(replica_seq_ids):
            if request.finished[index]:
                finish.append(replica_seq)
            else:
                self._by_replica_seq[(request.replica, replica_seq)] = (request, index)
        return finish

    def _unbind(self, request: _Request) -> None:
        for replica_seq in request.replica_seq_ids:
            self._by_replica_seq.pop((request.replica, replica_seq), None)
        request.replica_seq_ids = []

    def _current(self, replica: int, engine_id: str) -> _Request | None:
        """The request that runs as `engine_id` on `replica`, if it still does."""
        request = self._by_engine_id.get(engine_id)
        return request if request is not None and request.replica == replica else None

    def _set_state(self, replica: _Replica, state: ReplicaState) -> None:
        replica.state = state
        self._serving[replica.index] = state is ReplicaState.SERVING

    def _forget(self, request: _Request) -> None:
        self._requests.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        if self._by_engine_id.get(request.engine_id) is request:
            del self._by_engine_id[request.engine_id]
        self._unbind(request)
        for seq_id in request.seq_ids:
            self._by_seq.pop(seq_id, None)
        self._router.finish(request.request_id)

    def _fail(self, request: _Request, message: str) -> None:
        self._forget(request)
        logger.error("request %s failed: %s", request.request_id, message)
        self._outbox.put(_Batch(EngineCoreOutputs(failures=[(request.request_id, message, None)])))

    def _rerun_or_fail(self, request: _Request) -> None:
        """Its replica was lost: it waits for another, unless it cannot run again unseen."""
        self._router.finish(request.request_id)
        if self._by_engine_id.get(request.engine_id) is request:
            del self._by_engine_id[request.engine_id]
        self._unbind(request)
        if request.delivery.started and not request.replayable:
            self._fail(request, "its replica was lost after it had produced tokens (a request that samples "
                                "without a seed cannot run again unseen)")
            return
        if request.delivery.started:
            logger.info("request %s runs again; what it delivered is held back as it comes again",
                        request.request_id)
        request.delivery.restart()
        request.replica = None
        request.pending_since = time.monotonic()
        self._pending[request.request_id] = request

    def _translate(self, replica: int, out: EngineCoreOutputs) -> tuple[EngineCoreOutputs, list[str]]:
        """A replica's step in front seq ids, less what was handed on before (a rerun) and what
        belongs to no request here any more; and the engine ids to abort on the replica (their
        run departed from what was handed on: those requests fail)."""
        result = EngineCoreOutputs(kv_tokens_evicted=out.kv_tokens_evicted)
        for engine_id, message, _ in out.failures:
            request = self._current(replica, engine_id)
            if request is not None:
                self._forget(request)
                result.failures.append((request.request_id, message, None))
        diverged: dict[_Request, str] = {}
        kept: dict[_Request, list[int]] = {}  # positions of the tokens to hand on
        front = np.zeros(len(out.seq_ids), np.int64)
        if len(out.seq_ids):
            positions: dict[int, list[int]] = {}
            for i, seq in enumerate(out.seq_ids.tolist()):
                positions.setdefault(seq, []).append(i)
            tokens = out.token_ids.tolist()
            for seq, where in positions.items():
                found = self._by_replica_seq.get((replica, seq))
                if found is None or found[0] in diverged:
                    continue
                request, index = found
                try:
                    held = request.delivery.hand_on(index, [tokens[i] for i in where])
                except Diverged as exc:
                    diverged[request] = str(exc)
                    continue
                self._router.progress(request.request_id, len(where))
                front[where] = request.seq_ids[index]
                kept.setdefault(request, []).extend(where[held:])
        finished = []
        for f in out.finished:
            found = self._by_replica_seq.get((replica, f.seq_id))
            if found is None or found[0] in diverged:
                continue
            try:
                found[0].delivery.finish(found[1])
            except Diverged as exc:
                diverged[found[0]] = str(exc)
                continue
            finished.append((f, *found))
        where = np.array(sorted(i for request, w in kept.items() if request not in diverged for i in w), np.int64)
        if len(where):
            result.add_tokens(front[where], out.token_ids[where], None if out.logprobs is None else
                              (out.logprobs[where], out.top_ids[where], out.top_logprobs[where]))
        for seq, first, logprobs, top_ids, top_logprobs in out.prompt_logprobs:
            found = self._by_replica_seq.get((replica, seq))
            if found is None or found[0] in diverged:
                continue
            request, index = found
            held = request.delivery.hand_on_prompt_logprobs(first, len(logprobs))
            if held < len(logprobs):
                result.prompt_logprobs.append((request.seq_ids[index], first + held, logprobs[held:], top_ids[held:],
                                               top_logprobs[held:]))
        for seq in out.compressed:
            found = self._by_replica_seq.get((replica, seq))
            if found is not None and found[0] not in diverged:
                result.compressed.append(found[0].seq_ids[found[1]])
        for f, request, index in finished:
            result.finished.append(dataclasses.replace(f, seq_id=request.seq_ids[index]))
            request.finished[index] = True
            self._by_replica_seq.pop((replica, f.seq_id), None)
            if all(request.finished):
                self._forget(request)
        ghosts = []
        for request, message in diverged.items():
            ghosts.append(request.engine_id)
            self._forget(request)
            logger.error("request %s failed: %s", request.request_id, message)
            result.failures.append((request.request_id, message, None))
        return result, ghosts

    # -- replicas (either thread) ----------------------------------------------------------------

    def _send_adds(self, targets: list[tuple[_Request, int, str]]) -> list[tuple[_Request, BaseException]]:
        """Adds each request to its replica, all at once. Returns the requests refused there (with
        the refusal; they are still registered); a replica found dead is lost (its requests wait
        for another)."""
        calls = [(request, replica, engine_id, self._replicas[replica].actor.add.remote(
            request.prompt, request.params, engine_id)) for request, replica, engine_id in targets]
        refused = []
        for request, replica, engine_id, ref in calls:
            actor = self._replicas[replica].actor
            try:
                admitted: AdmittedRequest = ray.get(ref)
            except RayTaskError as exc:
                with self._lock:
                    if request.engine_id == engine_id and request.request_id in self._requests:
                        refused.append((request, exc.cause if exc.cause is not None else exc))
            except RayActorError as exc:
                self._lose(self._replicas[replica], exc)
            else:
                with self._lock:
                    current = request.engine_id == engine_id and request.request_id in self._requests
                    finish = self._bind(request, admitted.seq_ids) if current else []
                    admitted_incarnation = self._replicas[replica].incarnation
                if not current:  # lost or aborted while the add was on its way: not to run there
                    actor.abort.remote(engine_id)
                elif finish:
                    actor.finish_sequences.remote(finish, admitted_incarnation)
        return refused

    def _lose(self, replica: _Replica, error: BaseException, for_good: bool = False) -> None:
        """The replica's process died (for good: it will not come back); its requests move."""
        with self._lock:
            if replica.state is ReplicaState.GONE or (replica.state is ReplicaState.DOWN and not for_good):
                return
            self._set_state(replica, ReplicaState.GONE if for_good else ReplicaState.DOWN)
            replica.poll_ref = replica.ping_ref = None
            replica.next_ping = time.monotonic()
            self._router.forget_replica(replica.index)
            moved = [q for q in self._requests.values() if q.replica == replica.index]
            replica.orphans = [q.engine_id for q in moved]
            for request in moved:
                self._rerun_or_fail(request)
            rerun = sum(q.request_id in self._pending for q in moved)
            if all(r.state is ReplicaState.GONE for r in self._replicas):
                self.failed = error
                for request in list(self._pending.values()):
                    self._fail(request, "every replica failed")
        logger.warning("replica %d (pid %d) %s: %s; of its %d requests, %d run again on another replica, %d ended",
                       replica.index, replica.pid, "is gone for good" if for_good else "was lost",
                       type(error).__name__, len(moved), rerun, len(moved) - rerun)

    # -- the collector thread --------------------------------------------------------------------------

    def _collect(self) -> None:
        while not self._stopping.is_set() and ray.is_initialized():  # Ray shut down: the server is exiting
            try:
                self._collect_once()
                self._report_health()
            except Exception:  # noqa: BLE001 - the collector must go on: a bug here would hang every request
                logger.exception("the data-parallel collector failed a round")
                time.sleep(_WAIT_S)

    def _report_health(self) -> None:
        """Tells the driver when `healthy` changed (it publishes the stats then, also while idle)."""
        healthy = self.healthy
        if healthy != self._reported_healthy:
            self._reported_healthy = healthy
            if self.on_health_change is not None:
                self.on_health_change()

    def _collect_once(self) -> None:
        waits = self._outstanding_calls()
        ready = []
        if waits:
            ready, _ = ray.wait(list(waits), num_returns=1, timeout=_WAIT_S)
            if ready:
                ready, _ = ray.wait(list(waits), num_returns=len(waits), timeout=0)
        else:
            self._stopping.wait(_WAIT_S)
        with self._admission:
            for ref in ready:
                replica, is_poll = waits[ref]
                with self._lock:
                    current = ref is (replica.poll_ref if is_poll else replica.ping_ref)
                    if current and is_poll:
                        replica.poll_ref = None
                    elif current:
                        replica.ping_ref = None
                if current and is_poll:
                    self._on_poll(replica, ref)
                elif current:
                    self._on_ping(replica, ref)
            self._place_pending()

    def _outstanding_calls(self) -> dict[Any, tuple[_Replica, bool]]:
        """A poll on every live replica, a ping on every restarting one (when due): ref -> (replica, is a poll)."""
        now = time.monotonic()
        waits = {}
        with self._lock:
            for r in self._replicas:
                if r.state in (ReplicaState.SERVING, ReplicaState.WARMING):
                    if r.poll_ref is None:
                        r.poll_ref = r.actor.poll.remote(_POLL_S)
                    waits[r.poll_ref] = (r, True)
                elif r.state is ReplicaState.DOWN:
                    if r.ping_ref is None and now >= r.next_ping:
                        r.ping_ref = r.actor.ping.remote()
                    if r.ping_ref is not None:
                        waits[r.ping_ref] = (r, False)
        return waits

    def _on_poll(self, replica: _Replica, ref: Any) -> None:
        try:
            poll: ReplicaPoll = ray.get(ref)
        except RayActorError as exc:
            self._lose(replica, exc)
            return
        if poll.incarnation != replica.incarnation:  # it restarted unnoticed: what ran there is gone
            self._lose(replica, RuntimeError(f"replica {replica.index} restarted"))
            return
        ghosts: list[str] = []
        finish: list[int] = []
        with self._lock:
            self._replica_stats[replica.index], replica.warmup = poll.stats, poll.warmup
            if replica.state is ReplicaState.WARMING and poll.warmup is not None and poll.warmup.serving_ready:
                self._set_state(replica, ReplicaState.SERVING)
                logger.info("replica %d has built its serving set: it serves", replica.index)
            for event in poll.events:
                if isinstance(event, Admitted):
                    request = self._current(replica.index, event.request_id)
                    if request is not None:
                        finish += self._bind(request, event.seq_ids)
                elif isinstance(event, driver.Outputs):
                    outputs, dropped = self._translate(replica.index, event.outputs)
                    ghosts += dropped
                    self._outbox.put(_Batch(outputs, replica.index, poll.incarnation, event.step))
                elif isinstance(event, driver.StepFailed):
                    failures = []
                    for engine_id in event.request_ids:
                        request = self._current(replica.index, engine_id)
                        if request is not None:
                            self._forget(request)
                            failures.append((request.request_id, event.message, None))
                    if failures:
                        self._outbox.put(_Batch(EngineCoreOutputs(failures=failures)))
        for engine_id in ghosts:
            replica.actor.abort.remote(engine_id)
        if finish:
            replica.actor.finish_sequences.remote(finish, poll.incarnation)

    def _on_ping(self, replica: _Replica, ref: Any) -> None:
        try:
            status: ReplicaStatus = ray.get(ref)
        except ActorDiedError as exc:  # a ping that finds the actor dead: it was not restarted
            self._lose(replica, exc, for_good=True)
            return
        except RayActorError:  # still restarting
            replica.next_ping = time.monotonic() + _PING_RETRY_S
            return
        with self._lock:
            orphans = replica.orphans if status.incarnation == replica.incarnation else []
            replica.orphans = []
            replica.pid, replica.incarnation = status.pid, status.incarnation
        for engine_id in orphans:  # the same process lives on: what moved away must not run there too
            replica.actor.abort.remote(engine_id)
        warmup = status.warmup
        if self._warmup_started and warmup is None:
            try:
                ray.get(replica.actor.start_warmup.remote())
            except RayActorError:
                replica.next_ping = time.monotonic() + _PING_RETRY_S
                return
        warming = self._warmup_started and not (warmup is not None and warmup.serving_ready)
        with self._lock:
            self._set_state(replica, ReplicaState.WARMING if warming else ReplicaState.SERVING)
        logger.warning("replica %d is back (pid %d)%s", replica.index, replica.pid,
                       ": it serves once its warm-up has built its serving set" if warming else "")

    def _place_pending(self) -> None:
        """Pending requests go to the replicas serving; those that waited too long fail."""
        now = time.monotonic()
        with self._lock:
            for request in list(self._pending.values()):
                if now - request.pending_since > self._no_replica_timeout_s:
                    self._fail(request, f"no replica served for {self._no_replica_timeout_s:g} s")
            targets = []
            for request in list(self._pending.values()):
                target = self._assign(request)
                if target is None:
                    break
                targets.append(target)
        if not targets:
            return
        refused = self._send_adds(targets)
        with self._lock:
            for request, cause in refused:
                if request.request_id in self._requests:
                    self._fail(request, f"{type(cause).__name__}: {cause}")


def _numbered(exc: ValueError, i: int, count: int) -> ValueError:
    """The refusal of prompt `i` of `count`, named by its position when there are several."""
    return exc if count == 1 else ValueError(f"prompt {i}: {exc}")
