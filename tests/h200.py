"""An abstract H200 to lower kernels and engine steps for CUDA on the CPU.

`lower_for_h200` lowers a jitted function for ("cuda",) under an abstract H200 device (or a
mesh of them, `h200_mesh`), which runs the Pallas Triton lowering (the GPU rules: power-of-two
tiles, dot operands) on the CPU.
"""

from __future__ import annotations

import jax

from zipage_jax.engine.sharding import TP

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)


def h200_mesh(tp: int) -> jax.sharding.AbstractMesh:
    """`tp` abstract H200s on the engine's one axis TP, automatic sharding like the engine's `Mesh`."""
    return jax.sharding.AbstractMesh((tp,), (TP,), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=H200)


def lower_for_h200(fn, *args, mesh: jax.sharding.AbstractMesh | None = None, **kwargs) -> str:
    """The StableHLO text of jitted `fn(*args, **kwargs)` lowered for CUDA on an H200, or on the
    H200s of `mesh` (h200_mesh: args carry NamedShardings over it)."""
    mesh = mesh or jax.sharding.AbstractMesh((), (), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        return fn.trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
