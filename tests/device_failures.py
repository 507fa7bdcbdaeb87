"""Device failures injected inside the real compiled calls: the call runs (consuming the donated
device state), then raises, as a device or runtime failure in the call would."""

from __future__ import annotations

from collections.abc import Callable, Container

import jax

from zipage_jax.engine.runner.programs import CompiledPrograms
from zipage_jax.engine.runner.steps import DeviceState
from zipage_jax.layers.kv_cache import KVState


class InjectedFailure(RuntimeError):
    pass


class FailingCalls:
    """Makes calls `at` (1-based, counted from now) of `steps` (a runner's CompiledPrograms) run the
    real executable and then raise InjectedFailure. Per failure, `donated` records whether the
    call had consumed the state, and `observed` what `observe()` returned then."""

    def __init__(self, monkeypatch, steps: CompiledPrograms, at: Container[int],
                 observe: Callable[[], object] = lambda: None):
        self.at, self.calls = at, 0
        self.donated: list[bool] = []
        self.observed: list[object] = []
        real_get = steps.get

        def get(key, *args):
            executable = real_get(key, *args)

            def call(*call_args):
                out = executable(*call_args)
                self.calls += 1
                if self.calls in self.at:
                    state = next(a for a in call_args if isinstance(a, (DeviceState, KVState)))
                    self.donated.append(all(leaf.is_deleted() for leaf in jax.tree.leaves(state)))
                    self.observed.append(observe())
                    raise InjectedFailure(f"injected device failure in call {self.calls}")
                return out

            return call

        monkeypatch.setattr(steps, "get", get)
