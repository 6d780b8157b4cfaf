"""Look-ahead prefetch for an exact layer-by-layer loop, replayed on a trained checkpoint's routing.

Records the checkpoint's routing and its routers' look-ahead predictions over the held-out text
(:func:`kq.study_jax.record_routing` with ``lookahead``), then replays an exact loop through per-layer arenas at 75 / 50 / 25%
residency, LRU and LFU, without look-ahead and with predictions one and two layers ahead
(:func:`kq.replay.simulate`; its docstring states the timing assumption). Prints the recall of the
predictions and a Markdown table; ``--json`` keeps every number.

    python -m kq.bench.jobs lookahead --tokens 1024 --json docs/lookahead.json
    python -m kq.bench.jobs lookahead --tokens 1024 --checkpoint models/wheels-moe --json docs/lookahead_wheels.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from kq.bench.common import run_header, write_json

RESIDENCIES = (0.75, 0.5, 0.25)


def run(tokens: int, warmup: int, checkpoint=None, budgets=(None, 4)) -> dict:
    from kq.replay import replay_grid
    from kq.study import StudyConfig

    config = StudyConfig(tokens=tokens, warmup=warmup, **({"checkpoint": Path(checkpoint)} if checkpoint else {}))
    return {**run_header(None), **replay_grid(config, RESIDENCIES, budgets=budgets)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--checkpoint", help="the checkpoint directory (default: the shipped model)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from kq.replay import format_replay

    result = run(args.tokens, args.warmup, args.checkpoint)
    print("recall [layer, layers ahead]:", np.round(np.array(result["recall"]), 3).tolist())
    print(format_replay(result))
    if args.json:
        write_json(args.json, result)
    return 0
