"""Per-token vs per-channel (KIVI) int4 keys: how much attention error each costs on dev data.

    zipage-jax eval int4-keys [--length 1024] [--queries 16] [--json] [--model default]

What it measures. The default model prefills each dev text (the first --length tokens of the
standard library's argparse.py and pydoc_data/topics.py, datasets.DEV_TEXTS) in one
jitted pass of the decoder's stages (models/decoder.py, as the engine runs them), which hands
every layer's keys (after RoPE), values and the last --queries queries (16: what the engine's
query cache holds) to this evaluation. Per layer it computes the exact causal attention output of
those queries over all the text's keys/values, then the same with the cache quantized (numpy,
written here independently of the engine's kernels; symmetric abs-max, scale = max|x| / qmax):
  int8-token    keys and values: int8, one float32 scale per token per kv head (qmax 127); the
                yardstick (the engine's int8 pool)
  int4-token    keys and values: int4, one float16 scale per token per kv head per group of 32
                consecutive head-dim elements (qmax 7); the int4 pool's layout
  int4-channel  keys: int4, one float16 scale per channel (head-dim element) per kv head per
                group of 32 consecutive tokens (KIVI's per-channel keys, symmetric here; a last
                partial group gets its own scales); values as int4-token. For head dim 64 that is
                D/32 = 2 scales per key, as int4-token: equal scale bytes.
  int4-hadamard keys and values: int4-token after an orthonormal Hadamard rotation of the head
                dim (QuaRot-style; q.k is unchanged when the query is rotated too), which spreads
                outlier channels over all of them; the same bytes as int4-token.
int4 scales are rounded to float16 before quantizing, and floored at the scale dtype's smallest
normal number (as the engine does).

Numbers, per layer (mean over texts) and their mean over layers:
  attn_err       ||o_q - o|| / ||o|| over the cached queries and all query heads, both keys and
                 values quantized: the number to compare
  attn_err_k     the same with only the keys quantized (values exact): the keys' share alone
  key_err        ||k_q - k|| / ||k|| over all the text's keys (after RoPE)
  value_err      the same for the values
  key_bytes      bytes a key costs per token per kv head (values + scales)
How to read it: int4-channel gains over int4-token by the ratio of their attn_err (and attn_err_k
for the keys alone); that gain is what per-channel keys would buy, against the cost of
re-quantizing keys at every compaction (a per-channel scale is shared by 32 tokens, which
compaction scatters to other slots) and a full-precision residual for the block being filled.
int8-token shows what a loss "small enough" looks like. model_check is the relative difference
between this evaluation's exact attention and the model's own (it should be ~1e-6: it validates the
head mapping and the softmax scale).

--json prints, last, one line {"results": [per layer and layout, per text too], "summary":
[per layout means], "config": {...}, "commit", "date", "run": run_record()}.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from zipage_jax.evals.datasets import DEV_TEXTS, stdlib_path
from zipage_jax.harness import add_output_arguments, emit, log, run_record

GROUP = 32  # int4: elements per scale (per-token layout), tokens per scale (per-channel layout)
INT4_QMAX, INT8_QMAX = 7.0, 127.0
LAYOUTS = ("int8-token", "int4-token", "int4-channel", "int4-hadamard")
METRICS = ("attn_err", "attn_err_k", "key_err", "value_err")


# -- quantizers (numpy; dequantized float32 out) ---------------------------------------------------

def _absmax_round_trip(x: np.ndarray, axis: int, qmax: float, scale_dtype) -> np.ndarray:
    """Symmetric abs-max quantization with one scale per slice of `x` along `axis`: the scale
    (max|x| / qmax) is stored in `scale_dtype` (floored at its smallest normal number), values are
    round(x / scale) clipped to [-qmax, qmax]; returns q * scale in float32."""
    x = np.asarray(x, np.float32)
    tiny = float(np.finfo(scale_dtype).tiny)
    scale = np.maximum(np.abs(x).max(axis=axis, keepdims=True) / qmax, tiny).astype(scale_dtype)
    scale = np.maximum(scale.astype(np.float32), tiny)  # a float16 scale that rounded below the floor
    q = np.clip(np.rint(x / scale), -qmax, qmax)
    return (q * scale).astype(np.float32)


def int8_per_token(x: np.ndarray) -> np.ndarray:
    """x: [T, H, D] -> int8 round trip, one float32 scale per token per head."""
    return _absmax_round_trip(x, -1, INT8_QMAX, np.float32)


def int4_per_token(x: np.ndarray, group: int = GROUP) -> np.ndarray:
    """x: [T, H, D] -> int4 round trip, one float16 scale per token per head per `group`
    consecutive elements of D (the int4 pool's layout)."""
    T, H, D = x.shape
    if D % group:
        raise ValueError(f"head dim {D} is not a multiple of the group {group}")
    return _absmax_round_trip(x.reshape(T, H, D // group, group), -1, INT4_QMAX, np.float16).reshape(T, H, D)


def int4_per_channel(x: np.ndarray, group: int = GROUP) -> np.ndarray:
    """x: [T, H, D] -> int4 round trip, one float16 scale per channel (element of D) per head per
    `group` consecutive tokens (KIVI's keys); a last partial group of tokens has its own scales."""
    x = np.asarray(x, np.float32)
    return np.concatenate([_absmax_round_trip(x[s:s + group], 0, INT4_QMAX, np.float16)
                           for s in range(0, x.shape[0], group)], axis=0)


def hadamard(n: int) -> np.ndarray:
    """[n, n] orthonormal Hadamard matrix (Sylvester), n a power of two."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != n:
        raise ValueError(f"a Hadamard rotation needs a power-of-two head dim, got {n}")
    return h / np.sqrt(n)


def int4_hadamard(x: np.ndarray) -> np.ndarray:
    """x: [T, H, D] -> int4-token round trip in the Hadamard-rotated basis, rotated back."""
    h = hadamard(x.shape[-1])
    return int4_per_token(np.asarray(x, np.float32) @ h) @ h.T


def quantize(layout: str, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (keys, values) round trip of one layout (see LAYOUTS)."""
    if layout == "int8-token":
        return int8_per_token(k), int8_per_token(v)
    if layout == "int4-token":
        return int4_per_token(k), int4_per_token(v)
    if layout == "int4-channel":
        return int4_per_channel(k), int4_per_token(v)
    if layout == "int4-hadamard":
        return int4_hadamard(k), int4_hadamard(v)
    raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")


def key_bytes(layout: str, head_dim: int, group: int = GROUP) -> float:
    """Bytes one key costs per token per kv head: its values plus its (share of the) scales."""
    if layout == "int8-token":
        return head_dim + 4.0
    if layout in ("int4-token", "int4-channel", "int4-hadamard"):
        # D/2 bytes + D/group float16 scales (per channel: D per group tokens)
        return head_dim / 2 + 2.0 * head_dim / group
    raise ValueError(f"unknown layout {layout!r}")


# -- attention -------------------------------------------------------------------------------------

def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal attention of the last Q queries over T keys, in float64.

    q: [Q, Hq, D] (positions T-Q .. T-1); k, v: [T, Hkv, D] -> [Q, Hq, D]; query head h reads kv
    head h // (Hq / Hkv); softmax scale D**-0.5."""
    Q, Hq, D = q.shape
    T, Hkv, _ = k.shape
    qh = np.asarray(q, np.float64).reshape(Q, Hkv, Hq // Hkv, D)
    s = np.einsum("qhgd,thd->hgqt", qh, np.asarray(k, np.float64)) * D**-0.5
    visible = np.arange(T)[None, :] <= (T - Q + np.arange(Q))[:, None]  # [Q, T]
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hgqt,thd->qhgd", p, np.asarray(v, np.float64)).reshape(Q, Hq, D)


def rel_err(approx: np.ndarray, exact: np.ndarray) -> float:
    exact = np.asarray(exact, np.float64)
    return float(np.linalg.norm(np.asarray(approx, np.float64) - exact) / np.linalg.norm(exact))


def layer_errors(q: np.ndarray, k: np.ndarray, v: np.ndarray, layouts=LAYOUTS) -> dict[str, dict[str, float]]:
    """layout -> {attn_err, attn_err_k, key_err, value_err} for one layer's q [Q, Hq, D], k, v [T, Hkv, D]."""
    exact = attention(q, k, v)
    out = {}
    for layout in layouts:
        kq, vq = quantize(layout, k, v)
        out[layout] = {"attn_err": rel_err(attention(q, kq, vq), exact),
                       "attn_err_k": rel_err(attention(q, kq, v), exact),
                       "key_err": rel_err(kq, k), "value_err": rel_err(vq, v)}
    return out


# -- the model's keys, values and queries ----------------------------------------------------------

def capture(loaded, token_ids: list[int], num_queries: int) -> list[tuple[np.ndarray, ...]]:
    """Per layer (q [Q, Hq, D] of the last Q tokens, k [T, Hkv, D] after RoPE, v [T, Hkv, D], the
    model's attention output of those queries [Q, Hq, D]), float32: one prefill of the loaded
    model (models/loading.py) through the decoder's stages, every layer in one group."""
    import jax
    import jax.numpy as jnp

    from zipage_jax.layers.attention import causal_attention
    from zipage_jax.models.decoder import stages as decoder_stages

    stages, params = decoder_stages(loaded.model, loaded.config.num_layers)

    def attn(layer, q, k, v, cache):
        out, _ = causal_attention(layer, q, k, v, None)
        taken = tuple(a.astype(jnp.float32) for a in (q[0, -num_queries:], k[0], v[0], out[0, -num_queries:]))
        return out, cache + (taken,)

    @jax.jit
    def group_step(group, x, positions):
        return stages.layers(group, x, positions, attn, ())

    ids = jnp.asarray([token_ids], jnp.int32)
    positions = jnp.arange(len(token_ids), dtype=jnp.int32)[None]
    x = jax.jit(stages.embed)(params.embed, ids)
    layers = []
    for group in params.groups:
        x, taken = group_step(group, x, positions)
        layers += [tuple(np.asarray(a) for a in t) for t in taken]
    return layers


# -- report ----------------------------------------------------------------------------------------

def summarize(per_text: dict[str, list[dict]], head_dim: int) -> tuple[list[dict], list[dict]]:
    """per_text: text -> per layer {layout: metrics, "model_check": float}. Returns (rows per layer
    and layout, metrics the mean over texts with a per-text copy; summary rows per layout, the mean
    over layers)."""
    texts = list(per_text)
    num_layers = len(per_text[texts[0]])
    rows, summary = [], []
    for layout in LAYOUTS:
        layer_rows = []
        for layer in range(num_layers):
            by_text = {t: per_text[t][layer][layout] for t in texts}
            row = {"layer": layer, "layout": layout,
                   **{m: float(np.mean([by_text[t][m] for t in texts])) for m in METRICS},
                   "model_check": max(per_text[t][layer]["model_check"] for t in texts), "by_text": by_text}
            layer_rows.append(row)
        rows += layer_rows
        summary.append({"layout": layout, "key_bytes": key_bytes(layout, head_dim),
                        **{m: float(np.mean([r[m] for r in layer_rows])) for m in METRICS},
                        **{f"max_{m}": float(np.max([r[m] for r in layer_rows])) for m in ("attn_err", "attn_err_k")}})
    return rows, summary


def markdown(rows: list[dict], summary: list[dict], config: dict) -> str:
    title = (f"int4 keys, per token vs per channel: {config['model']}, texts {', '.join(config['texts'])} "
             f"({config['length']} tokens each), last {config['queries']} queries; mean over texts")
    header = ("| layout | key bytes/token/head | attn_err | attn_err (keys only) | max layer attn_err | key_err "
              "| value_err |")
    lines = [title, "", header, "|---|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(f"| {s['layout']} | {s['key_bytes']:g} | {s['attn_err']:.4f} | {s['attn_err_k']:.4f} | "
                     f"{s['max_attn_err']:.4f} | {s['key_err']:.4f} | {s['value_err']:.4f} |")
    by = {(r["layer"], r["layout"]): r for r in rows}
    num_layers = 1 + max(r["layer"] for r in rows)
    lines += ["", "Per layer: attn_err / attn_err (keys only) / key_err", "",
              "| layer | " + " | ".join(LAYOUTS) + " |", "|---:|" + "---:|" * len(LAYOUTS)]
    for layer in range(num_layers):
        cells = [f"{by[layer, lo]['attn_err']:.4f} / {by[layer, lo]['attn_err_k']:.4f} / {by[layer, lo]['key_err']:.4f}"
                 for lo in LAYOUTS]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    mean = [f"{s['attn_err']:.4f} / {s['attn_err_k']:.4f} / {s['key_err']:.4f}" for s in summary]
    lines.append("| mean | " + " | ".join(mean) + " |")
    check = max(r["model_check"] for r in rows)
    lines += ["", f"model_check (this script's exact attention vs the model's): {check:.2e}"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--length", type=int, default=1024, help="tokens of each dev text (default 1024)")
    p.add_argument("--queries", type=int, default=16, help="last queries attending (the engine's query cache: 16)")
    p.add_argument("--texts", nargs="+", default=list(DEV_TEXTS), help="standard library files (default: dev)")
    add_output_arguments(p)


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    from zipage_jax.models.loading import load_model

    loaded = load_model(args.model)
    mc = loaded.config
    per_text = {}
    for name in args.texts:
        text = stdlib_path(name).read_text(encoding="utf-8", errors="replace")
        ids = loaded.tokenizer(text)["input_ids"][:args.length]
        if len(ids) < args.length:
            raise ValueError(f"{name} has only {len(ids)} tokens; --length is {args.length}")
        layers = []
        for q, k, v, model_out in capture(loaded, ids, args.queries):
            errs = layer_errors(q, k, v)
            errs["model_check"] = rel_err(attention(q, k, v), model_out)
            layers.append(errs)
        per_text[name] = layers
        log(f"{name}: {len(layers)} layers in {time.perf_counter() - t0:.0f} s")
    config = {"model": args.model, "length": args.length, "queries": args.queries, "texts": args.texts,
              "group": GROUP, "head_dim": mc.head_dim, "num_heads": mc.num_heads, "num_kv_heads": mc.num_kv_heads,
              "num_layers": mc.num_layers}
    rows, summary = summarize(per_text, mc.head_dim)
    print(markdown(rows, summary, config))
    if not (args.json or args.out):
        return 0
    info = run_record()
    return emit({"results": rows, "summary": summary, "config": config, "commit": info["commit"],
                 "date": info["date"], "run": info}, args)
