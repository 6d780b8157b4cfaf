"""Look-ahead prefetch for an exact layer-by-layer loop, measured on a trained checkpoint by simulation.

An exact loop serves every routed expert: a miss is read on the token's critical path. After layer l
has run, the routers of layers l+1 .. l+n applied to its output predict what those layers will route
(:func:`kq_jax.qwen3_moe.decode_step` with ``lookahead``); reading the predicted experts that are not
resident then, while the rest of layer l and layer l+1's attention run, turns some of the next layers'
misses into hits.

:func:`kq.study_jax.record_routing` (with ``lookahead``) runs the checkpoint over its held-out text (every
expert resident, teacher-forced, in windows no longer than the sequences it was trained on) and keeps
each token's routing and predictions; the replay runs them as one sequence, its arenas kept across windows. :func:`simulate` replays them through one arena per layer
of ``slots`` experts. Per token, layer by layer:

1. the layer's routed experts that are not resident are critical-path reads; they are placed at once,
   evicting by ``policy`` among the experts this token's layer did not route;
2. the layer's routed experts are credited: LRU's clock, LFU's count (a prefetched expert starts at
   count 0, so a prediction that is never used does not count as a use);
3. with look-ahead, each prediction for layers l+1 .. l+n not yet resident is read (at most
   ``budget`` per layer and token, best score first), evicting by ``policy`` among the experts not
   predicted for that layer this token.

The timing assumption: a prefetch issued after layer l lands before layer l+1 routes. A prefetched
expert evicted, or left at the end, before any use is wasted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

POLICIES = ("lru", "lfu")


@dataclass
class Replay:
    slots: int
    policy: str
    lookahead: int
    budget: int | None
    tokens: int
    lookups: int = 0
    hits: int = 0
    critical_reads: int = 0
    prefetches: int = 0
    wasted_prefetches: int = 0
    useful_prefetches: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0

    def summary(self) -> dict:
        out = asdict(self)
        per_token = max(self.tokens, 1)
        out.update(hit_rate=self.hit_rate, critical_reads_per_token=self.critical_reads / per_token,
                   prefetches_per_token=self.prefetches / per_token,
                   wasted_per_useful=self.wasted_prefetches / self.useful_prefetches if self.useful_prefetches
                   else (0.0 if not self.wasted_prefetches else float("inf")))
        return out


class _Arena:
    """One layer's arena of ``slots`` experts under LRU or LFU; counts the prefetches evicted unused."""

    def __init__(self, slots: int, policy: str):
        self.slots, self.policy = slots, policy
        self.clock: dict[int, int] = {}  # expert -> last use (or placement)
        self.count: dict[int, int] = {}  # expert -> uses
        self.unused_prefetch: set[int] = set()
        self.wasted = 0

    def place(self, expert: int, now: int, protected: set[int], *, prefetched: bool) -> bool:
        """Places ``expert``, evicting by policy outside ``protected`` if full; False (nothing placed) where
        every resident expert is protected."""
        if len(self.clock) >= self.slots:
            candidates = [e for e in self.clock if e not in protected]
            if not candidates:
                return False
            if self.policy == "lru":
                victim = min(candidates, key=lambda e: (self.clock[e], e))
            else:
                victim = min(candidates, key=lambda e: (self.count[e], self.clock[e], e))
            if victim in self.unused_prefetch:
                self.unused_prefetch.discard(victim)
                self.wasted += 1
            del self.clock[victim], self.count[victim]
        self.clock[expert], self.count[expert] = now, 0
        if prefetched:
            self.unused_prefetch.add(expert)
        return True

    def use(self, expert: int, now: int) -> bool:
        """Credits a routed expert; returns whether it was a prefetch not used before."""
        self.clock[expert] = now
        self.count[expert] += 1
        first_use = expert in self.unused_prefetch
        self.unused_prefetch.discard(expert)
        return first_use


