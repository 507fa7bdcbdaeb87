"""ReplicatedEngine: the engine API the server drives (add_request, step, abort, get_stats, ...)
over N engine replicas, each an EngineReplica actor on Ray holding its own devices.

    app = create_app(lambda: ReplicatedEngine(model="default", data_parallel_size=2), ["default"])
    # (Ray initialized first: data_parallel.ray_cluster.RayCluster.start); the server is unchanged

The front holds no model: the tokenizer and max_model_len are replica 0's. A request goes to
the replica the Router picks among those serving, and `add_request` waits until that replica has
admitted it, so a bad request raises the engine's ValueError (the server's 400). A collector
thread keeps a poll outstanding on every live replica; `step()` hands back what the polls
brought (waiting a little for it).

Faults. A replica whose process dies is restarted by Ray (max_restarts=-1); it is out of the
rotation until it answers a ping again (its model reloaded, and with a warm-up its serving set
built). Its requests run again on another replica with the same parameters (and, for the
server, under the same request id): the Delivery of each holds back what the client already
has, so a request whose tokens are the same in every run (greedy, or seeded) goes on as if
nothing happened; one that had delivered tokens and samples without a seed ends with an error
output (the server's 500, or an error event that closes its stream). With no replica serving,
requests wait up to `no_replica_timeout_s`, then end with an error; the engine is `healthy`
while some replica serves and `failed` once every replica is gone for good (its model no longer
loads).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from zipage_jax.config import EngineConfig
from zipage_jax.data_parallel.delivery import Delivery, Diverged
from zipage_jax.data_parallel.ray_cluster import replica_actor_options
from zipage_jax.data_parallel.replica import EngineReplica, ReplicaPoll, ReplicaStatus
from zipage_jax.data_parallel.router import ROUTING_POLICIES, Router
from zipage_jax.engine.llm_engine import EngineFailed
from zipage_jax.engine.outputs import RequestOutput
from zipage_jax.engine.runner.warmup import WarmupStatus
from zipage_jax.engine.stats import EngineStats
from zipage_jax.sampling_params import SamplingParams

logger = logging.getLogger("zipage_jax.data_parallel")

NO_REPLICA_TIMEOUT_S = 60.0
_POLL_S = 0.5  # a replica's poll returns after this long without outputs
_WAIT_S = 0.1  # the collector wakes at least this often (pending requests, pings to retry)
_STEP_WAIT_S = 0.05  # step() waits this long for an output
_PING_RETRY_S = 0.5  # between pings of a replica that is restarting


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


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    params: SamplingParams
    delivery: Delivery = field(default_factory=Delivery)
    replica: int | None = None  # None while pending
    engine_id: str = ""  # its id on its replica: the request id, then "<id>~<run>" for a rerun
    runs: int = 0
    pending_since: float = 0.0

    @property
    def replayable(self) -> bool:
        """Every run produces the same tokens."""
        return self.params.greedy or self.params.seed is not None


class _ReplicatedWarmup:
    """The replicas' background warm-ups, as EngineLoop holds one engine's (`status`, `stop`)."""

    def __init__(self, engine: ReplicatedEngine):
        self._engine = engine

    @property
    def status(self) -> WarmupStatus | None:
        return self._engine.warmup_status

    def stop(self) -> None:
        for replica in self._engine._replicas:
            if replica.state is not ReplicaState.GONE:
                try:
                    ray.get(replica.actor.stop_warmup.remote(), timeout=60)
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
        info = infos[0]
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        # without a prefix cache, no match may pass the threshold: the router balances the load alone
        self._router = Router(data_parallel_size, info.block_size, routing_policy,
                              max_cached_blocks=info.num_kv_blocks,
                              **({} if info.enable_prefix_caching else {"cache_threshold": 1.0}))
        self._replicas = [_Replica(i, actor, r.pid, r.incarnation) for i, (actor, r) in enumerate(zip(actors, infos))]
        self._replica_stats: list[EngineStats | None] = [None] * data_parallel_size  # live: ReplicatedStats.replicas
        self._serving = [True] * data_parallel_size  # live: ReplicatedStats.serving
        self._no_replica_timeout_s = no_replica_timeout_s
        self._lock = threading.Lock()  # the requests, the replicas' states, the router
        self._requests: dict[str, _Request] = {}
        self._by_engine_id: dict[str, _Request] = {}
        self._pending: dict[str, _Request] = {}  # waiting for a replica, oldest first
        self._outbox: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._warmup_started = False
        self.failed: BaseException | None = None  # every replica is gone for good
        self._stopping = threading.Event()
        self._collector = threading.Thread(target=self._collect, name="zipage-dp-collector", daemon=True)
        self._collector.start()

    # -- the engine API (the engine thread) --------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Some replica serves."""
        return any(r.state is ReplicaState.SERVING for r in self._replicas)

    @property
    def unhealthy_reason(self) -> str:
        """What /health says while no replica serves."""
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
        return bool(self._requests) or not self._outbox.empty()

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Routes the request and waits until its replica has admitted it (ValueError, the
        engine's, for bad input); with no replica serving, it waits for one (no_replica_timeout_s)."""
        self._check_usable()
        params = params or SamplingParams()
        token_ids = list(self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            request = _Request(request_id, prompt, token_ids, params, pending_since=time.monotonic())
            self._requests[request_id] = request
            self._pending[request_id] = request
            target = self._assign(request)
        while target is not None:
            self._send_adds([target], raise_errors=True)
            with self._lock:
                target = self._assign(request)
        return request_id

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

    def step(self) -> list[RequestOutput]:
        """The outputs the replicas produced since the last step (waiting up to _STEP_WAIT_S for one)."""
        self._check_usable()
        try:
            outputs = [self._outbox.get(timeout=_STEP_WAIT_S)]
        except queue.Empty:
            return []
        while not self._outbox.empty():
            outputs.append(self._outbox.get_nowait())
        return outputs

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

    # -- routing (under the lock) ------------------------------------------------------------------

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

    def _set_state(self, replica: _Replica, state: ReplicaState) -> None:
        replica.state = state
        self._serving[replica.index] = state is ReplicaState.SERVING

    def _forget(self, request: _Request) -> None:
        self._requests.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        if self._by_engine_id.get(request.engine_id) is request:
            del self._by_engine_id[request.engine_id]
        self._router.finish(request.request_id)

    def _fail(self, request: _Request, message: str) -> None:
        self._forget(request)
        logger.error("request %s failed: %s", request.request_id, message)
        self._outbox.put(RequestOutput(request.request_id, None, request.prompt_token_ids, [], finished=True,
                                       error=message))

    def _rerun_or_fail(self, request: _Request) -> None:
        """Its replica was lost: it waits for another, unless it cannot run again unseen."""
        self._router.finish(request.request_id)
        if self._by_engine_id.get(request.engine_id) is request:
            del self._by_engine_id[request.engine_id]
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

    # -- replicas (either thread) ----------------------------------------------------------------

    def _send_adds(self, targets: list[tuple[_Request, int, str]], raise_errors: bool) -> None:
        """Adds each request to its replica, all at once; a request refused there ends (raising
        the refusal when `raise_errors`, else with an error output); a replica found dead is lost."""
        calls = [(request, replica, engine_id, self._replicas[replica].actor.add.remote(
            request.prompt, request.params, engine_id)) for request, replica, engine_id in targets]
        for request, replica, engine_id, ref in calls:
            try:
                ray.get(ref)
            except RayTaskError as exc:
                cause = exc.cause if exc.cause is not None else exc
                with self._lock:
                    current = request.engine_id == engine_id and request.request_id in self._requests
                    if current and raise_errors:
                        self._forget(request)
                    elif current:
                        self._fail(request, f"{type(cause).__name__}: {cause}")
                if current and raise_errors:
                    raise cause from None
            except RayActorError as exc:
                self._lose(self._replicas[replica], exc)
            else:
                with self._lock:
                    moved = request.engine_id != engine_id or request.request_id not in self._requests
                if moved:  # lost or aborted while the add was on its way: not to run there
                    self._replicas[replica].actor.abort.remote(engine_id)

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
            except Exception:  # noqa: BLE001 - the collector must go on: a bug here would hang every request
                logger.exception("the data-parallel collector failed a round")
                time.sleep(_WAIT_S)

    def _collect_once(self) -> None:
        waits = self._outstanding_calls()
        ready = []
        if waits:
            ready, _ = ray.wait(list(waits), num_returns=1, timeout=_WAIT_S)
            if ready:
                ready, _ = ray.wait(list(waits), num_returns=len(waits), timeout=0)
        else:
            self._stopping.wait(_WAIT_S)
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
        with self._lock:
            self._replica_stats[replica.index], replica.warmup = poll.stats, poll.warmup
            if replica.state is ReplicaState.WARMING and poll.warmup is not None and poll.warmup.serving_ready:
                self._set_state(replica, ReplicaState.SERVING)
                logger.info("replica %d has built its serving set: it serves", replica.index)
            ghosts = [self._deliver(replica, out) for out in poll.outputs]
        for engine_id in filter(None, ghosts):
            replica.actor.abort.remote(engine_id)

    def _deliver(self, replica: _Replica, out: RequestOutput) -> str | None:
        """Hands `out` to the server as its request shows it; the engine id to abort on the replica
        when the request cannot go on there (under the lock)."""
        request = self._by_engine_id.get(out.request_id)
        if request is None or request.replica != replica.index:
            return None  # aborted, or moved away
        if out.error is not None:
            self._forget(request)
            self._outbox.put(dataclasses.replace(out, request_id=request.request_id))
            return None
        try:
            shown = request.delivery.admit(out)
        except Diverged as exc:
            self._fail(request, str(exc))
            return out.request_id
        self._router.progress(request.request_id, sum(len(o.delta_token_ids) for o in out.outputs))
        if out.finished:
            self._forget(request)
        if shown is not None:
            self._outbox.put(dataclasses.replace(shown, request_id=request.request_id))
        return None

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
        """Pending requests go to the replicas serving; those that waited too long end."""
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
        if targets:
            self._send_adds(targets, raise_errors=False)
