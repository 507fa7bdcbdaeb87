"""Per-request sampling options, with vLLM's names and defaults, validated at construction.

Every number is bounded here, independently of the model, so that no value can overflow the
arrays the sampler stores it in (int32 ids and counts, uint32 seeds, float32 reals); the engine
adds the model's bounds (vocabulary, batch). How many stop strings, and how long, is the
caller's policy (the server's --max-stop-strings, --max-stop-chars): the stop checker's work
per token grows with their number and with the new text only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from zipage_jax.compress.policies import POLICIES, get_policy
from zipage_jax.layers.sampler import MAX_LOGPROBS

GREEDY_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
EVICTION_POLICIES = tuple(POLICIES)  # the names eviction_policy takes
MAX_N = 128  # completions per request (OpenAI's limit); engines and servers may allow fewer
MAX_STOP_TOKEN_IDS = 64  # the sampler's suppress rows have a fixed width
INT32_MAX = 2**31 - 1  # token ids, top_k, token counts and kv_budget are int32 on the device
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # an int64, as OpenAI's seed
FLOAT32_MAX = 3.4028234663852886e38  # reals are float32 on the device
MAX_CHOICES = 1024  # strings of a structured_outputs choice


@dataclass(frozen=True)
class Bound:
    """The range a number field takes: [low, high], or (low, high] when `low_open`; `real`: a
    float (any finite number in range, an integer included), else an integer."""

    low: int | float
    high: int | float
    real: bool = False
    low_open: bool = False

    def pydantic_constraints(self) -> dict[str, int | float]:
        """The bound as pydantic.Field's keyword arguments."""
        return {"gt" if self.low_open else "ge": self.low, "le": self.high}

    def check(self, name: str, value: object) -> int | float:
        """`value` (a float for a real field); ValueError naming `name` and the range when it is
        not a number of the field's kind within it."""
        if self.real:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {_short(value)}")
            value = float(value)
        elif not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {_short(value)}")
        above_low = value > self.low if self.low_open else value >= self.low
        if not (above_low and value <= self.high):
            raise ValueError(f"{name} must be in {'(' if self.low_open else '['}{_number(self.low)}, "
                             f"{_number(self.high)}], got {_short(value)}")
        return value


