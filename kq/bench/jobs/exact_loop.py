"""The exact layer-by-layer loop end to end, with and without look-ahead prefetch, against the resident model.

    python -m kq.bench.jobs exact_loop --json docs/h200/exact_loop.json

Each trained checkpoint decodes its held-out text teacher-forced (``--warmup`` tokens, then ``--tokens``
measured) through :class:`kq_jax.exact_loop.ExactLoop`: an arena of each residency, its experts read
from the checkpoint's safetensors files by the manager's workers (from the page cache once read), LFU
and LRU, look-ahead off, one layer and two layers ahead. Every row's logits are checked token by token against the loop's with
every expert resident (``loop 100%``), bit for bit (``exact``), and that row against the one-program
resident model (``max_abs_diff_vs_resident``). ``resident`` is the model with every expert in memory as
one program per token (token t+1 dispatched before token t is read); ``loop 100%`` is the cost of the
per-layer round trips alone. Columns per token: critical-path reads and
their wait, prefetch reads, and of those the used and wasted ones (evicted before use), MiB read.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from kq.bench.common import run_header, write_json


def _resident(params, cfg, tokens):
    """The resident model's logits bits per token, and its seconds per token (dispatch-ahead loop)."""
    import jax
    import jax.numpy as jnp

    from kq_jax import qwen3_moe

    step = jax.jit(lambda params, token, position, cache: qwen3_moe.decode_step(
        params, token, position, cache, cfg, lambda layer, p, x: (qwen3_moe.moe_resident(p, x, cfg), None))[:2])
    bits, seconds = [], []
    for _ in range(2):  # the first pass compiles
        cache, pending, out = qwen3_moe.empty_cache(cfg, 1, tokens.size), None, []
        start = time.perf_counter()
        for position, token in enumerate(tokens.tolist()):
            logits, cache = step(params, jnp.asarray([token], jnp.int32), position, cache)
            if pending is not None:
                out.append(np.asarray(pending).view(np.uint32))
            pending = logits
        out.append(np.asarray(pending).view(np.uint32))
        seconds.append((time.perf_counter() - start) / tokens.size)
        bits = out
    return bits, seconds[-1]


def _loop(study, cfg, tokens, reference, residency, policy, lookahead, warmup, queue_depth):
    from kq_host.checkpoint import open_experts
    from kq_host.residency import ResidencyManager
    from kq_jax import qwen3_moe
    from kq_jax.arena import JaxArena
    from kq_jax.exact_loop import ExactLoop

    layers, experts = cfg.num_hidden_layers, cfg.num_experts
    slots = max(cfg.num_experts_per_tok, round(residency * experts))
    with open_experts(study.config.checkpoint, qwen3_moe.PROJECTIONS) as store:
        shapes = {name: (shape, np.float32) for name, (shape, _) in store.expert_shapes(0).items()}
        arena = JaxArena(layers, slots, shapes)
        manager = ResidencyManager(layers, experts, slots, arena=arena, policy=policy, queue_depth=queue_depth,
                                   loader=lambda layer, expert, slot: store.read_expert(layer, expert),
                                   bytes_per_expert=store.expert_nbytes(0))
        for layer in range(layers):
            manager.preload(layer, range(slots))
        loop = ExactLoop(study.params, cfg, manager, arena, length=tokens.size, lookahead=lookahead)
        bits = []
        for position, token in enumerate(tokens.tolist()):
            if position == warmup:
                _, before = manager.stats()
                ahead_before = manager.lookahead_stats()
                start = time.perf_counter()
            bits.append(np.asarray(loop.step(token, position)).view(np.uint32))
        seconds = (time.perf_counter() - start) / (tokens.size - warmup)
        _, after = manager.stats()
        ahead = {name: value.sum() - ahead_before[name].sum() for name, value in manager.lookahead_stats().items()
                 if name != "prefetch_unused"}
        manager.close()
    since, measured = after.since(before), tokens.size - warmup
    reference = bits if reference is None else reference
    exact = all(np.array_equal(a, b) for a, b in zip(bits, reference))
    return bits, {"residency": residency, "slots": slots, "policy": policy, "lookahead": lookahead, "exact": exact,
            "tokens_per_s": 1 / seconds, "ms_per_token": seconds * 1e3, "hit_rate": since.hit_rate,
            "critical_reads_per_token": ahead["critical_reads"] / measured,
            "critical_wait_ms_per_token": ahead["critical_wait_s"] * 1e3 / measured,
            "prefetches_per_token": ahead["prefetches"] / measured,
            "prefetch_used_per_token": ahead["prefetch_used"] / measured,
            "prefetch_late_per_token": ahead["prefetch_late"] / measured,
            "prefetch_wasted_per_token": ahead["prefetch_wasted"] / measured,
            "mib_read_per_token": since.bytes_read / measured / 2**20}


