"""Greedy generation through the exact layer-by-layer loop, in JAX or through mlx-lm (``kq demo --rule exact``).

Each layer's misses are read before its experts run (:meth:`kq_host.residency.ResidencyManager.acquire`)
and, with look-ahead, the next layer's predicted experts are prefetched: the text is the model's with
every expert in memory, at any residency (:mod:`kq_jax.exact_loop`, :func:`kq_mlx.mlx_lm_adapter.attach_exact`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class ExactRun:
    """What one generation through the exact loop did, counted over the generated tokens' steps.

    Every prefetch is in one category: ``prefetches + unused_before == prefetch_used + prefetch_late +
    prefetch_wasted + unused_after`` (``unused_before``: prefetches of the prompt's steps not routed yet
    when the generated tokens began).
    """

    slots: int
    tokens: list[int]
    generated: int = 0
    lookups: int = 0  # routed experts, over the layers
    hits: int = 0  # of those, resident when their layer's acquire ran
    critical_reads: int = 0  # routed experts read (or waited for) on the critical path
    prefetches: int = 0  # reads started by look-ahead
    prefetch_used: int = 0  # landed before their layer routed them: hits
    prefetch_late: int = 0  # still loading when their layer routed them: misses, waited for
    prefetch_wasted: int = 0  # evicted or failed before any use
    unused_before: int = 0
    unused_after: int = 0  # held, never routed yet when the run ended
    bytes_read: int = 0
    memory_mib: float = 0.0
    token_seconds: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Routed experts resident when their layer routed them; a late prefetch is a miss, so this depends
        on how fast the reads land against the framework's compute between a prefetch and its layer."""
        return self.hits / self.lookups if self.lookups else 1.0

    @property
    def hit_rate_counting_late(self) -> float:
        """:attr:`hit_rate` with the late prefetches counted as hits: what the predictions alone cover."""
        return (self.hits + self.prefetch_late) / self.lookups if self.lookups else 1.0

    @property
    def critical_reads_per_token(self) -> float:
        return self.critical_reads / self.generated if self.generated else 0.0

    @property
    def mib_per_token(self) -> float:
        return self.bytes_read / self.generated / 2**20 if self.generated else 0.0


def generate_exact(framework: str, checkpoint, prompt_ids: list[int], tokens: int, residency: float,
                   policy: str = "lfu", *, lookahead: bool = True, queue_depth: int = 8) -> ExactRun:
    """``tokens`` greedy tokens after ``prompt_ids`` through an arena of ``residency`` of each layer's experts.

    Args:
        framework: ``"jax"`` (:class:`kq_jax.exact_loop.ExactLoop`) or ``"mlx"`` (mlx-lm with
            :func:`kq_mlx.mlx_lm_adapter.attach_exact`); the prompt is fed one token at a time.
        checkpoint: a Qwen3-MoE checkpoint directory (float or mlx-community's quantized layout).
        queue_depth: the residency manager's reads in flight; 0 reads inline (nothing is late then, so
            the counts depend on the routing alone: the same in both frameworks).

    Returns:
        :class:`ExactRun`, ``tokens`` the prompt and the generated ids.
    """
    from kq import study
    from kq_host.quantized import Quantization, open_experts
    from kq_host.residency import ResidencyManager

    if framework not in ("jax", "mlx"):
        raise ValueError(f"generate_exact: framework must be 'jax' or 'mlx', got {framework!r}")
    if not prompt_ids:
        raise ValueError("generate_exact: the prompt has no tokens")
    config = study.checkpoint_config(checkpoint, framework)
    layers, experts, top_k = config["num_hidden_layers"], config["num_experts"], config["num_experts_per_tok"]
    slots = max(top_k, round(residency * experts))
    quantized = Quantization.of(checkpoint) is not None
    # JAX's arena holds float experts; MLX's arena takes a quantized checkpoint's arrays as stored.
    with open_experts(checkpoint, ("gate_proj", "up_proj", "down_proj"), dequantized=framework == "jax") as store:
        arena, step = (_jax_loop if framework == "jax" else _mlx_loop)(checkpoint, slots, len(prompt_ids) + tokens,
                                                                     store, quantized)
        manager = ResidencyManager(layers, experts, slots, arena=arena, policy=policy, queue_depth=queue_depth,
                                   loader=lambda layer, expert, slot: store.read_expert(layer, expert),
                                   bytes_per_expert=store.expert_nbytes(0))
        for layer in range(layers):
            manager.preload(layer, range(slots))
        run = ExactRun(slots, list(prompt_ids), memory_mib=layers * slots * store.expert_nbytes(0) / 2**20)
        forward = step(manager, lookahead)
        for position in range(len(prompt_ids) + tokens - 1):
            if position == len(prompt_ids) - 1:
                _, before = manager.stats()
                ahead_before = manager.lookahead_stats()
            start = time.perf_counter()
            next_id = forward(run.tokens[position], position)  # ends the manager's token too
            if position >= len(prompt_ids) - 1:
                run.tokens.append(next_id)
                run.token_seconds.append(time.perf_counter() - start)
        _, after = manager.stats()
        ahead_after = manager.lookahead_stats()
        manager.close()
    since = after.since(before)
    ahead = {name: int(ahead_after[name].sum() - ahead_before[name].sum())
             for name in ("critical_reads", "prefetches", "prefetch_used", "prefetch_late", "prefetch_wasted")}
    run.generated, run.lookups, run.hits, run.bytes_read = tokens, since.lookups, since.hits, since.bytes_read
    run.critical_reads, run.prefetches = ahead["critical_reads"], ahead["prefetches"]
    run.prefetch_used, run.prefetch_late, run.prefetch_wasted = (ahead["prefetch_used"], ahead["prefetch_late"],
                                                                 ahead["prefetch_wasted"])
    run.unused_before = int(ahead_before["prefetch_unused"].sum())
    run.unused_after = int(ahead_after["prefetch_unused"].sum())
    return run


def _jax_loop(checkpoint, slots: int, length: int, store, quantized: bool):
    import jax.numpy as jnp

    from kq_jax import qwen3_moe
    from kq_jax.arena import JaxArena
    from kq_jax.exact_loop import ExactLoop

    cfg = qwen3_moe.Qwen3MoeConfig.load(checkpoint)
    params = qwen3_moe.load_params(checkpoint, cfg, experts=False)
    shapes = {name: (shape, np.float32) for name, (shape, _) in store.expert_shapes(0).items()}
    arena = JaxArena(cfg.num_hidden_layers, slots, shapes)

    def step(manager, lookahead):
        loop = ExactLoop(params, cfg, manager, arena, length=length, lookahead=lookahead)
        return lambda token, position: int(jnp.argmax(loop.step(token, position)[0]))

    return arena, step


def _mlx_loop(checkpoint, slots: int, length: int, store, quantized: bool):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kq_mlx.mlx_lm_adapter import SwitchGLUArena, attach_arena, attach_exact

    model, _ = load(str(Path(checkpoint)), lazy=True)
    blocks = attach_arena(model, slots, keep_experts=False)
    if not mx.metal.is_available() and not quantized:
        model.set_dtype(mx.float32)  # MLX's CPU gather_mm takes float32 only
    cache = make_prompt_cache(model)

    def step(manager, lookahead):
        attach_exact(model, blocks, manager, lookahead=lookahead)

        def forward(token, position):
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
            next_id = int(mx.argmax(logits).item())
            manager.next_token()  # ExactLoop.step ends the token itself; attach_exact leaves it to the caller
            return next_id

        return forward

    return SwitchGLUArena(blocks), step
