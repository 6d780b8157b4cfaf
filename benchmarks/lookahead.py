"""Look-ahead prefetch for an exact layer-by-layer loop, replayed on a trained checkpoint's routing.

Records the checkpoint's routing and its routers' look-ahead predictions over the held-out text
(:func:`kq.study.record_routing` with ``lookahead``), then replays an exact loop through per-layer arenas at 75 / 50 / 25%
residency, LRU and LFU, without look-ahead and with predictions one and two layers ahead
(:func:`kq.lookahead.simulate`; its docstring states the timing assumption). Prints the recall of the
predictions and a Markdown table; ``--json`` keeps every number.

    python -m benchmarks lookahead --tokens 1024 --json docs/lookahead.json
    python -m benchmarks lookahead --tokens 1024 --checkpoint models/wheels-moe --json docs/lookahead_wheels.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

RESIDENCIES = (0.75, 0.5, 0.25)


def run(tokens: int, warmup: int, checkpoint=None, budgets=(None, 4)) -> dict:
    from kq.lookahead import POLICIES, recall, simulate
    from kq.study import StudyConfig, record_routing

    config = StudyConfig(tokens=tokens, warmup=warmup, **({"checkpoint": Path(checkpoint)} if checkpoint else {}))
    indices, _, predictions = record_routing(config, lookahead=2)
    experts = int(indices.max()) + 1
    rows = []
    for residency in RESIDENCIES:
        slots = round(residency * 64) if experts <= 64 else round(residency * experts)
        for policy in POLICIES:
            for depth in (0, 1, 2):
                for budget in (budgets if depth else (None,)):
                    replay = simulate(indices, predictions, slots=slots, policy=policy, lookahead=depth,
                                      budget=budget, warmup=warmup)
                    rows.append(dict(replay.summary(), residency=residency))
    return {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "checkpoint": str(config.checkpoint),
            "tokens": tokens, "warmup": warmup,
            "recall": recall(indices[warmup:], predictions[warmup:]).tolist(), "rows": rows}


def markdown(result: dict) -> str:
    base = {(r["residency"], r["policy"]): r for r in result["rows"] if r["lookahead"] == 0}
    lines = ["| residency | policy | look-ahead | budget | hit rate | critical reads/token | vs none | "
             "prefetches/token | wasted per useful |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        none = base[r["residency"], r["policy"]]["critical_reads_per_token"]
        lines.append(f"| {r['residency']:.0%} | {r['policy']} | {r['lookahead']} | "
                     f"{'-' if r['budget'] is None else r['budget']} | {r['hit_rate']:.3f} | "
                     f"{r['critical_reads_per_token']:.2f} | {r['critical_reads_per_token'] / none:.2f} | "
                     f"{r['prefetches_per_token']:.2f} | {r['wasted_per_useful']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--checkpoint", help="the checkpoint directory (default: the shipped model)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = run(args.tokens, args.warmup, args.checkpoint)
    print("recall [layer, layers ahead]:", np.round(np.array(result["recall"]), 3).tolist())
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
