"""Ray for data-parallel serving: the cluster (a local one, or the one RAY_ADDRESS names) and
what each replica actor asks it for.

The local cluster is this machine's alone: its node address is loopback, so Ray's processes (GCS,
raylet and object manager, dashboard and runtime-env agents, metrics export, workers) listen on
127.0.0.1 only; and every connection to it must carry its token, a random one per cluster, in
this process's RAY_AUTH_TOKEN, which Ray's processes inherit (nothing is written to disk; a
process's environment is readable by its own user alone). stop() puts the environment back.

A cluster in RAY_ADDRESS is joined as it is, so it must protect itself: token authentication on
(RAY_AUTH_MODE=token on every node), its token given to this process the way Ray reads it
(RAY_AUTH_MODE=token and RAY_AUTH_TOKEN), its ports reachable from no network beyond the ones its
nodes and clients use.

A replica asks for its devices: tensor_parallel_size GPUs when the cluster has GPUs (Ray then
sets CUDA_VISIBLE_DEVICES, so that JAX in the replica sees those alone), else one CPU. It
inherits the front's ZIPAGE_*, JAX_*, XLA_* and HF_* environment variables and PYTHONPATH (the
model and program caches, the JAX platform, where zipage_jax is), and imports zipage_jax as the
front does: on one machine, from the same installation; on a cluster every node needs it alike.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

import ray
from ray._common.utils import env_bool
from ray._private import ray_constants
from ray._raylet import AuthenticationTokenLoader, Config

FORWARDED_ENV_PREFIXES = ("ZIPAGE_", "JAX_", "XLA_", "HF_", "PYTHONPATH")
_GPU_PLATFORMS = ("cuda", "gpu", "rocm")
ACTOR_CONCURRENCY = 8  # a replica's calls in progress at once: a waiting poll, adds, aborts, pings
# "0": Ray's single-machine mode, the only one in which ray.init keeps the node at loopback (else it
# swaps 127.0.0.1 for the address other machines reach, and its servers bind every interface)
_SINGLE_MACHINE_ENV = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR


@dataclass
class RayCluster:
    owned: bool  # started here: stop() shuts it down
    replaced_env: dict[str, str | None] = field(default_factory=dict)  # what start() changed, as it was

    @classmethod
    def start(cls, num_cpus: int | None = None) -> RayCluster:
        """Connects to the cluster RAY_ADDRESS names, else starts a local one with `num_cpus`
        CPUs (default: this machine's), no dashboard, on loopback, with a new token; a Ray
        already initialized in this process is used as it is."""
        if ray.is_initialized():
            return cls(owned=False)
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address)
            return cls(owned=False)
        replaced = _set_ray_env({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                                 _SINGLE_MACHINE_ENV: "0"})
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False)
        except BaseException:
            _set_ray_env(replaced)
            raise
        return cls(owned=True, replaced_env=replaced)

    def stop(self) -> None:
        """Shuts down the local cluster started here (a cluster connected to lives on)."""
        if self.owned:
            ray.shutdown()
            _set_ray_env(self.replaced_env)


def _set_ray_env(values: dict[str, str | None]) -> dict[str, str | None]:
    """Sets these environment variables (None: unsets them) for this process and the Ray processes
    it starts, and has Ray here read them again (it reads them once, at import and at its first
    start); returns their values before."""
    before = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    ray_constants.ENABLE_RAY_CLUSTER = env_bool(_SINGLE_MACHINE_ENV, not ray_constants.IS_WINDOWS_OR_OSX)
    Config.initialize("")  # the authentication mode, before the token (as Ray's own tests do)
    AuthenticationTokenLoader.instance().reset_cache()
    return before


def replica_actor_options(num_replicas: int, tensor_parallel_size: int) -> dict:
    """The Ray options of a replica actor: restarted whenever it dies, its calls never retried
    (the front reroutes them), its devices. ValueError when the cluster cannot place every replica."""
    total = ray.cluster_resources()
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if total.get("GPU", 0) and (not platforms or any(p in platforms for p in _GPU_PLATFORMS)):
        resources, kind = {"num_gpus": tensor_parallel_size, "num_cpus": 0}, "GPU"
        need = num_replicas * tensor_parallel_size
    else:
        resources, kind, need = {"num_cpus": 1}, "CPU", num_replicas
    if total.get(kind, 0) < need:
        raise ValueError(f"{num_replicas} replicas of tensor_parallel_size {tensor_parallel_size} need {need} "
                         f"{kind}s; the Ray cluster has {total.get(kind, 0):g}")
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    return dict(max_restarts=-1, max_task_retries=0, max_concurrency=ACTOR_CONCURRENCY,
                runtime_env={"env_vars": env}, **resources)