def _number(x: int | float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


# Every numeric SamplingParams field's range, checked by SamplingParams and stated by the server's
# request model (server/protocol.py). A field whose default is None may also be None.
BOUNDS: dict[str, Bound] = {
    "n": Bound(1, MAX_N),
    "temperature": Bound(0, FLOAT32_MAX, real=True),
    "top_p": Bound(0, 1, real=True, low_open=True),
    "top_k": Bound(-1, INT32_MAX),
    "min_p": Bound(0, 1, real=True),
    "repetition_penalty": Bound(0, FLOAT32_MAX, real=True, low_open=True),
    "presence_penalty": Bound(-2, 2, real=True),
    "frequency_penalty": Bound(-2, 2, real=True),
    "seed": Bound(SEED_MIN, SEED_MAX),
    "max_tokens": Bound(1, INT32_MAX),
    "min_tokens": Bound(0, INT32_MAX),
    "logprobs": Bound(0, MAX_LOGPROBS),
    "prompt_logprobs": Bound(0, MAX_LOGPROBS),
    "kv_budget": Bound(0, INT32_MAX),
    "kv_budget_max": Bound(1, INT32_MAX),
}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Grammar-constrained decoding (vLLM's names): exactly one of the fields says what the output
    must be. The engine compiles it when the request is admitted (an invalid schema, regex or
    grammar is a ValueError there) and masks every sampled token to what the grammar allows; a
    sequence whose grammar is complete finishes with "stop"."""

    json: dict | str | None = None  # a JSON schema (a dict or its JSON text)
    regex: str | None = None  # the whole output matches it (Rust regex syntax)
    choice: Sequence[str] | None = None  # the output is one of these strings; normalised to a tuple
    grammar: str | None = None  # a Lark grammar in llguidance's dialect
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {_short(self.json_object)}")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or a string), "
                             f"got {_short(self.json)}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if isinstance(value, str):
                check_text(f"structured_outputs.{name}", value)
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) for c in choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {_short(choice)}")
            if len(choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice holds {len(choice)} strings, more than {MAX_CHOICES}")
            for c in choice:
                check_text("structured_outputs.choice", c)
            object.__setattr__(self, "choice", tuple(choice))


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # prompt + output tokens
    presence_penalty: float = 0.0  # output tokens only
    frequency_penalty: float = 0.0  # output tokens only
    seed: int | None = None
    stop: str | Sequence[str] | None = None  # normalised to a tuple
    stop_token_ids: Sequence[int] | None = None  # normalised to a tuple
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int = 16
    logprobs: int | None = None  # top-N log-probabilities per token (0: only the chosen one)
    # Top-N log-probabilities of every prompt token given the tokens before it (0: only the prompt
    # token's own), from the prefill's logits; such a request takes no prefix-cache hit.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # KV tokens kept (rounded up to blocks): None = engine default, 0 = full KV, "auto" = sized at each
    # compaction point by the attention it would evict (compress/auto_budget.py)
    kv_budget: int | Literal["auto"] | None = None
    kv_budget_max: int | None = None  # "auto": the most KV tokens kept; None = the engine's auto_budget_max
    eviction_policy: str | None = None  # this request's eviction rule (compress/policies.py); None = the engine's
    # The prompt is kept whole, outside kv_budget: the sequence holds its prompt plus kv_budget tokens
    # (TensorRT-LLM's TriAttention keeps prompts this way), or with "auto" plus an automatic budget
    # sized on what it generates; False: kv_budget bounds the prompt too; None: the engine's
    # auto_budget_keeps_prompt for an automatic budget, False for a fixed one.
    keep_prompt: bool | None = None
    # A prompt longer than kv_budget: "bounded" compacts between prefill chunks (peak: budget + one chunk),
    # "deferred" once at the prompt's end (peak: the whole prompt); None: the engine's prompt_compression.
    prompt_compression: str | None = None
    # Teacher forcing: the first output tokens are these instead of sampled ones, decoded one per step
    # (so compression runs as in generation); their log-probabilities are reported as for sampled tokens.
    forced_token_ids: Sequence[int] | None = None  # normalised to a tuple
    structured_outputs: StructuredOutputsParams | None = None  # the output follows this grammar

    def __post_init__(self) -> None:
        if isinstance(self.kv_budget, str) and self.kv_budget != "auto":
            raise ValueError(f"kv_budget must be a token count or \"auto\", got {self.kv_budget!r}")
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            optional = self.__dataclass_fields__[name].default is None
            if not (value is None and optional) and not (name == "kv_budget" and value == "auto"):
                object.__setattr__(self, name, bound.check(name, value))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(self.stop_token_ids)} ids, more than {MAX_STOP_TOKEN_IDS}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "keep_prompt"):
            if not isinstance(getattr(self, name), bool) and not (name == "keep_prompt" and self.keep_prompt is None):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.prompt_compression not in (None, "bounded", "deferred"):
            raise ValueError(f"prompt_compression must be bounded or deferred, got {self.prompt_compression!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.kv_budget_max is not None and self.kv_budget not in ("auto", None):
            raise ValueError("kv_budget_max bounds an automatic budget: set kv_budget=\"auto\" (or leave it to "
                             "an engine whose default is automatic)")
        if self.eviction_policy is not None:
            get_policy(self.eviction_policy)
        object.__setattr__(self, "forced_token_ids", _token_ids("forced_token_ids", self.forced_token_ids))
        if len(self.forced_token_ids) > self.max_tokens:
            raise ValueError(f"forced_token_ids holds {len(self.forced_token_ids)} tokens, more than "
                             f"max_tokens={self.max_tokens}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise ValueError(f"stop must be a string or a list of strings, got {_short(stop)}")
    if not all(strings):
        raise ValueError(f"stop must not contain an empty string, got {_short(stop)}")
    for s in strings:
        check_text("stop", s)
    return tuple(strings)


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    valid = isinstance(ids, (list, tuple)) and all(type(i) is int and 0 <= i <= INT32_MAX for i in ids)
    if not valid:
        raise ValueError(f"{name} must be a list of integers in [0, {INT32_MAX}], got {_short(ids)}")
    return tuple(ids)


def check_text(name: str, text: str) -> None:
    """Raises ValueError naming `name` if `text` is not valid Unicode (a lone surrogate has no UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode (a lone surrogate at index {exc.start})") from None


def _short(value: object, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters (a huge integer by its size: its repr may not exist)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
