"""The tokenizer a GGUF file describes, built with `tokenizers` (no torch, no transformers GGUF path).

    tokenizer = gguf_tokenizer(gguf.open_gguf(path))   # a transformers PreTrainedTokenizerFast

A GGUF file carries its tokenizer as llama.cpp metadata (`tokenizer.ggml.*`): the token list,
each token's type, the BPE merges (or SentencePiece scores), the special token ids and the
chat template. Two kinds are built here, the ones the llama / qwen2 / qwen3 / gemma3 families use:

- "gpt2": byte-level BPE (Llama 3, Qwen2, Qwen3, SmolLM). Tokens are spelled in GPT-2's
  byte alphabet; `tokenizer.ggml.pre` names the regex that splits text before BPE.
- "llama": SentencePiece-style BPE (Llama 2, Mistral, TinyLlama, Gemma). Tokens use "▁" for a
  space, bytes the vocabulary lacks fall back to its `<0xXX>` tokens, and when the file lists no
  merges they are derived from the token scores. Gemma's files differ twice: their tokens of
  two or more spaces are written with real spaces (the vocabulary spells them "▁▁"), and their
  merges follow the tokens' order in the file, not their scores.

A file that embeds Hugging Face's own `tokenizer.json` (`tokenizer.huggingface.json`) is used
as is.
"""

from __future__ import annotations

from gguf import GGUFReader, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from zipage_jax.models.gguf import field_value

# Split patterns (`tokenizer.ggml.pre`) of the byte-level vocabularies, None = GPT-2's own.
# SmolLM's llama.cpp pattern also splits digits one by one; its vocabulary has no token with
# more than one digit, so GPT-2's pattern gives the same tokens.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
TOKENIZER_KINDS = ("gpt2", "llama")
SPIECE_SPACE = "\u2581"  # "▁"


def gguf_tokenizer(reader: GGUFReader):
    """The file's tokenizer as a transformers PreTrainedTokenizerFast (chat template included)."""
    from transformers import PreTrainedTokenizerFast

    kind = field_value(reader, "tokenizer.ggml.model")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    types = field_value(reader, "tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    hf_json = field_value(reader, "tokenizer.huggingface.json")
    if hf_json:
        backend = Tokenizer.from_str(hf_json)
    elif kind == "gpt2":
        backend = _byte_level_bpe(reader, tokens, types)
    elif kind == "llama":
        backend = _sentencepiece_bpe(reader, tokens, gemma=field_value(reader, "general.architecture") == "gemma3")
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer {kind!r} (tokenizer.ggml.model); supported: {', '.join(TOKENIZER_KINDS)}"
        )
    _add_special_tokens(backend, tokens, types)

    def named(key: str) -> str | None:
        token_id = field_value(reader, f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=named("bos_token_id"),
        eos_token=named("eos_token_id"),
        unk_token=named("unknown_token_id"),
        pad_token=named("padding_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
        add_bos_token=bool(field_value(reader, "tokenizer.ggml.add_bos_token", kind == "llama")),
        add_eos_token=bool(field_value(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=field_value(reader, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the
    other 68 bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _byte_level_bpe(reader: GGUFReader, tokens: list[str], types: list[int]) -> Tokenizer:
    pre = field_value(reader, "tokenizer.ggml.pre", "default")
    if pre not in BYTE_LEVEL_SPLITS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {', '.join(BYTE_LEVEL_SPLITS)}"
        )
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())

    def spell(token: str, token_type: int) -> str:
        # llama.cpp writes added tokens as their text; they are matched whole, never by BPE
        if token_type in (TokenType.CONTROL, TokenType.USER_DEFINED) or set(token) <= spelled:
            return token
        return "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = {spell(t, ty): i for i, (t, ty) in enumerate(zip(tokens, types))}
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = BYTE_LEVEL_SPLITS[pre]
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(reader: GGUFReader, tokens: list[str], *, gemma: bool) -> Tokenizer:
    if gemma:
        tokens = [SPIECE_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if reader.fields.get("tokenizer.ggml.merges") is not None:
        merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges")]
    elif gemma:
        merges = merges_from_scores(tokens, [-i for i in range(len(tokens))])  # file order
    else:
        scores = field_value(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise ValueError("GGUF SentencePiece tokenizer has neither merges nor scores (tokenizer.ggml.scores)")
        merges = merges_from_scores(tokens, scores)
    unk_id = field_value(reader, "tokenizer.ggml.unknown_token_id")
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(field_value(reader, "tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a token into two vocabulary tokens, the
    best-scored result first (ties: longer left part, longer right part, then file order)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, (token, score) in enumerate(zip(tokens, scores)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, -len(left), -len(right), i, ids[left], ids[right], left, right))
    ranked.sort()
    return [(r[-2], r[-1]) for r in ranked]


def _add_special_tokens(backend: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (`<|im_end|>`) become special tokens, user-defined ones (`<think>`) plain
    added tokens: both are matched whole in the text instead of being split by BPE. A user-defined
    token the vocabulary spells otherwise (Gemma's runs of spaces) is left to BPE."""
    control = [t for t, ty in zip(tokens, types) if ty == TokenType.CONTROL]
    user = [t for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED and backend.token_to_id(t) is not None]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
