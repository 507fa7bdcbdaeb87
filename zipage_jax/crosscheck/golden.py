"""python -m zipage_jax.crosscheck golden FILE... [--backend xla|pallas-interpret] [--json]

Runs our scoring and compaction on the inputs of golden files captured from the reference
engine (see /work/shared/golden/README.md) and compares every stage: scores within 1e-5,
keep flags equal except at ties of the k-th score, compacted pools identical to the bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.compact import compact, compact_reference
from pallas_kernels.kv_pool import KVPool
from zipage_jax.backend import Backend
from zipage_jax.compress.config import CompressionConfig
from zipage_jax.compress.policies import POLICIES, CompressRows, PolicyOptions, compress_rows, resolve_budget
from zipage_jax.compress.step import compress_layer

SCORE_TOL = 1e-5
STAGES = {  # golden array -> ScoreStages field
    "attn_score": "attn",
    "global_score": "global_score",
    "pooled_score": "pooled",
    "redundancy": "redundancy",
    "final_score": "final",
}
_REFERENCE_NAMES = {"enable_pooling": "pooling"}  # CompressionConfig field -> the golden config's key
_OURS_ONLY = {"prompt_pooling_size"}  # options the reference does not have (their defaults apply)

_compress_layer = jax.jit(compress_layer, static_argnames=("cfg", "backend"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", type=Path, help="golden .npz files")
    parser.add_argument("--backend", choices=[b.value for b in Backend], default=Backend.XLA.value)
    parser.add_argument("--json", action="store_true", help="one JSON object per file")


def run(args: argparse.Namespace) -> int:
    ok = True
    for path in args.files:
        report = check_file(path, args.backend)
        ok &= report["ok"]
        print(json.dumps(report) if args.json else _format(report), flush=True)
    return 0 if ok else 1


def load_case(path: Path) -> tuple[dict[str, np.ndarray], CompressionConfig, np.ndarray, np.ndarray, CompressRows]:
    """The arrays, our config, the block tables converted to (dummy-0 padded tables, num_blocks),
    and the rows: every sequence scored by the reference policy at the case's budget."""
    z = dict(np.load(path))
    case = json.loads(str(z["config"]))
    cfg = CompressionConfig(**{f.name: case[_REFERENCE_NAMES.get(f.name, f.name)]
                               for f in dataclasses.fields(CompressionConfig) if f.name not in _OURS_ONLY})
    budget = (case["max_blocks_per_seq"] - 1) * case["block_size"]
    if budget != case["budget_tokens"]:
        raise ValueError(f"{path}: budget_tokens {case['budget_tokens']} "
                         "!= (max_blocks_per_seq - 1) * block_size")
    if not np.isclose(case["softmax_scale"], case["head_dim"] ** -0.5):
        raise ValueError(f"{path}: softmax_scale {case['softmax_scale']} is not head_dim^-0.5")
    tables = z["block_tables"]
    num_blocks = (tables != -1).sum(axis=1).astype(np.int32)
    if not all((row[n:] == -1).all() for row, n in zip(tables, num_blocks)):
        raise ValueError(f"{path}: -1 padding must come after the valid blocks")
    batch = len(tables)
    options = PolicyOptions(sinks=case["sink_len"], recent_fraction=0.0)
    kv_budget = resolve_budget(POLICIES["zipage"], options, case["max_blocks_per_seq"] - 1, case["block_size"],
                               case["query_cache_len"])
    rows = compress_rows([kv_budget if n else None for n in num_blocks], batch)
    return z, cfg, np.where(tables == -1, 0, tables).astype(np.int32), num_blocks, rows


def _targets(z: dict, width: int) -> np.ndarray:
    """The reference's target tables [B, M + 1] as ours: the tables' width, dummy-0 padded."""
    given = z["target_block_tables"].astype(np.int32)
    targets = np.zeros((len(given), width), np.int32)
    n = min(width, given.shape[1])
    targets[:, :n] = given[:, :n]
    return targets


