"""Work that would stall the event loop, done in a small thread pool: parsing request bodies,
rendering chat templates and tokenizing.

Each pool thread tokenizes with its own copy of the tokenizer (a fast tokenizer mutates itself
while encoding and must not be shared between threads). A prompt too long to fit the context
is refused before it is tokenized when its size in bytes alone proves it (see
`bytes_per_token`), so the cost of tokenizing is bounded by the context, not by the body.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, RootModel, ValidationError

from zipage_jax.chat import chat_prompt_ids, chat_prompt_text
from zipage_jax.engine.admission import check_prompt_length
from zipage_jax.server.errors import OpenAIError, validation_error
from zipage_jax.server.limits import RequestLimits
from zipage_jax.server.protocol import ChatCompletionRequest, TokenizeChatRequest, TokenizeCompletionRequest
from zipage_jax.server.structured import template_tools

NUM_THREADS = 2  # one long request leaves a thread for the others
# Normalizers that shrink UTF-8 text at most 4x (NFKC maps a 4-byte character to 1 byte; a
# composition of a base and its marks shrinks less), and those that only insert or replace.
_BOUNDED_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Prepend", "Replace"}
_NORMALIZER_SHRINK = 4

Body = TypeVar("Body", bound=BaseModel)


class Preprocessor:
    def __init__(self, limits: RequestLimits, num_threads: int = NUM_THREADS):
        """`limits`: the chat text bound, checked here before a template renders the messages."""
        self._limits = limits
        self._num_threads = num_threads
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="zipage-preprocess")
        self._local = threading.local()
        self._copies: list[Any] = []  # tokenizer copies not yet taken by a thread
        self._bytes_per_token: int | None = None
        self._lock = threading.Lock()

    def prepare(self, tokenizer: Any) -> None:
        """Copies the engine's tokenizer for each thread; run off the event loop (the copies take
        time that would otherwise pause it at a thread's first request)."""
        self._copies = [copy.deepcopy(tokenizer) for _ in range(self._num_threads)]
        self._bytes_per_token = bytes_per_token(tokenizer)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def body(self, request: Request, model: type[Body]) -> Body:
        """The request's body validated as `model` (in a pool thread; see parse); OpenAIError 415
        unless its Content-Type is JSON."""
        content_type = request.headers.get("content-type")
        if content_type is None or not _is_json(content_type):
            got = "no Content-Type" if content_type is None else f"Content-Type {content_type[:100]!r}"
            raise OpenAIError(415, f"the request body must be JSON (Content-Type: application/json), got {got}")
        return await self.run(self.parse, model, await request.body())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- in a pool thread ----------------------------------------------------------------------

    def parse(self, model: type[Body], raw: bytes) -> Body:
        """The validated body, or OpenAIError 400 naming the first bad field."""
        context = self._limits.validation_context()
        try:
            return model.model_validate_json(raw, context=context)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            errors = _python_json_errors(model, raw, context) or errors
        if issubclass(model, RootModel):  # a union of forms: the location starts with the form's tag
            errors = [{**e, "loc": e["loc"][1:]} for e in errors]
        raise validation_error(RequestValidationError(errors))

    def completion_prompts(self, prompt: str | list, max_model_len: int) -> list[list[int]]:
        """Each prompt's token ids (strings tokenized)."""
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            prompt = [prompt]
        return [self._tokenize(p, max_model_len) if isinstance(p, str) else list(p) for p in prompt]

    def prompt_texts(self, prompt: str | list, ids: list[list[int]]) -> list[str]:
        """Each prompt's text, as echo shows it: a string as given, token ids decoded."""
        texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt[0], str) else [None] * len(ids)
        tokenizer, _ = self._tokenizer()
        return [text if text is not None else tokenizer.decode(p) for text, p in zip(texts, ids)]

    def chat_prompt(self, body: ChatCompletionRequest, max_model_len: int) -> list[int]:
        self._limits.check_chat_bytes(body.messages)
        messages = [m.as_template_input() for m in body.messages]
        tokenizer = self._refuse_if_too_long(sum(len(m["content"].encode()) for m in messages), max_model_len,
                                             "messages")
        try:
            ids = chat_prompt_ids(tokenizer, messages, max_length=max_model_len, **_template_options(body))
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from exc
        _refuse_unless_fits(len(ids), max_model_len, "messages")  # ids stop at max_model_len
        return ids

    def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> tuple[list[int], list[str] | None]:
        """/tokenize: the token ids of the prompt or of the rendered messages (at any length),
        and their token strings if asked for."""
        tokenizer, _ = self._tokenizer()
        if isinstance(request, TokenizeChatRequest):
            self._limits.check_chat_bytes(request.messages)
            try:
                text = chat_prompt_text(tokenizer, [m.as_template_input() for m in request.messages],
                                        **_template_options(request))
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="messages") from exc
        else:
            text = request.prompt
        ids = list(tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"])
        return ids, tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None

    def detokenize(self, token_ids: list[int]) -> str:
        """/detokenize: the text of `token_ids` (special tokens included); 400 for an id that is
        not the tokenizer's."""
        tokenizer, _ = self._tokenizer()
        vocab = len(tokenizer)
        unknown = next((i for i in token_ids if i >= vocab), None)
        if unknown is not None:
            raise OpenAIError(400, f"tokens: {unknown} is not a token id of this model's tokenizer "
                              f"(ids are in [0, {vocab}))", param="tokens")
        return tokenizer.decode(token_ids)

    def _tokenize(self, text: str, max_model_len: int) -> list[int]:
        tokenizer = self._refuse_if_too_long(len(text.encode()), max_model_len, "prompt")
        ids = list(tokenizer(text, truncation=True, max_length=max_model_len)["input_ids"])
        _refuse_unless_fits(len(ids), max_model_len, "prompt")  # ids stop at max_model_len
        return ids

    def _refuse_if_too_long(self, num_bytes: int, max_model_len: int, param: str) -> Any:
        """This thread's tokenizer, unless `num_bytes` of text surely leave no room in the context (400)."""
        tokenizer, per_token = self._tokenizer()
        if per_token is not None:
            _refuse_unless_fits(-(-num_bytes // per_token), max_model_len, param)
        return tokenizer

    def _tokenizer(self) -> tuple[Any, int | None]:
        """This thread's copy of the tokenizer and the tokenizer's bytes_per_token."""
        local = self._local
        if not hasattr(local, "tokenizer"):
            with self._lock:
                local.tokenizer = self._copies.pop()
        return local.tokenizer, self._bytes_per_token


def _template_options(body: ChatCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    """How chat_prompt_ids / chat_prompt_text render `body`'s messages."""
    return {"tools": template_tools(body.tools), "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message, "chat_template_kwargs": body.chat_template_kwargs}


def _refuse_unless_fits(num_tokens: int, max_model_len: int, param: str) -> None:
    """OpenAIError 400 naming `param` if a prompt of at least `num_tokens` tokens leaves none to generate."""
    try:
        check_prompt_length(num_tokens, max_model_len, at_least=True)
    except ValueError as exc:
        raise OpenAIError.bad_request(exc, {"prompt": param}) from exc


def bytes_per_token(tokenizer: Any) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token covers, or None if there is none.

    A byte-level BPE token stands for one byte per character of its vocabulary string; any other
    for at most the UTF-8 bytes of that string (SentencePiece's "▁" is 3 bytes for a space);
    times what the tokenizer's normalizer can shrink the text by. So a text of b bytes has at
    least b / bytes_per_token tokens. None for a normalizer that may delete text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None:
        return None
    byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    added = tokenizer.get_added_vocab()  # matched in the raw text: they cover their UTF-8 bytes
    longest = max(len(token) if byte_level and token not in added else len(token.encode("utf-8", "replace"))
                  for token in tokenizer.get_vocab())
    return max(longest, 4) * shrink  # an unknown character is one token of up to 4 bytes


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    parts = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    if not all(p.get("type") in _BOUNDED_NORMALIZERS for p in parts):
        return None
    if any(p["type"] == "Replace" and len(p.get("content", "")) < 1 for p in parts):
        return None  # replacing with nothing deletes text
    return _NORMALIZER_SHRINK if any(p["type"].startswith("NF") for p in parts) else 1


def _python_json_errors(model: type[BaseModel], raw: bytes, context: dict[str, Any]) -> list[dict] | None:
    """The errors for a body that Python's json reads but pydantic's does not (a lone surrogate
    escape such as "\\ud800"): those of the parsed value, which name the field."""
    try:
        value = json.loads(raw)
        model.model_validate(value, context=context)
    except ValidationError as exc:
        return exc.errors(include_url=False)
    except ValueError:
        return None
    return None


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
