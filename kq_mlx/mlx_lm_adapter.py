"""Runs an mlx-lm MoE model's expert blocks on a bounded arena, fed by ``route_shed``.

Each MoE block (Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``, Mixtral's
``MixtralSparseMoeBlock``) is wrapped by :class:`ArenaMoeBlock`: it routes
exactly as the block does, calls :func:`kq_mlx.route_shed` against the layer's
slot table, and runs an mlx-lm ``SwitchGLU`` with S experts (the arena) on
``slots``, combining by ``mix``. mlx-lm's gather kernels are used unchanged;
only the expert index and the weights they see differ.

With every expert resident the wrapped model produces the original model's
bits: an all-kept row's ``mix`` equals its scores exactly.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import kq_mlx
from kq_host.residency import LayerReport

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _route_qwen3_moe(block, x):
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    k = block.top_k
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if block.norm_topk_prob:
        scores /= mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def _route_mixtral(block, x):
    gates = block.gate(x)
    k = block.num_experts_per_tok
    inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
    scores = mx.softmax(mx.take_along_axis(gates, inds, axis=-1), axis=-1, precise=True)
    return inds, scores


ROUTERS: dict[str, Callable] = {
    "Qwen3MoeSparseMoeBlock": _route_qwen3_moe,
    "MixtralSparseMoeBlock": _route_mixtral,
}


class ArenaMoeBlock(nn.Module):
    """An mlx-lm MoE block whose experts live in an arena of ``num_slots`` slots.

    Attributes:
        slot_table: ``mx.array int32 [E]`` for the next forward pass (set by the engine).
        last: ``(inds, scores, RouteShed)`` of the last forward pass, for the host.
    """

    def __init__(self, block: nn.Module, num_slots: int):
        super().__init__()
        name = type(block).__name__
        if name not in ROUTERS:
            raise TypeError(f"ArenaMoeBlock: no router for {name}; supported: {sorted(ROUTERS)}")
        self._route = ROUTERS[name]
        self.block = block
        source = block.switch_mlp
        self.num_experts = source.gate_proj.weight.shape[0]
        hidden, dims = source.gate_proj.weight.shape[1], source.gate_proj.weight.shape[2]
        self.arena = type(source)(dims, hidden, num_slots)  # an mlx-lm SwitchGLU with S experts
        for projection in PROJECTIONS:
            weight = getattr(source, projection).weight
            getattr(self.arena, projection).weight = mx.zeros((num_slots, *weight.shape[1:]), weight.dtype)
        self.slot_table = mx.full((self.num_experts,), -1, mx.int32)
        self.last = None

    def expert_weights(self, expert: int) -> dict[str, np.ndarray]:
        """One expert's weights from the wrapped block (the in-memory 'disk' for tests)."""
        source = self.block.switch_mlp
        return {p: np.array(getattr(source, p).weight[expert].astype(mx.float32)) for p in PROJECTIONS}

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self._route(self.block, x)
        shed = kq_mlx.route_shed(inds.astype(mx.uint32), scores, self.slot_table)
        y = self.arena(x, shed.slots)
        self.last = (inds, scores, shed)
        return (y * shed.mix.astype(scores.dtype)[..., None]).sum(axis=-2).astype(y.dtype)

    def report(self) -> LayerReport:
        """The last pass's routing and misses as host arrays (call after evaluating the step)."""
        inds, scores, shed = self.last
        k = inds.shape[-1]
        return LayerReport(*(np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)
                             .reshape(-1, k) for a in (inds, scores, shed.miss_ids, shed.miss_scores)))


class SwitchGLUArena:
    """The residency manager's arena adapter for a list of :class:`ArenaMoeBlock` (one per layer)."""

    def __init__(self, blocks: list[ArenaMoeBlock]):
        self.blocks = blocks

    def write_slot(self, layer: int, slot: int, payload: dict[str, np.ndarray]) -> None:
        arena = self.blocks[layer].arena
        for projection in PROJECTIONS:
            weight = getattr(arena, projection).weight
            weight[slot] = mx.array(np.asarray(payload[projection], np.float32)).astype(weight.dtype)
        mx.eval(*(getattr(arena, p).weight for p in PROJECTIONS))


def attach_arena(model: nn.Module, num_slots: int) -> list[ArenaMoeBlock]:
    """Wraps every supported MoE block of an mlx-lm model; returns the wrappers, one per MoE layer."""
    blocks = []
    for layer in model.layers:
        # Qwen3-MoE names the block `mlp`, Mixtral `block_sparse_moe`.
        for name, child in layer.children().items():
            if type(child).__name__ in ROUTERS:
                wrapper = ArenaMoeBlock(child, num_slots)
                setattr(layer, name, wrapper)
                blocks.append(wrapper)
    if not blocks:
        raise TypeError("attach_arena: the model has no supported MoE block")
    return blocks


def set_tables(blocks: list[ArenaMoeBlock], tables: np.ndarray) -> None:
    """Hands each block its layer's slot table for the next forward pass."""
    for block, table in zip(blocks, tables):
        block.slot_table = mx.array(np.asarray(table, np.int32))
