"""Decode speed through the low-precision tier against the resident model, in one run.

    python -m kq.bench.jobs tier_decode --json docs/h200/tier_decode.json

Greedy autoregressive decode of one sequence through ``kq_jax.qwen3_moe_arena.make_step``'s graphs: ``resident``
(every expert in memory), the arena that sheds at full residency (its graph without a tier) and
``tier`` at each ``--residency`` (an arena of the first S experts of each
layer, every other expert served from its ``--bits`` copy in the same graph; the slot tables held
fixed, so this is the graph's cost, not the host's). Token t+1 is dispatched before token t's id is
read back, one readback per token, the compiles before the clock; the figures are the median of
``--rounds`` rounds of ``--tokens`` tokens. Models: the trained checkpoints, and ``random-8L-olmoe-experts``,
a whole random Qwen3-MoE of 8 layers whose float32 experts are OLMoE's size (hidden 2048, width 1024, 64
experts, top-8), its tier random words of the right shapes (speed does not depend on their values). It is
not ``kq bench --sets decode-e2e``'s ``olmoe-size`` (experts alone, 16 layers of bf16, recorded routing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from kq.bench.common import EXPERT_SIZES, run_header, write_json

RANDOM_MODEL = "random-8L-olmoe-experts"
RANDOM_MODEL_CONFIG = dict(vocab_size=8192, hidden_size=EXPERT_SIZES["olmoe"][0], num_hidden_layers=8,
                           num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=64,
                           num_experts_per_tok=8, moe_intermediate_size=EXPERT_SIZES["olmoe"][1])


def _model(name: str, bits: int, group_size: int):
    """``(cfg, params with experts, tier arrays {projection: (packed, scales, biases) [L, E, ...]})``."""
    import jax
    import jax.numpy as jnp

    from kq_host.checkpoint import open_experts
    from kq_host.tier import build_tier
    from kq_jax import qwen3_moe
    from kq_jax.qwen3_moe_arena import tier_arrays

    if name == RANDOM_MODEL:
        cfg = qwen3_moe.Qwen3MoeConfig(**RANDOM_MODEL_CONFIG)
        params = qwen3_moe.init_params(cfg, jax.random.key(0))
        key = jax.random.key(1)
        tier = {}
        for name_, shape in (("gate_proj", (cfg.moe_intermediate_size, cfg.hidden_size)),
                             ("up_proj", (cfg.moe_intermediate_size, cfg.hidden_size)),
                             ("down_proj", (cfg.hidden_size, cfg.moe_intermediate_size))):
            lead = (cfg.num_hidden_layers, cfg.num_experts, shape[0])
            key, k1, k2 = jax.random.split(key, 3)
            packed = jax.random.bits(k1, (*lead, shape[1] * bits // 32), jnp.uint32)
            scales = jax.random.uniform(k2, (*lead, shape[1] // group_size), jnp.float32) * 1e-2
            tier[name_] = (packed, scales, -scales)
        return cfg, params, tier
    cfg = qwen3_moe.Qwen3MoeConfig.load(name)
    params = qwen3_moe.load_params(name, cfg)
    with open_experts(name, qwen3_moe.PROJECTIONS) as store:
        built = build_tier(store, cfg.num_hidden_layers, cfg.num_experts, bits=bits, group_size=group_size)
    return cfg, params, tier_arrays(built)


def _decode(step, args_of, first, tokens: int, rounds: int) -> list[float]:
    """Seconds per token of each round: token t+1 dispatched before token t is read."""
    import jax.numpy as jnp

    times = []
    for _ in range(rounds + 1):  # the first round compiles and warms
        token, cache = jnp.asarray([first], jnp.int32), None
        start = time.perf_counter()
        pending = None
        for position in range(tokens):
            logits, cache = step(*args_of(token, position, cache))[:2]
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            if pending is not None:
                int(pending[0])
            pending = token
        int(pending[0])
        times.append((time.perf_counter() - start) / tokens)
    return times[1:]


def measure(name: str, residencies, *, bits: int, group_size: int, tokens: int, rounds: int) -> list[dict]:
    import jax.numpy as jnp

    from kq_jax import qwen3_moe
    from kq_jax.qwen3_moe_arena import make_step

    cfg, params, tier = _model(name, bits, group_size)
    layers, experts = cfg.num_hidden_layers, cfg.num_experts
    rows = []

    def run(label: str, rule: str, arena, tables, tier_arrays):
        step = make_step(cfg, rule, (bits, group_size))

        def args_of(token, position, cache):
            if cache is None:
                cache = qwen3_moe.empty_cache(cfg, 1, tokens)
            return params, arena, tables, token, position, cache, tier_arrays

        per_token = _decode(step, args_of, 1, tokens, rounds)
        median = statistics.median(per_token)
        rows.append({"model": name, "mode": label, "tokens_per_s": 1 / median, "ms_per_token": median * 1e3,
                     "range_ms": [min(per_token) * 1e3, max(per_token) * 1e3]})
        rows[-1]["x_resident"] = rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"]
        print(f"{name:20s} {label:18s} {rows[-1]['tokens_per_s']:8.1f} tok/s  x resident "
              f"{rows[-1]['x_resident']:.3f}", flush=True)

    identity = jnp.tile(jnp.arange(experts, dtype=jnp.int32), (layers, 1))
    run("resident", "stall", None, identity, None)
    for residency in residencies:
        slots = max(cfg.num_experts_per_tok, round(residency * experts))
        arena = {p: jnp.stack([layer[p][:slots] for layer in params["layers"]]) for p in qwen3_moe.PROJECTIONS}
        tables = jnp.where(identity < slots, identity, -1)
        if slots == experts:  # the arena's graph without a tier, beside the tier's at full residency
            run("arena 100% (shed)", "shed", arena, tables, None)
        run(f"tier {residency:.0%} ({bits}-bit)", "tier", arena, tables, tier)
        del arena
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["models/stdlib-moe", "models/wheels-moe", RANDOM_MODEL])
    parser.add_argument("--residency", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    parser.add_argument("--bits", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    payload = {**run_header(), "bits": args.bits, "group_size": args.group_size, "tokens": args.tokens, "rounds": args.rounds,
               "rows": []}
    for name in args.models:
        payload["rows"] += measure(name, args.residency, bits=args.bits, group_size=args.group_size,
                                   tokens=args.tokens, rounds=args.rounds)
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
