"""``kq study``'s MLX runner: the checkpoint through mlx-lm, its MoE layers on arenas
(:mod:`kq_mlx.mlx_lm_adapter`), decoded window by window.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from kq.study import (
    JAX_ONLY_RULES,
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
from kq_host.checkpoint import CHECKPOINT_LAYOUTS, expert_nbytes, refusal_summary
from kq_mlx.tier import arena_tier


class MlxStudy:
    """The same runs through mlx-lm: the unmodified model, its MoE blocks wrapped by ``attach_arena``.

    Takes ``qwen3_moe`` and ``mixtral`` checkpoints (the ``substitute`` rule: Qwen3-MoE only).
    """

    def __init__(self, config: StudyConfig):
        from tokenizers import Tokenizer

        self.config = config
        checkpoint = Path(config.checkpoint)
        self.cfg_json = json.loads((checkpoint / "config.json").read_text())  # checked by StudyConfig
        model_type = self.cfg_json["model_type"]
        self.template, self.projections, experts_key = CHECKPOINT_LAYOUTS[model_type]
        self.num_experts = self.cfg_json[experts_key]
        unsupported = JAX_ONLY_RULES + (() if model_type == "qwen3_moe" else ("substitute",))
        self.rules = tuple(r for r in RULES if r not in unsupported)
        self._tier = None
        tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        self.tokens, self.scored_bytes = text_tokens(config, tokenizer)
        try:  # mlx-lm's loader checks every weight against the model config.json describes
            self._resident_model = self._model()
        except (ValueError, KeyError) as error:  # mlx-lm's sanitize raises KeyError for a missing expert
            raise ValueError(f"--checkpoint: {checkpoint}: mlx-lm refuses its weights for the model its config.json "
                             f"describes: {refusal_summary(error)}") from None

    def tier(self):
        """The checkpoint's tier under the arena's projection names (:func:`arena_tier`), once a study.

        Raises:
            kq_host.residency.PreloadError: a read of the experts failed (:func:`kq.study.building_the_tier`).
        """
        if self._tier is None:
            with building_the_tier():
                self._tier = arena_tier(self.config.checkpoint, bits=self.config.tier_bits,
                                        group_size=self.config.tier_group_size)
        return self._tier

    def _model(self):
        import mlx.core as mx
        from mlx_lm import load

        model, _ = load(str(self.config.checkpoint))
        if not mx.metal.is_available():
            model.set_dtype(mx.float32)  # MLX's CPU gather_mm takes float32 only
        return model

    def _logits(self, model, cache, token_id: int):
        import mlx.core as mx

        logits = model(mx.array([[token_id]]), cache=cache)[0, -1]
        mx.eval(logits)
        return np.array(logits.astype(mx.float32))

    def resident(self) -> RunResult:
        """Every expert in memory, no arena: the model as trained, over each window of the text."""
        return merged([self._resident_window(tokens) for tokens, _ in text_windows(self.tokens, self.config)],
                       self.config.tokens, self.scored_bytes)

    def _resident_window(self, tokens: np.ndarray) -> RunResult:
        from mlx_lm.models.cache import make_prompt_cache

        model = self._resident_model
        cache = make_prompt_cache(model)
        result = window_result(self.config, tokens.size, 1.0, self.num_experts, "-", "resident", self.scored_bytes)
        result.memory_bytes = self.cfg_json["num_hidden_layers"] * self.num_experts * expert_nbytes(
            self.config.checkpoint, self.projections, self.template)
        start = time.perf_counter()
        for position in range(tokens.size - 1):
            logits = self._logits(model, cache, int(tokens[position]))
            if position >= self.config.warmup:
                result.score(token_bits(logits[None], tokens[position + 1]))
        result.seconds = time.perf_counter() - start
        return result

    def run(self, residency: float, policy: str, rule: str, *, prompt=None, generate: int = 0) -> RunResult:
        """As :meth:`JaxStudy.run`, through mlx-lm: one model and arena, emptied for each window."""
        from mlx_lm.models.cache import make_prompt_cache

        from kq_host.checkpoint import Quantization, open_experts
        from kq_host.residency import LayerReport, ResidencyManager
        from kq_mlx.mlx_lm_adapter import PROJECTIONS, SwitchGLUArena, attach_arena, attach_tier, set_tables

        layers, experts = self.cfg_json["num_hidden_layers"], self.num_experts
        slots = max(self.cfg_json["num_experts_per_tok"], round(residency * experts))
        model = self._model()
        blocks = attach_arena(model, slots)
        for block in blocks:
            block.rule = rule
        tier_bytes = 0
        if rule == "tier":
            tier = self.tier()
            attach_tier(blocks, tier)
            tier_bytes = tier.nbytes
        quantized = Quantization.of(self.config.checkpoint) is not None
        with open_experts(self.config.checkpoint, self.projections, template=self.template,
                          dequantized=False) as store:
            def load(layer, expert, slot):  # the checkpoint's names to the arena's (gate, up, down)
                read = store.read_expert(layer, expert)
                if quantized:  # mlx-lm's stacked names, the arena's own
                    return read
                return {arena_name: read[name] for arena_name, name in zip(PROJECTIONS, self.projections)}

            def window(tokens: list[int], warmup: int, generate: int = 0) -> RunResult:
                cache = make_prompt_cache(model)
                result = window_result(self.config, len(tokens), residency, slots, policy, rule, self.scored_bytes,
                                        warmup)
                manager = ResidencyManager(layers, experts, slots, loader=load, arena=SwitchGLUArena(blocks),
                                           policy=policy, queue_depth=0, bytes_per_expert=store.expert_nbytes(0))
                result.memory_bytes = layers * slots * store.expert_nbytes(0) + tier_bytes

                def token(position, token_id, tables):
                    set_tables(blocks, tables)
                    logits = self._logits(model, cache, token_id)
                    return logits[None], LayerReport.stacked([block.report() for block in blocks])

                return decode_through_arena(tokens, warmup, result, manager, token, generate=generate)

            if prompt is not None:
                return window([int(t) for t in prompt], len(prompt) - 1, generate)
            return merged([window(tokens.tolist(), self.config.warmup) for tokens, _ in
                            text_windows(self.tokens, self.config)], self.config.tokens, self.scored_bytes)