def measure(checkpoint: Path, residencies, policies, depths, *, tokens: int, warmup: int,
            queue_depth: int):
    """Yields the resident row, then each loop's row as it is measured."""
    from kq.study import StudyConfig
    from kq.study_jax import JaxStudy

    study = JaxStudy(StudyConfig(checkpoint=checkpoint, tokens=tokens, warmup=warmup))
    cfg = study.cfg
    text = study.tokens[:warmup + tokens]
    resident_bits, resident_seconds = _resident(study.full_params(), cfg, text)
    print(f"{checkpoint.name:12s} resident {1 / resident_seconds:8.1f} tok/s", flush=True)
    yield {"model": checkpoint.name, "mode": "resident", "tokens_per_s": 1 / resident_seconds, "x_resident": 1.0}
    grid = [(1.0, "lfu", 0)] + [(r, p, a) for r in residencies for p in policies for a in depths]
    reference = None
    for residency, policy, lookahead in grid:
        bits, row = _loop(study, cfg, text, reference, residency, policy, lookahead, warmup, queue_depth)
        if reference is None:  # the full arena: every later row must give its bits
            reference = bits
            row["max_abs_diff_vs_resident"] = float(max(np.abs(a.view(np.float32) - b.view(np.float32)).max()
                                                        for a, b in zip(bits, resident_bits)))
        row.update(model=checkpoint.name, mode="loop", x_resident=row["tokens_per_s"] * resident_seconds)
        print(f"{checkpoint.name:12s} loop {residency:4.0%} {policy} ahead={lookahead} exact={row['exact']} "
              f"{row['tokens_per_s']:7.1f} tok/s x{row['x_resident']:.2f} hit {row['hit_rate']:.3f} "
              f"critical {row['critical_reads_per_token']:.2f} ({row['critical_wait_ms_per_token']:.3f} ms) "
              f"prefetch {row['prefetches_per_token']:.2f} used {row['prefetch_used_per_token']:.2f} "
              f"late {row['prefetch_late_per_token']:.2f} "
              f"wasted {row['prefetch_wasted_per_token']:.2f}", flush=True)
        yield row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", type=Path, default=[Path("models/stdlib-moe"), Path("models/wheels-moe")])
    parser.add_argument("--residency", type=float, nargs="+", default=[0.75, 0.5, 0.25])
    parser.add_argument("--policies", nargs="+", default=["lfu", "lru"], choices=["lfu", "lru"])
    parser.add_argument("--lookahead", type=int, nargs="+", default=[0, 1, 2], choices=[0, 1, 2],
                        help="look-ahead depths (layers predicted ahead) to run")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--queue-depth", type=int, default=4)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    payload = {**run_header(), "tokens": args.tokens, "warmup": args.warmup, "queue_depth": args.queue_depth, "rows": []}
    for checkpoint in args.models:
        for row in measure(checkpoint, args.residency, args.policies, args.lookahead, tokens=args.tokens,
                           warmup=args.warmup, queue_depth=args.queue_depth):
            payload["rows"].append(row)  # written row by row: a run cut short keeps what it measured
            write_json(args.json, payload)
    return 0 if all(row.get("exact", True) for row in payload["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
