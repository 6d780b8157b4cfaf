"""Greedy decode through mlx-lm: the unmodified model beside the same model on arenas, tokens per second.

The shipped checkpoint (``models/stdlib-moe``) as it is and quantized by mlx-lm's ``nn.quantize``
(4-bit, group 32), on MLX's default device (the GPU where there is one). For each: the unmodified
model, then the arena at 100% residency (every expert preloaded: the adapter's own cost) and at
25% (experts streamed from the checkpoint's files through the residency manager between tokens).
Steady state: ``warmup`` tokens first, then ``tokens`` timed; the prompt cache is kept, so each step
is one token. The tokens of the unmodified model and of the 100% arena are compared.

    python -m benchmarks mlx_decode --json out/mlx_decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "models" / "stdlib-moe"


def _decode(model, prompt: list[int], steps: int, between=None) -> tuple[list[int], list[float]]:
    """Greedy tokens and the wall time of each step (one token each after the prompt)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache, tokens, times, x = make_prompt_cache(model), list(prompt), [], mx.array([prompt])
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(x, cache=cache)[0, -1]
        token = int(mx.argmax(logits).item())
        if between is not None:
            between()
        times.append(time.perf_counter() - start)
        tokens.append(token)
        x = mx.array([[token]])
    return tokens, times


def _load(quantized: bool):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    model, tokenizer = load(str(CHECKPOINT))
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)  # MLX's CPU gather_mm takes float32
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model, tokenizer


def run(tokens: int = 64, warmup: int = 16, residencies=(1.0, 0.25)) -> dict:
    import mlx.core as mx
    import numpy as np

    from kq_host.residency import ResidencyManager
    from kq_mlx.mlx_lm_adapter import SwitchGLUArena, attach_arena, set_tables

    steps = warmup + tokens
    results = []
    for quantized in (False, True):
        model, tokenizer = _load(quantized)
        prompt = tokenizer.encode("def read_config(path):\n")
        want, times = _decode(model, prompt, steps)
        entry = dict(quantized=quantized, unmodified_tok_s=tokens / sum(times[warmup:]))
        for residency in residencies:
            model, _ = _load(quantized)
            num_experts = model.layers[0].mlp.switch_mlp.gate_proj.weight.shape[0]
            slots = max(1, int(round(residency * num_experts)))
            blocks = attach_arena(model, slots)
            # The in-memory experts are the 'disk' here (the wrapped blocks keep them): the arena's cost,
            # not the SSD's.
            manager = ResidencyManager(len(blocks), num_experts, slots, arena=SwitchGLUArena(blocks),
                                       loader=lambda layer, expert, slot: blocks[layer].expert_weights(expert))
            for layer in range(len(blocks)):
                manager.preload(layer, range(slots) if slots == num_experts else [])
            set_tables(blocks, manager.snapshot())
            got, times = _decode(model, prompt, steps, between=lambda: set_tables(
                blocks, manager.step([b.report() for b in blocks])))
            manager.close()
            _, total = manager.stats()
            entry[f"arena_{int(residency * 100)}_tok_s"] = tokens / sum(times[warmup:])
            entry[f"arena_{int(residency * 100)}_hit_rate"] = total.hit_rate
            if slots == num_experts:
                entry["arena_100_same_tokens"] = got == want
        results.append(entry)
        print(json.dumps(entry), flush=True)
    return {"device": str(mx.default_device()), "mlx": mx.__version__, "python": platform.python_version(),
            "numpy": np.__version__, "date": time.strftime("%Y-%m-%d"), "tokens": tokens, "warmup": warmup,
            "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = run(args.tokens, args.warmup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r.get("arena_100_same_tokens", True) for r in result["results"]) else 1
