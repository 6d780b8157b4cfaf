"""A decode token through mlx-lm's models on arenas taken apart, on MLX's default device.

``graphs``: at full residency (every expert resident, the tables fixed), the token of each graph below,
dispatched as ``mlx_lm.generate`` dispatches (the next token before this one is read), nothing else read
back; each graph's model loaded once, the graphs interleaved within a round, ``rounds`` rounds, the median
round reported with its range, and the median of each round's ratio to the unmodified model's round:

* ``unmodified``: the model as mlx-lm ships it;
* ``arena``: :func:`kq_mlx.mlx_lm_adapter.attach_arena`'s layers on their resident path, as shipped;
* ``arena-uncompiled``: the same layers, their resident graph run op by op, not through ``mx.compile``;
* ``arena-unflushed``: the same layers combining with the router's scores as they are, not the flushed
  weights the general graph combines with (the tokens stay the model's unless a score is subnormal or
  NaN): what the flush costs;
* ``block-on-arena``: mlx-lm's own block with the arena in place of its switch layer (no report, no
  remap): what the arena's weights cost alone;
* ``block-on-arena-compiled``: that block through ``mx.compile`` (its arrays captured, as the arena's
  layers capture theirs): what compiling a block costs or saves on this backend.

``exact``: wheels-moe's loops, tokens per second and whether the tokens are the unmodified model's (fed the
prompt a token a pass, as the loops are), one after another on one model each:

* ``unmodified``: the model as mlx-lm ships it, dispatched as ``mlx_lm.generate`` dispatches (its tokens not
  compared: it takes the prompt in one pass);
* ``exact``: ``generate_greedy(exact=True)`` at ``--residency``, the misses read from host copies of every
  expert made once, as the page cache holds a checkpoint's (:func:`~kq.bench.jobs.mlx_decode.host_loader`),
  then the same loop under ``cProfile``: the host's time a token by function, the largest first;
* ``layer by layer, nothing read``: every expert resident and every layer under rule ``exact``
  (:func:`~kq_mlx.mlx_lm_adapter.attach_exact`, no look-ahead): each layer's routing waited for and
  acquired, nothing to read; the round trips alone, the fastest a loop that waits for every layer's routing
  can run on this backend.

    python -m kq.bench.jobs mlx_token_parts --json out/mlx_token_parts.json [--parts graphs exact]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

from kq.bench.common import run_header, write_json
from kq.bench.jobs.mlx_decode import (PROMPT, VARIANTS, Phases, arena_manager, fixed_tables_loop, host_loader,
                                      load_model, num_experts_of, tok_s_of, unmodified_fed,
                                      unmodified_loop)

GRAPHS = ("unmodified", "arena", "arena-uncompiled", "arena-unflushed", "block-on-arena", "block-on-arena-compiled")


def _compiled_block(block):
    """An mlx-lm block called through ``mx.compile``, its arrays captured (a module in the block's place)."""
    import mlx.core as mx
    import mlx.nn as nn

    class CompiledBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block
            object.__setattr__(self, "forward", mx.compile(lambda x: block(x), inputs=[block]))

        def __call__(self, x):
            return self.forward(x)

    return CompiledBlock()


def _graph(checkpoint, quantized: bool, graph: str, prompt: list[int]):
    """A graph's decode loop, ``loop(steps) -> (tokens, stamps)``, on a model loaded once for it."""
    from kq_mlx.mlx_lm_adapter import attach_arena

    model, _ = load_model(checkpoint, quantized)
    if graph == "unmodified":
        return lambda steps: unmodified_loop(model, prompt, steps, Phases())
    num_experts = num_experts_of(model)
    blocks = attach_arena(model, num_experts)
    manager = arena_manager(blocks, num_experts, host_loader(blocks))
    manager.close()  # every expert preloaded: the loop reads nothing, and only the tables are used
    if graph == "arena-uncompiled":
        for block in blocks:
            object.__setattr__(block, "_graph", lambda rule, captured, forward: forward)
    elif graph == "arena-unflushed":
        for block in blocks:
            object.__setattr__(block, "_mix_all_resident", lambda rule, scores: scores)
    elif graph.startswith("block-on-arena"):
        for block in blocks:  # the job's models are Qwen3-MoE: each block at model.layers[i].mlp
            block.block.switch_mlp = block.arena
            model.layers[block.model_layer].mlp = (_compiled_block(block.block) if graph.endswith("compiled")
                                                   else block.block)
    return lambda steps: fixed_tables_loop(model, blocks, manager, prompt, steps, Phases(), read_reports=False)


def graphs(rounds: int, tokens: int, warmup: int, variants, chosen=GRAPHS) -> list[dict]:
    """The ``chosen`` graphs (``unmodified`` always, first) on each of ``variants``: one row a graph."""
    chosen = ["unmodified"] + [graph for graph in GRAPHS[1:] if graph in chosen]
    rows = []
    for name, checkpoint, quantized in variants:
        prompt = load_model(checkpoint, quantized)[1].encode(PROMPT)
        loops = {graph: _graph(checkpoint, quantized, graph, prompt) for graph in chosen}
        runs = {graph: [] for graph in chosen}
        tokens_of = {graph: [] for graph in chosen}  # every round's
        for _ in range(rounds):
            for graph, loop in loops.items():
                got, stamps = loop(warmup + tokens)
                runs[graph].append(tok_s_of(stamps, tokens))
                tokens_of[graph].append(got)
        unmodified = sorted(runs["unmodified"])[rounds // 2]
        for graph, done in runs.items():
            # Each round's ratio to the unmodified model's round beside it, and their median: drift between
            # rounds (the GPU's clocks, the host's load) cancels where it is slower than a round.
            ratios = sorted(tok_s / base for tok_s, base in zip(done, runs["unmodified"]))
            done = sorted(done)
            rows.append(dict(model=name, quantized=quantized or name == "wheels-moe", graph=graph,
                             tok_s=done[rounds // 2], tok_s_range=[done[0], done[-1]],
                             x_unmodified=done[rounds // 2] / unmodified,
                             x_unmodified_paired=ratios[rounds // 2], x_unmodified_paired_range=[ratios[0], ratios[-1]],
                             same_tokens=all(got == tokens_of["unmodified"][0] for got in tokens_of[graph])))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _exact_loop(checkpoint, residency: float, prompt: list[int], steps: int, profile: cProfile.Profile | None):
    from kq_mlx.mlx_lm_adapter import attach_arena, generate_greedy

    model, _ = load_model(checkpoint, False)
    num_experts = num_experts_of(model)
    slots = max(1, int(round(residency * num_experts)))
    blocks = attach_arena(model, slots)
    manager = arena_manager(blocks, slots, host_loader(blocks))
    stamps = []
    try:
        if profile is not None:
            profile.enable()
        got = generate_greedy(model, blocks, manager, prompt, steps, exact=True, prefill_prompt=False,
                              on_token=lambda token: stamps.append(time.perf_counter()))
    finally:
        if profile is not None:
            profile.disable()
        manager.close()
    return got, stamps


def _layer_by_layer_loop(checkpoint, prompt: list[int], steps: int):
    """Every expert resident, every layer under rule ``exact``: each token a pass, fed as the exact loop feeds it."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kq_mlx.mlx_lm_adapter import attach_arena, attach_exact

    model, _ = load_model(checkpoint, False)
    num_experts = num_experts_of(model)
    blocks = attach_arena(model, num_experts)
    manager = arena_manager(blocks, num_experts, host_loader(blocks))
    attach_exact(model, blocks, manager, lookahead=False)
    cache, got, stamps = make_prompt_cache(model), [], []
    try:
        for token in prompt[:-1]:
            mx.eval(model(mx.array([[token]]), cache=cache))
            manager.next_token()
        x = mx.array([prompt[-1:]])
        for _ in range(steps):
            got.append(int(mx.argmax(model(x, cache=cache)[0, -1], axis=-1).item()))
            manager.next_token()
            stamps.append(time.perf_counter())
            x = mx.array([got[-1:]])
    finally:
        manager.close()
    return got, stamps


def exact(residency: float, tokens: int, warmup: int, top: int) -> list[dict]:
    """The ``exact`` part's rows (module docstring), one a loop."""
    name, checkpoint, _ = VARIANTS[2]
    model, tokenizer = load_model(checkpoint, False)
    prompt = tokenizer.encode(PROMPT)
    steps = warmup + tokens
    want = unmodified_fed(model, prompt, steps)  # the exact loop feeds the prompt a token a pass, as this does
    rows = []

    def row(loop: str, got, stamps, **extra):
        rows.append(dict(model=name, loop=loop, residency=extra.pop("residency", residency),
                         tok_s=tok_s_of(stamps, tokens), same_tokens=None if got is None else got == want, **extra))
        print(json.dumps(rows[-1]), flush=True)

    row("unmodified", None, unmodified_loop(model, prompt, steps, Phases())[1], residency=1.0)
    got, stamps = _exact_loop(checkpoint, residency, prompt, steps, None)
    profile = cProfile.Profile()
    _exact_loop(checkpoint, residency, prompt, steps, profile)
    # {(file, line, function): (primitive calls, calls, own time, cumulative time, callers)}
    largest = sorted(pstats.Stats(profile).stats.items(), key=lambda item: -item[1][2])[:top]
    row("exact", got, stamps,
        host_ms_per_token=[dict(function=f"{file.rpartition('/')[2]}:{line}:{function}", calls_per_token=calls / steps,
                                own=1e3 * own / steps, cumulative=1e3 * cumulative / steps)
                           for (file, line, function), (_, calls, own, cumulative, _) in largest])
    row("layer by layer, nothing read", *_layer_by_layer_loop(checkpoint, prompt, steps), residency=1.0)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=("graphs", "exact"), default=["graphs", "exact"])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the graphs, interleaved")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--variants", nargs="+", type=int, choices=range(len(VARIANTS)),
                        default=list(range(len(VARIANTS))), help="the graphs' models: indices into mlx_decode's")
    parser.add_argument("--graphs", nargs="+", choices=GRAPHS[1:], default=list(GRAPHS[1:]),
                        help="the graphs beside the unmodified model's")
    parser.add_argument("--residency", type=float, default=0.5, help="the exact loop's")
    parser.add_argument("--top", type=int, default=25, help="functions listed for the exact loop")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    for name in ("rounds", "tokens", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1")
    if not 0.0 < args.residency < 1.0:
        parser.error(f"--residency must be in (0, 1): the exact loop reads nothing at full residency, got "
                     f"{args.residency}")
    result = {**run_header("mlx"), "tokens": args.tokens, "warmup": args.warmup, "rounds": args.rounds}
    if "graphs" in args.parts:
        result["graphs"] = graphs(args.rounds, args.tokens, args.warmup, [VARIANTS[i] for i in args.variants],
                                  args.graphs)
    if "exact" in args.parts:
        result["exact"] = exact(args.residency, args.tokens, args.warmup, args.top)
    if args.json:
        write_json(args.json, result)
    return 0 if all(row["same_tokens"] is not False for row in result.get("graphs", []) + result.get("exact", [])) else 1

