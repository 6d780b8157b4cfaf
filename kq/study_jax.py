"""``kq study``'s JAX runner: the checkpoint in :mod:`kq_jax.qwen3_moe`, decoded through an arena by
:mod:`kq_jax.qwen3_moe_arena`'s steps, one window or many streams side by side; and the checkpoint's
routing recorded over its text (:func:`record_routing`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np

from kq.study import (
    RULES,
    RunResult,
    StudyConfig,
    building_the_tier,
    decode_through_arena,
    merged,
    text_tokens,
    text_windows,
    token_bits,
    window_result,
)
from kq_host.checkpoint import expert_nbytes, trained_length


class JaxStudy:
    """The checkpoint in JAX (:mod:`kq_jax.qwen3_moe`), the text's tokens and one compiled step per rule."""

    def __init__(self, config: StudyConfig):
        from tokenizers import Tokenizer

        from kq_jax import qwen3_moe

        self.config = config
        checkpoint = Path(config.checkpoint)
        self.cfg = qwen3_moe.Qwen3MoeConfig.load(checkpoint)
        self.rules = RULES
        tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        self.tokens, self.scored_bytes = text_tokens(config, tokenizer)
        self.params = qwen3_moe.load_params(checkpoint, self.cfg, experts=False)
        self._full_params = None
        self._steps = {}
        self._tier = None

    def full_params(self):
        from kq_jax import qwen3_moe

        if self._full_params is None:
            self._full_params = qwen3_moe.load_params(self.config.checkpoint, self.cfg)
        return self._full_params

    def step(self, rule: str):
        """The compiled decode step under ``rule`` (:func:`kq_jax.qwen3_moe_arena.make_step`), made once."""
        from kq_jax.qwen3_moe_arena import make_step

        if rule not in self._steps:
            self._steps[rule] = make_step(self.cfg, rule, (self.config.tier_bits, self.config.tier_group_size))
        return self._steps[rule]

    def tier(self, store):
        """The checkpoint's tier (``config.tier_bits``, ``config.tier_group_size``): built once, cached on disk.

        Raises:
            kq_host.residency.PreloadError: a read of the experts failed (:func:`kq.study.building_the_tier`).
        """
        from kq_host.tier import build_tier
        from kq_jax.qwen3_moe_arena import tier_arrays

        if self._tier is None:
            with building_the_tier():
                tier = build_tier(store, self.cfg.num_hidden_layers, self.cfg.num_experts,
                                  bits=self.config.tier_bits, group_size=self.config.tier_group_size)
            self._tier = tier, tier_arrays(tier)
        return self._tier

    def resident(self) -> RunResult:
        """Every expert in memory, no arena: the model as trained."""
        if self.config.streams > 1:
            return self._streams(1.0, "-", "resident")
        return merged([self._resident_window(tokens) for tokens, _ in text_windows(self.tokens, self.config)],
                       self.config.tokens, self.scored_bytes)

    def _resident_window(self, tokens: np.ndarray) -> RunResult:
        """:meth:`resident` over one window's ``tokens`` (:func:`window_plan`)."""
        import jax.numpy as jnp

        from kq_jax import qwen3_moe

        cfg, params = self.cfg, self.full_params()
        tables = jnp.tile(jnp.arange(cfg.num_experts, dtype=jnp.int32), (cfg.num_hidden_layers, 1))
        cache = qwen3_moe.empty_cache(cfg, 1, tokens.size)
        result = window_result(self.config, tokens.size, 1.0, cfg.num_experts, "-", "resident", self.scored_bytes)
        result.memory_bytes = cfg.num_hidden_layers * cfg.num_experts * expert_nbytes(self.config.checkpoint)
        step = self.step("stall")
        start = time.perf_counter()
        for position in range(tokens.size - 1):
            logits, cache, _ = step(params, None, tables, jnp.asarray(tokens[position:position + 1]), position, cache)
            if position >= self.config.warmup:
                result.score(token_bits(logits, tokens[position + 1]))
        result.seconds = time.perf_counter() - start
        return result

    def run(self, residency: float, policy: str, rule: str, *, prompt=None, generate: int = 0) -> RunResult:
        """One decode of the text's windows (:func:`window_plan`), or, with ``prompt``, greedy generation of
        ``generate`` tokens after it, through an arena of ``residency`` of each layer's experts, afresh
        for each window; the tokens are in ``result.trace``."""
        config = self.config
        if config.streams > 1:
            if prompt is not None:
                raise ValueError("generation runs one stream; give a StudyConfig with streams=1")
            return self._streams(residency, policy, rule)
        if prompt is not None:
            return self._run_window(residency, policy, rule, [int(t) for t in prompt], len(prompt) - 1, generate)
        return merged([self._run_window(residency, policy, rule, tokens.tolist(), config.warmup)
                        for tokens, _ in text_windows(self.tokens, config)], config.tokens, self.scored_bytes)

    def _run_window(self, residency: float, policy: str, rule: str, tokens: list[int], warmup: int,
                    generate: int = 0) -> RunResult:
        """:meth:`run` over one window's ``tokens``, the first ``warmup`` unscored."""
        import jax.numpy as jnp

        from kq_host.checkpoint import open_experts
        from kq_host.residency import LayerReport, ResidencyManager
        from kq_jax import qwen3_moe
        from kq_jax.arena import JaxArena

        cfg, config = self.cfg, self.config
        layers, experts, top_k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
        uniform = rule == "uniform"
        slots = 0 if uniform else max(top_k, round(residency * experts))
        params = self.full_params() if rule == "stall" else self.params
        result = window_result(config, len(tokens), residency, slots, policy, rule, self.scored_bytes, warmup)
        with open_experts(config.checkpoint, qwen3_moe.PROJECTIONS) as store:
            shapes = {name: (shape, np.float32) for name, (shape, _) in store.expert_shapes(0).items()}
            arena = JaxArena(layers, max(slots, 1), shapes)  # uniform: one slot, never filled
            manager = _Unbacked(layers, experts) if uniform else ResidencyManager(
                layers, experts, slots, loader=lambda l, e, s: store.read_expert(l, e), arena=arena, policy=policy,
                queue_depth=0, bytes_per_expert=store.expert_nbytes(0))
            result.memory_bytes = layers * slots * store.expert_nbytes(0)
            tier = None
            if rule in ("tier", "uniform"):
                built, tier = self.tier(store)
                result.memory_bytes += built.nbytes
            state = {"cache": qwen3_moe.empty_cache(cfg, 1, len(tokens) + generate)}
            step = self.step("tier" if uniform else rule)

            def token(position, token_id, tables):
                logits, state["cache"], packed = step(params, arena.arrays, jnp.asarray(tables),
                                                      jnp.asarray([token_id], jnp.int32), position, state["cache"],
                                                      tier)
                return logits, LayerReport.from_packed(np.asarray(packed))

            return decode_through_arena(tokens, warmup, result, manager, token, generate=generate)

    def _streams(self, residency: float, policy: str, rule: str) -> RunResult:
        """:meth:`run` (or, for rule ``"resident"``, :meth:`resident`) over ``config.streams`` windows side
        by side, each with its own residency manager's state (:func:`make_streams_step`); where
        :func:`window_plan` cuts each stream's text into several windows, the streams decode them round
        by round, each round afresh (key-value cache and arenas)."""
        from kq_host.checkpoint import open_experts
        from kq_jax import qwen3_moe

        cfg, config = self.cfg, self.config
        streams = self.tokens.shape[0]
        layers, experts, top_k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
        resident, uniform = rule == "resident", rule == "uniform"
        slots = experts if resident else 0 if uniform else max(top_k, round(residency * experts))
        rounds = text_windows(self.tokens, config)
        result = RunResult(residency, slots, policy, rule, config.tokens * streams, 0.0, self.scored_bytes,
                           window=config.tokens, windows=len(rounds),
                           context=max(windows.shape[1] for windows, _ in rounds) - 1,
                           trained_length=trained_length(config.checkpoint))
        tier = None
        with open_experts(config.checkpoint, qwen3_moe.PROJECTIONS) as store:
            nbytes = store.expert_nbytes(0)
            if rule in ("tier", "uniform"):
                built, tier = self.tier(store)
                result.memory_bytes += built.nbytes
        result.memory_bytes += layers * slots * nbytes
        # One program per rule: a virtual arena's slot ids only label experts, so every residency's
        # tables (slots below S <= E) run in the step of E slots, the tier's ids E + e.
        key = ("streams", "stall" if resident else rule)
        if key not in self._steps:
            from kq_jax.qwen3_moe_arena import make_streams_step

            self._steps[key] = make_streams_step(cfg, key[1], experts, (config.tier_bits, config.tier_group_size))
        start = time.perf_counter()
        bits, counts, layer_counts = [], np.zeros(4, np.int64), np.zeros((2, layers), np.int64)
        for windows, _ in rounds:
            round_bits, round_counts, round_layer_counts = self._streams_round(windows, slots, policy, rule, nbytes,
                                                                               tier, result)
            bits.append(round_bits)
            counts += round_counts
            layer_counts += round_layer_counts
        result.hits, result.lookups, result.reads, result.bytes_read = (int(c) for c in counts)
        if layer_counts[1].any():
            result.layer_hit_rates = list(layer_counts[0] / np.maximum(layer_counts[1], 1))
        result.seconds = time.perf_counter() - start
        for value in np.concatenate(bits, axis=1).reshape(-1):  # stream by stream, each in text order
            result.score(float(value))
        return result

    def _streams_round(self, windows: np.ndarray, slots: int, policy: str, rule: str, nbytes: int, tier,
                       result: RunResult):
        """One round of :meth:`_streams`: ``windows`` ``[B, length]`` decoded side by side from position 0.
        Adds the shed and routed mass and critical reads to ``result``; returns the scored tokens' bits
        ``[B, length - 1 - warmup]``, ``(hits, lookups, reads, bytes read)`` and each layer's
        ``(hits, lookups)`` ``[2, L]``, counted from the warm-up on."""
        import jax
        import jax.numpy as jnp

        from kq_host.residency import LayerReport, ResidencyManager
        from kq_jax import qwen3_moe

        cfg, config = self.cfg, self.config
        streams, length = windows.shape
        layers, experts, top_k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
        resident = rule == "resident"
        managed = layers * streams  # manager layer l * streams + b: layer l of stream b
        manager = _Unbacked(managed, experts) if rule == "uniform" else ResidencyManager(
            managed, experts, slots, loader=lambda l, e, s: None, arena=None,
            policy="lfu" if resident else policy, queue_depth=0, bytes_per_expert=nbytes)
        step, params = self._steps[("streams", "stall" if resident else rule)], self.full_params()
        for layer in range(managed):
            manager.preload(layer, range(manager.num_slots))
        tables = manager.snapshot()
        cache = qwen3_moe.empty_cache(cfg, streams, length)
        bits = np.zeros((streams, length - 1 - config.warmup))
        for position in range(length - 1):
            if position == config.warmup:
                layers_before, before = manager.stats()
            logits, cache, packed = step(params, jnp.asarray(tables.reshape(layers, streams, experts)),
                                         jnp.asarray(windows[:, position]), position, cache, tier)
            logits, packed = jax.device_get((logits, packed))
            report = LayerReport.from_packed(packed)  # [L, B, k] each
            if position >= config.warmup:  # bits from the logits in float64 here: the same in every rule's program
                bits[:, position - config.warmup] = _stream_bits(logits, windows[:, position + 1])
                indices, scores, served = report.indices, report.scores, report.served
                result.routed_mass += float(scores.sum())
                result.shed_mass += float(scores.sum() - served.sum())
                if rule == "stall":
                    resident_now = tables.reshape(layers, streams, experts) >= 0
                    result.critical_reads += int((~np.take_along_axis(resident_now, indices.astype(np.int64),
                                                                      axis=-1)).sum())
            tables = manager.step(LayerReport(*(getattr(report, name).reshape(managed, 1, top_k)
                                                for name in ("indices", "scores", "miss_ids", "miss_scores"))))
        layers_after, after = manager.stats()
        manager.close()
        since = after.since(before)
        layer_counts = np.zeros((2, layers), np.int64)
        if layers_after:
            per = len(layers_after) // layers
            for index, (start, end) in enumerate(zip(layers_before, layers_after)):
                layer_counts[:, index // per] += (end.hits - start.hits, end.lookups - start.lookups)
        return bits, np.array([since.hits, since.lookups, since.reads_landed, since.bytes_read]), layer_counts


def _stream_bits(logits, targets) -> np.ndarray:
    """Each stream's bits for its next token: logits ``[B, V]``, targets ``[B]``."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(axis=-1)
    total = top + np.log(np.exp(logits - top[:, None]).sum(axis=-1))
    return (total - logits[np.arange(logits.shape[0]), targets]) / math.log(2)


class _Unbacked:
    """The ``uniform`` baseline's stand-in for a residency manager: no expert is ever resident, so every
    routed expert is a miss (served from the tier), and nothing is read."""

    num_slots = 0

    def __init__(self, layers: int, experts: int):
        from kq_host.residency import LayerStats

        self.num_layers, self._tables, self._total = layers, np.full((layers, experts), -1, np.int32), LayerStats()

    def preload(self, layer, experts):
        pass

    def snapshot(self) -> np.ndarray:
        return self._tables

    def step(self, reports) -> np.ndarray:
        from kq_host.residency import LayerReport

        reports = [reports] if isinstance(reports, LayerReport) else reports  # one report of every layer
        lookups = sum(int(np.size(report.indices)) for report in reports)
        self._total.lookups += lookups
        self._total.misses += lookups
        return self._tables

    def stats(self):
        return [], dataclasses.replace(self._total)

    def raise_failures(self, caller: str) -> None:
        pass  # it reads nothing

    def close(self):
        pass


def record_routing(config: StudyConfig, lookahead: int = 0):
    """The checkpoint's routing over its text, every expert resident: what an arena serving it is asked.

    Teacher-forced over the text's first ``config.warmup + config.tokens`` tokens (JAX), window by window
    (:func:`window_plan`: each window decoded from position 0, so no token is routed past the length the
    checkpoint was trained on unless ``config.long_context``); a window after the first gives the routing
    of its tokens after its warm-up, which the window before did not reach.

    Args:
        lookahead: also keep what the routers of the next ``lookahead`` layers predict from each layer's
            output (:func:`kq_jax.qwen3_moe.decode_step`).

    Returns:
        ``(indices int32 [T, L, K], scores float32 [T, L, K])``, token by token, each layer's top-k; with
        ``lookahead`` a third, ``int32 [T, L, lookahead, K]``: the experts predicted for layer l + d after
        layer l ran (-1 past the last layer; best first).
    """
    import jax
    import jax.numpy as jnp

    from kq_jax import qwen3_moe
    from kq_jax.qwen3_moe_arena import resident_moe

    study = JaxStudy(config)
    cfg, params = study.cfg, study.full_params()
    moe = resident_moe(cfg)
    step = jax.jit(lambda params, token, position, cache: qwen3_moe.decode_step(
        params, token, position, cache, cfg, moe, lookahead=lookahead))
    indices, scores, predictions = [], [], []
    for number, (tokens, _) in enumerate(text_windows(study.tokens, config)):
        cache = qwen3_moe.empty_cache(cfg, 1, tokens.size)
        for position in range(tokens.size - 1):
            _, cache, reports, *ahead = step(params, jnp.asarray(tokens[position:position + 1]), position, cache)
            if number and position < config.warmup:  # the window before routed these tokens
                continue
            indices.append(np.stack([np.asarray(r[0])[0] for r in reports]))
            scores.append(np.stack([np.asarray(r[1])[0] for r in reports]))
            if lookahead:
                predictions.append(np.asarray(ahead[0][0])[:, :, 0])
    out = np.stack(indices).astype(np.int32), np.stack(scores).astype(np.float32)
    return out + (np.stack(predictions).astype(np.int32),) if lookahead else out
