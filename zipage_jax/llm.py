"""LLM: offline generation, streaming and chat over the engine (vLLM-style)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from zipage_jax.chat import chat_prompt_ids
from zipage_jax.engine.llm_engine import LLMEngine
from zipage_jax.engine.outputs import RequestOutput
from zipage_jax.models.loading import LoadedModel
from zipage_jax.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str = "default", *, loaded: LoadedModel | None = None, **options):
        """`loaded`: a model already loaded (models/loading.py), shared between engines; `model` then
        only names it."""
        self.engine = LLMEngine(loaded=loaded, model=model, **options)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True) -> list[dict]:
        """One dict per prompt, in order: text, token_ids, finish_reason, metrics, outputs (all n)."""
        prompts, params = self._normalise(prompts, sampling_params)
        finals: dict[str, RequestOutput] = {}
        ids = self._add(prompts, params, stream=False)
        bar = tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        bar.update(1)
                s = self.engine.stats
                bar.set_postfix(prefill=f"{s.prefill_tokens / max(s.prefill_seconds, 1e-9):.0f}tok/s",
                                decode=f"{s.decode_tokens / max(s.decode_seconds, 1e-9):.0f}tok/s", refresh=False)
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [finals[i].to_dict() for i in ids]

    def stream(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
               | None = None) -> Iterator[RequestOutput]:
        """Yields a RequestOutput (with delta_text / delta_token_ids) whenever a request advances."""
        prompts, params = self._normalise(prompts, sampling_params)
        ids = self._add(prompts, params, stream=True)
        try:
            while self.engine.has_unfinished_requests():
                yield from self.engine.step()
        finally:
            for request_id in ids:
                self.engine.abort(request_id)

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict[str, Any] | None = None) -> list[dict]:
        """Applies the tokenizer's chat template (with the generation prompt) and generates;
        `chat_template_kwargs`: extra template variables, such as {"enable_thinking": False}."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[Message], chat_template_kwargs: dict[str, Any] | None = None
                            ) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages, chat_template_kwargs=chat_template_kwargs)

    def _add(self, prompts: list[Prompt], params: list[SamplingParams], stream: bool) -> list[str]:
        """Queues every prompt, or none when one is refused (ValueError)."""
        return self.engine.add_requests([(prompt, p, None) for prompt, p in zip(prompts, params)], stream)

    @staticmethod
    def _normalise(prompts, sampling_params) -> tuple[list[Prompt], list[SamplingParams]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return prompts, params


def generate(prompts: Prompt | Sequence[Prompt], model: str = "default", *, sampling_params: SamplingParams | None
             = None, use_tqdm: bool = False, **kwargs) -> list[dict]:
    """One call for notebooks: engine options and SamplingParams fields may be mixed in kwargs."""
    sp_fields = set(SamplingParams.__dataclass_fields__)
    sp_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in sp_fields}
    if sampling_params is not None and sp_kwargs:
        raise ValueError("pass either sampling_params or sampling keyword arguments, not both")
    params = sampling_params or SamplingParams(**sp_kwargs)
    return LLM(model, **kwargs).generate(prompts, params, use_tqdm=use_tqdm)