def check_file(path: Path, backend: Backend | str) -> dict:
    backend = Backend.parse(backend)
    z, cfg, tables, num_blocks, rows = load_case(path)
    block_size = z["k_cache_in"].shape[2]  # [L, NB, BS, Hkv, D]
    budget_tokens = int(rows.budget.max())
    num_layers = z["k_cache_in"].shape[0]
    has_scores = "score_cache_out" in z
    ours = {name: [] for name in (*STAGES, "keep", "k_cache_out", "v_cache_out", "score_cache_out")}
    given_keep = {name: [] for name in ("k_cache_out", "v_cache_out", "score_cache_out")}
    common = dict(
        block_tables=jnp.asarray(tables), num_blocks=jnp.asarray(num_blocks),
        query_ids=jnp.asarray(z["query_ids"], jnp.int32), compressed=jnp.asarray(z["compressed"]),
        target_tables=jnp.asarray(_targets(z, tables.shape[1])), rows=rows, cfg=cfg, backend=backend,
    )
    for layer in range(num_layers):
        pools = KVPool(jnp.asarray(z["k_cache_in"][layer]), jnp.asarray(z["v_cache_in"][layer]),
                       scores=jnp.asarray(z["score_cache_in"][layer]) if cfg.use_global_score else None)
        out, stages = _compress_layer(pools, jnp.asarray(z["query_cache"][layer]), **common)
        k, v, s = out.k, out.v, out.scores
        for name, field in STAGES.items():
            value = getattr(stages, field)
            ours[name].append(None if value is None else np.asarray(value))
        ours["keep"].append(np.asarray(stages.keep))
        ours["k_cache_out"].append(np.asarray(k))
        ours["v_cache_out"].append(np.asarray(v))
        ours["score_cache_out"].append(None if s is None else np.asarray(s))
        k, v, s = compact_on_reference_keep(z, layer, cfg, tables, budget_tokens // block_size, backend)
        given_keep["k_cache_out"].append(np.asarray(k))
        given_keep["v_cache_out"].append(np.asarray(v))
        given_keep["score_cache_out"].append(None if s is None else np.asarray(s))

    report: dict = {"file": str(path), "backend": backend.value, "stages": {}}
    ok = True
    for name in STAGES:
        if name not in z:
            continue
        if ours[name][0] is None:
            report["stages"][name] = "missing"
            ok = False
            continue
        err = _max_abs_err(np.stack(ours[name]), z[name])
        report["stages"][name] = err
        ok &= err <= SCORE_TOL
    mismatches, unexplained = _keep_mismatches(np.stack(ours["keep"]), z["keep"], z["final_score"],
                                               budget_tokens)
    report["keep_mismatches"] = mismatches
    report["keep_mismatches_not_ties"] = unexplained
    ok &= unexplained == 0
    given = ["k_cache_out", "v_cache_out"] + (["score_cache_out"] if has_scores else [])
    report["pools_bit_identical_given_reference_keep"] = {
        name: _bit_equal(np.stack(given_keep[name]), z[name]) for name in given
    }
    ok &= all(report["pools_bit_identical_given_reference_keep"].values())
    # Our own keep: the pools must match too, unless keep differs at ties (both are right).
    report["pools_bit_identical"] = {
        name: _bit_equal(np.stack(ours[name]), z[name]) for name in given[:2]
    }
    if has_scores:  # holds our global scores, equal to the reference's within the score tolerance
        report["score_cache_out_max_abs_err"] = _max_abs_err(np.stack(ours["score_cache_out"]),
                                                             z["score_cache_out"])
    if mismatches == 0:
        ok &= all(report["pools_bit_identical"].values())
        ok &= report.get("score_cache_out_max_abs_err", 0.0) <= SCORE_TOL
    report["ok"] = bool(ok)
    return report


def compact_on_reference_keep(z: dict, layer: int, cfg: CompressionConfig, tables: np.ndarray, budget_blocks: int,
                              backend: Backend) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Compaction alone, on the reference's keep flags (and its global score when enabled)."""
    score_cache = None
    if cfg.use_global_score:  # the reference writes the global score back before compacting
        score_cache = np.array(z["score_cache_in"][layer])
        for b, row in enumerate(tables):
            for w in range(int((z["block_tables"][b] != -1).sum())):
                score_cache[row[w]] = z["global_score"][layer, b, :, w].T
        score_cache = jnp.asarray(score_cache)
    pools = [jnp.asarray(z["k_cache_in"][layer]), jnp.asarray(z["v_cache_in"][layer])]
    pools += [] if score_cache is None else [score_cache]
    args = (pools, jnp.asarray(z["keep"][layer]), jnp.asarray(tables),
            jnp.asarray(z["target_block_tables"][:, :budget_blocks], jnp.int32))
    out = compact(*args, interpret=backend.interpret) if backend.uses_pallas else compact_reference(*args)
    return out[0], out[1], (out[2] if score_cache is not None else None)


def _max_abs_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """Largest |ours - ref| where both are finite; infinite where the +-inf layouts differ."""
    finite = np.isfinite(ref)
    if not np.array_equal(finite, np.isfinite(ours)) or not np.array_equal(ours[~finite], ref[~finite]):
        return float("inf")
    return float(np.abs(ours[finite] - ref[finite]).max(initial=0.0))


def _keep_mismatches(ours: np.ndarray, ref: np.ndarray, final: np.ndarray, k: int) -> tuple[int, int]:
    """(all keep-flag mismatches, those not at a token whose reference score ties the k-th score)."""
    rows = final.reshape(*final.shape[:3], -1)
    kth = -np.sort(-rows, axis=-1)[..., k - 1]  # [L, B, Hkv]
    at_tie = rows == kth[..., None]
    differ = (ours != ref).reshape(rows.shape)
    return int(differ.sum()), int((differ & ~at_tie).sum())


def _bit_equal(ours: np.ndarray, ref: np.ndarray) -> bool:
    return ours.dtype == ref.dtype and ours.tobytes() == ref.tobytes()


def _format(report: dict) -> str:
    lines = [f"{report['file']} [{report['backend']}]: {'OK' if report['ok'] else 'MISMATCH'}"]
    for name, err in report["stages"].items():
        lines.append(f"  {name:<15} " + (f"max abs err {err}" if isinstance(err, float) else err))
    lines.append(f"  keep            {report['keep_mismatches']} mismatches, "
                 f"{report['keep_mismatches_not_ties']} not explained by ties")
    for name, same in report["pools_bit_identical_given_reference_keep"].items():
        lines.append(f"  {name:<15} bit-identical on the reference's keep: {same}")
    ties = " (keep differs at k-th score ties: not required)" if report["keep_mismatches"] else ""
    for name, same in report["pools_bit_identical"].items():
        lines.append(f"  {name:<15} bit-identical on our keep: {same}{ties}")
    if "score_cache_out_max_abs_err" in report:
        err = report["score_cache_out_max_abs_err"]
        lines.append(f"  score_cache_out max abs err on our keep {err}")
    return "\n".join(lines)
