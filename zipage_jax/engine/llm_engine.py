"""LLMEngine: the engine core and the output stage in one process, as `LLM` and notebooks use them.

    engine = LLMEngine(model="default")
    engine.add_request("Hello", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for output in engine.step():   # RequestOutputs of the requests that advanced
            ...

`step` is the core's step (schedule, run, update: engine/core.py), then the output stage
(engine/output_processor.py) over what it handed back; a stop string the stage matches ends its
sequence in the core before the next step. The server runs the same two parts in two processes
(engine/core_process.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from zipage_jax.config import EngineConfig
from zipage_jax.engine.core import EngineCore, EngineFailed
from zipage_jax.engine.introspection import EngineIntrospection
from zipage_jax.engine.output_processor import OutputProcessor
from zipage_jax.engine.outputs import RequestOutput
from zipage_jax.engine.runner.warmup import Warmup
from zipage_jax.engine.stats import EngineStats, WarmupStatus
from zipage_jax.models.loading import LoadedModel
from zipage_jax.sampling_params import SamplingParams

__all__ = ["LLMEngine", "EngineFailed"]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None, **options):
        self.core = EngineCore(config, loaded=loaded, **options)
        self.processor = OutputProcessor(self.core.tokenizer, self.core.special_ids)

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    def introspect(self) -> EngineIntrospection:
        """What benchmarks and evaluations read of the engine beyond its stats (engine/introspection.py)."""
        runner = self.core.runner
        return EngineIntrospection(model_source=str(self.core.loaded.source), kv_block_bytes=self.core.pool.block_bytes,
                                   compaction_compile_seconds=runner.compressor.seconds,
                                   compaction_seconds=runner.compress_seconds)

    def wait_for_device(self) -> None:
        """Blocks until the device has done the work the engine dispatched (with asynchronous
        scheduling a step returns while the device still computes it)."""
        jax.block_until_ready(self.core.runner.state)

    @property
    def last_step_host_seconds(self) -> float:
        """The core's latest step less its wait for the device (the output stage not included)."""
        return self.core.last_step_host_seconds

    @property
    def healthy(self) -> bool:
        return self.core.healthy

    @property
    def failed(self) -> BaseException | None:
        return self.core.failed

    def warmup(self, progress: bool = True) -> int:
        return self.core.warmup(progress)

    def start_warmup(self) -> Warmup:
        return self.core.start_warmup()

    @property
    def warmup_status(self) -> WarmupStatus | None:
        return self.core.warmup_status

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = True) -> str:
        """Queues a request (ValueError naming the field for anything this engine cannot run);
        `stream`: an output whenever it advances, else only its final one."""
        return self.add_requests([(prompt, params, request_id)], stream)[0]

    def add_requests(self, requests: Sequence[tuple[str | list[int], SamplingParams | None, str | None]],
                     stream: bool = True) -> list[str]:
        """Queues every (prompt, params, request_id), or none when one is refused (ValueError)."""
        admitted = self.core.add_requests(requests)
        for r in admitted:
            self.processor.add_request(r.request_id, r.prompt, r.prompt_token_ids, r.params, r.seq_ids, stream)
        return [r.request_id for r in admitted]

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self.processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """The core's step, then the output stage over its results."""
        outputs, stopped = self.processor.process(self.core.step())
        if stopped:
            self.core.finish_sequences(stopped)
        return outputs
