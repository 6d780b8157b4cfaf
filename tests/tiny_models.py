"""Tiny random checkpoints the tests write: families kq reads beside its own Qwen3-MoE."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from kq.study import SHIPPED_MODEL

MIXTRAL_ARGS = dict(model_type="mixtral", vocab_size=4096, hidden_size=32, intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2)


def write_mixtral(directory: Path, *, seed: int, files=("tokenizer.json", "tokenizer_config.json")) -> Path:
    """A tiny random float Mixtral (mlx-lm's model, :data:`MIXTRAL_ARGS`) in the Hugging Face layout: one
    tensor per expert (w1 gate, w2 down, w3 up), the shipped model's ``files`` (its tokenizer) beside it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import mixtral
    from safetensors.numpy import save_file

    mx.random.seed(seed)
    model = mixtral.Model(mixtral.ModelArgs(**MIXTRAL_ARGS))
    tensors = {}
    for name, value in tree_flatten(model.parameters()):
        value = np.array(value)
        if ".switch_mlp." in name:  # stacked [E, ...] in mlx-lm, one tensor per expert on the Hub
            prefix, projection = name.split(".switch_mlp.")
            hf = {"gate_proj.weight": "w1", "down_proj.weight": "w2", "up_proj.weight": "w3"}[projection]
            for expert in range(value.shape[0]):
                tensors[f"{prefix}.experts.{expert}.{hf}.weight"] = np.ascontiguousarray(value[expert])
        else:
            tensors[name] = value
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(MIXTRAL_ARGS))
    for name in files:
        shutil.copy(SHIPPED_MODEL / name, directory / name)
    return directory


def tier_of(blocks, expert_weights, *, experts: int, bits: int, group_size: int = 32):
    """A :class:`kq_host.tier.Tier` of every expert of every block: ``expert_weights(block, e)`` gives
    expert e's float weights by projection."""
    from kq_host.tier import Tier, quantize_experts

    weights = quantize_experts(lambda layer, e: expert_weights(blocks[layer], e), ("gate_proj", "up_proj", "down_proj"),
                               len(blocks), experts, bits=bits, group_size=group_size)
    return Tier(weights, bits, group_size)


WEIGHTS = "model.safetensors"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def with_header(source: Path, directory: Path, edit) -> Path:
    """A copy of the model directory ``source`` in ``directory``, its weights' header changed by ``edit(header)``
    (the data bytes as they were)."""
    import struct

    shutil.copytree(source, directory)
    raw = (source / WEIGHTS).read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    edit(header)
    encoded = json.dumps(header).encode()
    (directory / WEIGHTS).write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + size:])
    return directory


def write_per_expert_checkpoint(path: Path, rng, *, layers=2, experts=4, hidden=64, ffn=32) -> Path:
    """A float32 checkpoint directory of one tensor per expert and projection (the Hugging Face layout), random
    weights drawn from ``rng``; returns the directory."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight":
               rng.normal(size=shape).astype(np.float32)
               for layer in range(layers) for expert in range(experts)
               for projection, shape in zip(PROJECTIONS, ((ffn, hidden), (ffn, hidden), (hidden, ffn)))},
              str(path / WEIGHTS))
    return path
