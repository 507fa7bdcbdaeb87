"""Ray for data-parallel serving: the cluster (a local one, or the one RAY_ADDRESS names) and
what each replica actor asks it for.

A replica asks for its devices: tensor_parallel_size GPUs when the cluster has GPUs (Ray then
sets CUDA_VISIBLE_DEVICES, so that JAX in the replica sees those alone), else one CPU. It
inherits the front's ZIPAGE_*, JAX_*, XLA_* and HF_* environment variables and PYTHONPATH (the
model and program caches, the JAX platform, where zipage_jax is), and imports zipage_jax as the
front does: on one machine, from the same installation; on a cluster every node needs it alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray

FORWARDED_ENV_PREFIXES = ("ZIPAGE_", "JAX_", "XLA_", "HF_", "PYTHONPATH")
_GPU_PLATFORMS = ("cuda", "gpu", "rocm")
ACTOR_CONCURRENCY = 8  # a replica's calls in progress at once: a waiting poll, adds, aborts, pings


@dataclass
class RayCluster:
    owned: bool  # started here: stop() shuts it down

    @classmethod
    def start(cls, num_cpus: int | None = None) -> RayCluster:
        """Connects to the cluster RAY_ADDRESS names, else starts a local one with `num_cpus`
        CPUs (default: this machine's) and no dashboard; a Ray already initialized in this
        process is used as it is."""
        if ray.is_initialized():
            return cls(owned=False)
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address)
            return cls(owned=False)
        ray.init(num_cpus=num_cpus, include_dashboard=False)
        return cls(owned=True)

    def stop(self) -> None:
        """Shuts down the local cluster started here (a cluster connected to lives on)."""
        if self.owned:
            ray.shutdown()


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
