"""Whether a subset of a pass's expert entries, run through mlx-lm's ``SwitchGLU`` on their own, gives the
whole pass's bits for those entries: the question a prompt run in chunks (more routed experts than the
arena holds) asks of the backend.

``python -m kq.bench.jobs chunk_bits --json out.json``: a random ``SwitchGLU`` (float32, bfloat16, and 4-bit
quantized), a pass of ``T`` tokens x ``K`` entries, its experts split in groups; each group's entries run
alone as they come (``alone``: mlx-lm sorts only a call of 64 entries or more), repeated to 64 entries so
the call takes the sorted path as the whole pass did (``repeated``), and through the sorted path directly
(``sorted``). Reports, per variant, how many entries' outputs differ in bits from the whole pass's, whichever
path the whole pass took (it sorts from 64 entries on: the defaults' 80 do; the adapter repeats a chunk only
then).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from kq.bench.common import run_header, write_json


def _variants(glu, x, ids, chunk_experts: int):
    import mlx.core as mx
    from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

    def alone(rows, slots):
        return glu(rows, slots[:, None])[:, 0]

    def repeated(rows, slots):
        copies = -(-64 // slots.shape[0])
        return glu(rows, mx.repeat(slots[:, None], copies, axis=1))[:, 0]

    def sorted_path(rows, slots):
        inds = slots[:, None]
        xs, idx, inv = _gather_sort(mx.expand_dims(rows, (-2, -3)), inds)
        up = glu.up_proj(xs, idx, sorted_indices=True)
        gate = glu.gate_proj(xs, idx, sorted_indices=True)
        y = glu.down_proj(glu.activation(up, gate), idx, sorted_indices=True)
        return _scatter_unsort(y, inv, inds.shape).squeeze(-2)[:, 0]

    whole = glu(x, ids)  # [T, K, D]
    mx.eval(whole)
    want = np.array(whole.astype(mx.float32)).reshape(-1, whole.shape[-1]).view(np.uint32)
    flat = np.array(ids).reshape(-1)
    k = ids.shape[-1]
    result = {}
    for name, run in (("alone", alone), ("repeated", repeated), ("sorted", sorted_path)):
        got = np.empty_like(want)
        for first in range(0, int(flat.max()) + 1, chunk_experts):
            entries = np.flatnonzero((flat >= first) & (flat < first + chunk_experts))
            if entries.size == 0:
                continue
            out = run(x[mx.array(entries // k)], mx.array(flat[entries].astype(np.uint32)))
            got[entries] = np.array(out.astype(mx.float32)).view(np.uint32)
        result[name] = int((got != want).any(axis=-1).sum())
    return result


def run(tokens: int, top_k: int, experts: int, chunk_experts: int, seed: int) -> list[dict]:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    rows = []
    for dtype in ("float32", "bfloat16", "4-bit"):
        mx.random.seed(seed)
        glu = SwitchGLU(64, 32, experts)
        if dtype == "bfloat16":
            glu.set_dtype(mx.bfloat16)
        if dtype == "4-bit":
            nn.quantize(glu, group_size=32, bits=4)
        mx.eval(glu.parameters())
        rng = np.random.default_rng(seed)
        ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.uint32)
        x = mx.array(rng.standard_normal((tokens, 64)).astype(np.float32))
        if dtype == "bfloat16":
            x = x.astype(mx.bfloat16)
        try:
            differing = _variants(glu, x, mx.array(ids), chunk_experts)
        except RuntimeError as error:  # MLX's CPU gather_mm takes float32 only
            differing = f"not run: {error}"
        rows.append({"dtype": dtype, "tokens": tokens, "top_k": top_k, "experts": experts,
                     "chunk_experts": chunk_experts, "entries": tokens * top_k,
                     "entries_differing": differing})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--chunk-experts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    for name in ("tokens", "top_k", "experts", "chunk_experts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.top_k > args.experts:
        parser.error(f"--top-k ({args.top_k}) must not exceed --experts ({args.experts})")
    rows = run(args.tokens, args.top_k, args.experts, args.chunk_experts, args.seed)
    if args.json:
        write_json(args.json, {**run_header("mlx"), "rows": rows})


if __name__ == "__main__":
    main()
