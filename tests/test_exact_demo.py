"""``kq demo --rule exact``'s counts: one token clock per token, the same counts in JAX and MLX."""

import dataclasses

import pytest

from kq.study import SHIPPED_MODEL

PROMPT_IDS = [478, 852, 63, 2217, 8, 585, 310, 199]  # "def read_config(path):\n"


def test_both_frameworks_count_the_same_hits_and_prefetches_with_inline_reads():
    """With reads inline no prefetch is late, so what is counted depends on the routing alone; both frameworks
    route the same text through the same arena, token by token."""
    pytest.importorskip("jax")
    pytest.importorskip("mlx_lm")
    from kq.demo import generate_exact

    runs = {framework: generate_exact(framework, SHIPPED_MODEL, PROMPT_IDS, 6, 0.25, queue_depth=0)
            for framework in ("jax", "mlx")}
    counts = {framework: {name: value for name, value in dataclasses.asdict(run).items()
                          if name not in ("token_seconds", "memory_mib", "slots")} for framework, run in runs.items()}
    assert counts["jax"]["lookups"] == 6 * 4 * 8 and counts["jax"]["prefetches"] > 0
    assert counts["jax"] == counts["mlx"]
    for run in runs.values():
        assert run.prefetch_late == 0 and run.hit_rate == run.hit_rate_counting_late
        assert run.prefetches + run.unused_before == (run.prefetch_used + run.prefetch_late + run.prefetch_wasted
                                                      + run.unused_after)