def simulate(indices: np.ndarray, predictions: np.ndarray | None, *, slots: int, policy: str = "lru",
             lookahead: int = 0, budget: int | None = None, warmup: int = 0) -> Replay:
    """Replays ``indices`` ``[T, L, K]`` (with ``predictions`` ``[T, L, n, K]`` for ``lookahead`` > 0)
    through per-layer arenas of ``slots`` experts (module docstring). Counts from token ``warmup`` on."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    tokens, layers, top_k = indices.shape
    if not 1 <= slots or slots < top_k:
        raise ValueError(f"slots must be at least top-k = {top_k}, got {slots}")
    if lookahead and (predictions is None or predictions.shape[2] < lookahead):
        raise ValueError(f"lookahead={lookahead} needs predictions of at least that depth")
    arenas = [_Arena(slots, policy) for _ in range(layers)]
    replay = Replay(slots, policy, lookahead, budget, max(tokens - warmup, 0))
    now, wasted_before = 0, 0
    for token in range(tokens):
        counting = token >= warmup
        if token == warmup:
            wasted_before = sum(arena.wasted for arena in arenas)
        predicted_for: list[set[int]] = [set() for _ in range(layers)]
        for layer in range(layers):
            now += 1
            arena, routed = arenas[layer], [int(e) for e in indices[token, layer]]
            routed_set = set(routed)
            for expert in routed:
                if expert in arena.clock:
                    if counting:
                        replay.hits += 1
                else:
                    arena.place(expert, now, routed_set, prefetched=False)
                    if counting:
                        replay.critical_reads += 1
                if counting:
                    replay.lookups += 1
                if arena.use(expert, now) and counting:
                    replay.useful_prefetches += 1
            for ahead in range(1, lookahead + 1):
                target = layer + ahead
                if target >= layers:
                    break
                read = 0
                for expert in (int(e) for e in predictions[token, layer, ahead - 1]):
                    if budget is not None and read >= budget:
                        break
                    if expert < 0:
                        continue
                    if expert in arenas[target].clock:
                        predicted_for[target].add(expert)  # kept for it: not a victim of the next prefetch
                        continue
                    if arenas[target].place(expert, now, predicted_for[target], prefetched=True):
                        predicted_for[target].add(expert)
                        read += 1
                        if counting:
                            replay.prefetches += 1
    if tokens > warmup:  # evicted unused since the warm-up, and still unused at the end
        replay.wasted_prefetches = sum(arena.wasted + len(arena.unused_prefetch) for arena in arenas) - wasted_before
    return replay


def recall(indices: np.ndarray, predictions: np.ndarray) -> np.ndarray:
    """``[L, n]``: the share of layer l+d's routed experts that the prediction made after layer l named
    (NaN past the last layer)."""
    tokens, layers, top_k = indices.shape
    depth = predictions.shape[2]
    out = np.full((layers, depth), np.nan)
    for layer in range(layers):
        for ahead in range(1, depth + 1):
            target = layer + ahead
            if target < layers:
                named = [len(set(predictions[t, layer, ahead - 1]) & set(indices[t, target])) for t in range(tokens)]
                out[layer, ahead - 1] = float(np.mean(named)) / top_k
    return out


def replay_grid(config, residencies, policies=POLICIES, depths=(0, 1, 2), budgets=(None,)) -> dict:
    """The checkpoint's routing and its routers' predictions over its text (:func:`kq.study_jax.record_routing`,
    ``config`` a :class:`kq.study.StudyConfig`), replayed (:func:`simulate`) at each residency, policy,
    look-ahead depth and per-layer read budget (budgets apply to depths above 0). Returns the recall of the
    predictions ``[L, n]`` and one row of :meth:`Replay.summary` per replay, with its residency."""
    from kq.study_jax import record_routing

    indices, _, predictions = record_routing(config, lookahead=max(max(depths), 1))
    experts, top_k = _experts(config), indices.shape[-1]
    rows = []
    for residency in residencies:
        slots = max(top_k, round(residency * experts))
        for policy in policies:
            for depth in depths:
                for budget in (budgets if depth else (None,)):
                    replay = simulate(indices, predictions, slots=slots, policy=policy, lookahead=depth,
                                      budget=budget, warmup=config.warmup)
                    rows.append(dict(replay.summary(), residency=residency))
    return {"checkpoint": str(config.checkpoint), "tokens": config.tokens, "warmup": config.warmup,
            "recall": recall(indices[config.warmup:], predictions[config.warmup:]).tolist(), "rows": rows}


def _experts(config) -> int:
    from kq.study import checkpoint_config

    return int(checkpoint_config(config.checkpoint)["num_experts"])


def format_replay(result: dict) -> str:
    """:func:`replay_grid`'s rows as a Markdown table, critical reads also against no look-ahead."""
    base = {(r["residency"], r["policy"]): r for r in result["rows"] if r["lookahead"] == 0}
    lines = ["| residency | policy | look-ahead | budget | hit rate | critical reads/token | vs none | "
             "prefetches/token | wasted per useful |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        none = base.get((r["residency"], r["policy"]))
        ratio = (f"{r['critical_reads_per_token'] / none['critical_reads_per_token']:.2f}"
                 if none and none["critical_reads_per_token"] else "-")
        lines.append(f"| {r['residency']:.0%} | {r['policy']} | {r['lookahead']} | "
                     f"{'-' if r['budget'] is None else r['budget']} | {r['hit_rate']:.3f} | "
                     f"{r['critical_reads_per_token']:.2f} | {ratio} | "
                     f"{r['prefetches_per_token']:.2f} | {r['wasted_per_useful']:.2f} |")
    return "\n".join(lines)
