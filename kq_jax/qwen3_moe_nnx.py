"""Qwen3-MoE decoding on Flax NNX modules: :class:`Qwen3MoeDecoder`, its MoE layers a stack of
:class:`kq_jax.nnx.ArenaMoE`.

The attention, the norms and the embedding run as :func:`kq_jax.qwen3_moe.decode_step` runs them; each
layer's MoE is its layer of the stacked ``ArenaMoE``, whose step is :func:`kq_jax.arena_moe.moe_layer`,
the step :func:`kq_jax.qwen3_moe_arena.make_step`'s layers run: on the same arena, tables and tier, the
same operations on the same values as ``make_step(cfg, rule)`` under the decoder's ``rule``
(:mod:`kq_core.rules`). On CPU the logits and reports are that step's bit for bit,
with every expert resident the resident model's (``tests/test_qwen3_moe_nnx.py``). The two are not one
program: the decoder's routers are one ``[L, E, D]`` array sliced inside it, the functional step's one
array a layer, and where XLA tunes each program's kernels (a GPU) their products may round apart.

The stack holds its state ``[L, ...]``: the ``[L, E]`` tables of ``ResidencyManager.snapshot()`` /
``step`` and the ``[L, S, ...]`` arrays of a :class:`kq_jax.arena.JaxArena`, as they are.

Needs Flax (``pip install 'kq[nnx]'``), as :mod:`kq_jax.nnx` does.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from kq_core.validate import is_int
from kq_host.tier import DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE
from kq_jax import qwen3_moe
from kq_jax.moe import TierExperts
from kq_jax.nnx import ArenaMoE, resolve_rule  # first: its ImportError says how to install Flax

from flax import nnx  # noqa: E402  (isort: after kq_jax.nnx)

_MOE_ARRAYS = ("router", *qwen3_moe.PROJECTIONS)  # a checkpoint layer's arrays the MoE stack holds


def _concrete(value) -> np.ndarray | None:
    """``value`` as a NumPy array, or None where it is traced (its values unknown until it runs)."""
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


class Qwen3MoeDecoder(nnx.Module):
    """Qwen3-MoE decoding one token per sequence, its MoE layers a stack of :class:`kq_jax.nnx.ArenaMoE`.

    Args:
        params: :func:`kq_jax.qwen3_moe.load_params`' (``experts=False`` is enough: the arena serves the
            experts): ``{"embed": [V, D], "norm": [D], "layers": [{name: array}] * L}``; each layer's
            attention and norm arrays become :class:`flax.nnx.Param`\\ s, its routers the stack's
            ``router.kernel_ED`` ``[L, E, D]``; its experts, if any, are not read.
        cfg: the checkpoint's :class:`kq_jax.qwen3_moe.Qwen3MoeConfig`.
        num_slots: S, each layer's arena slots.
        rule, on_miss, tier_bits, tier_group_size, impl, fetch: as for :class:`kq_jax.nnx.ArenaMoE` (``rule``
            None: :data:`kq_core.rules.DEFAULT_RULE`; ``rule="exact"``: exact in one pass, a layer's misses read
            inside the step by ``fetch``; the logits are the resident model's; ``on_miss`` deprecated).

    The arena starts empty (every table entry -1); :meth:`set_residency` points it at the host's tables
    and arena, :meth:`set_tier` loads the tier (rules ``"tier"`` and ``"uniform"``).

    Raises:
        ValueError: ``cfg`` is no ``Qwen3MoeConfig``, ``params`` lacks an array or holds ``cfg``'s layers,
            router or embedding in another shape, or an option the MoE layers cannot take, naming it.
    """

    def __init__(self, params: Mapping, cfg: qwen3_moe.Qwen3MoeConfig, num_slots: int, *, rule: str | None = None,
                 on_miss: str | None = None, tier_bits: int = DEFAULT_TIER_BITS,
                 tier_group_size: int = DEFAULT_TIER_GROUP_SIZE, impl: str = "auto", fetch=None):
        rule = resolve_rule(rule, on_miss, "Qwen3MoeDecoder")
        if not isinstance(cfg, qwen3_moe.Qwen3MoeConfig):
            raise ValueError(f"Qwen3MoeDecoder: cfg must be a kq_jax.qwen3_moe.Qwen3MoeConfig, got "
                             f"{type(cfg).__name__}")
        if not is_int(num_slots) or num_slots < 1:
            raise ValueError(f"Qwen3MoeDecoder: num_slots must be an int >= 1, got {num_slots!r}")
        layers = _checked_layers(params, cfg)
        routers = jnp.stack([jnp.asarray(layer["router"]) for layer in layers])  # [L, E, D]

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return ArenaMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, num_slots,
                            cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob, rule=rule,
                            tier_bits=tier_bits, tier_group_size=tier_group_size, dtype=routers.dtype, impl=impl,
                            fetch=fetch, rngs=rngs)

        self.cfg = cfg
        self.moe = create(nnx.Rngs(0))
        self.moe.router.kernel_ED.set_value(routers)
        self.embed = nnx.Param(jnp.asarray(params["embed"]))
        self.norm = nnx.Param(jnp.asarray(params["norm"]))
        self.layers = nnx.List([nnx.Dict({name: nnx.Param(jnp.asarray(array)) for name, array in layer.items()
                                          if name not in _MOE_ARRAYS}) for layer in layers])

    def set_residency(self, tables, arena: Mapping[str, jax.Array] | None = None) -> None:
        """Points the MoE layers at the host's residency between steps: ``tables`` int ``[L, E]``
        (``ResidencyManager.snapshot()`` / ``step``'s), ``arena`` ``{projection: [L, S, ...]}``
        (``JaxArena.arrays``), held as they are. As :meth:`kq_jax.nnx.ArenaMoE.set_residency`."""
        self.moe.set_residency(tables, arena)

    def set_tier(self, tier: TierExperts) -> None:
        """Loads the tier (rules ``"tier"`` and ``"uniform"``), every array ``[L, E, ...]``: e.g.
        ``kq_jax.moe.tier_experts(kq_jax.qwen3_moe_arena.tier_arrays(tier), bits=..., group_size=...)`` of a
        :class:`kq_host.tier.Tier`. As :meth:`kq_jax.nnx.ArenaMoE.set_tier`."""
        self.moe.set_tier(tier)

    def __call__(self, tokens, position, cache):
        """One token per sequence, as :func:`kq_jax.qwen3_moe.decode_step`.

        Args:
            tokens: int ``[B]``; position: int scalar; cache: :func:`kq_jax.qwen3_moe.empty_cache`'s
                ``(keys, values)``, each float32 ``[L, B, length, Hkv, hd]``.

        Returns:
            ``(logits float32 [B, V], cache, reports int32 [5, L, B, k])``: the reports in
            :func:`kq_jax.arena.pack_reports`' layout, what ``LayerReport.from_packed`` reads.

        Raises:
            ValueError: ``tokens`` is no integer ``[B]`` (B >= 1), ``position`` no integer scalar, or
                ``cache`` no pair of floating-point ``[L, B, length, Hkv, hd]`` arrays of one length, naming it
                (at trace time under ``nnx.jit``); and where they are concrete (not traced), a token outside the
                vocabulary or a position outside ``[0, length)``. Traced values are taken as they are: a token outside
                the vocabulary reads a clamped row, a position outside the cache writes nowhere.
        """
        cfg = self.cfg
        if (jnp.ndim(tokens) != 1 or jnp.shape(tokens)[0] == 0
                or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer)):
            raise ValueError(f"Qwen3MoeDecoder: tokens must be integer [B], B >= 1, one token a sequence, got "
                             f"{jnp.result_type(tokens)} {list(jnp.shape(tokens))}")
        if jnp.ndim(position) != 0 or not jnp.issubdtype(jnp.result_type(position), jnp.integer):
            raise ValueError(f"Qwen3MoeDecoder: position must be an integer scalar, got "
                             f"{jnp.result_type(position)} {list(jnp.shape(position))}")
        layout = (cfg.num_hidden_layers, jnp.shape(tokens)[0], cfg.num_key_value_heads, cfg.head_dim)
        if (not isinstance(cache, (tuple, list)) or len(cache) != 2
                or any(jnp.ndim(part) != 5 or tuple(jnp.shape(part)[:2]) + tuple(jnp.shape(part)[3:]) != layout
                       for part in cache)):
            shapes = [list(jnp.shape(part)) for part in cache] if isinstance(cache, (tuple, list)) else type(cache)
            raise ValueError(f"Qwen3MoeDecoder: cache must be (keys, values), each [{layout[0]}, {layout[1]}, "
                             f"length, {layout[2]}, {layout[3]}] (kq_jax.qwen3_moe.empty_cache), got {shapes}")
        if not all(jnp.issubdtype(jnp.result_type(part), jnp.floating) for part in cache):
            raise ValueError(f"Qwen3MoeDecoder: cache must be floating point (kq_jax.qwen3_moe.empty_cache's "
                             f"float32), got {[str(jnp.result_type(part)) for part in cache]}")
        length = jnp.shape(cache[0])[2]
        if jnp.shape(cache[1])[2] != length:
            raise ValueError(f"Qwen3MoeDecoder: cache's keys and values must have one length, got keys "
                             f"{list(jnp.shape(cache[0]))} and values {list(jnp.shape(cache[1]))}")
        for name, value, bound in (("tokens", tokens, cfg.vocab_size), ("position", position, length)):
            concrete = _concrete(value)
            if concrete is not None and concrete.size and (concrete.min() < 0 or concrete.max() >= bound):
                raise ValueError(f"Qwen3MoeDecoder: {name} must lie in [0, {bound}), got {concrete.tolist()}")
        graphdef, state = nnx.split(self.moe)

        def moe(layer, _, x):  # the stack's layer `layer`, its variables sliced inside the traced step
            return nnx.merge(graphdef, jax.tree.map(lambda array: array[layer], state))(x, layer)

        params = {"embed": self.embed[...], "norm": self.norm[...],
                  "layers": [{name: variable[...] for name, variable in layer.items()} for layer in self.layers]}
        logits, cache, reports = qwen3_moe.decode_step(params, tokens, position, cache, cfg, moe)
        return logits, cache, jnp.stack(reports, axis=1)


def _checked_layers(params, cfg) -> list:
    """``params["layers"]`` once each holds a router of ``cfg``'s shape and the embedding is ``[V, D]``."""
    if not isinstance(params, Mapping) or not {"embed", "norm", "layers"} <= set(params):
        given = sorted(params) if isinstance(params, Mapping) else type(params).__name__
        raise ValueError(f"Qwen3MoeDecoder: params must hold 'embed', 'norm' and 'layers' "
                         f"(kq_jax.qwen3_moe.load_params'), got {given}")
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)) or len(layers) != cfg.num_hidden_layers:
        raise ValueError(f"Qwen3MoeDecoder: params['layers'] must be a list of cfg.num_hidden_layers = "
                         f"{cfg.num_hidden_layers} layers, got {type(layers).__name__} of "
                         f"{len(layers) if isinstance(layers, (list, tuple)) else '?'}")
    wanted = {"embed": (cfg.vocab_size, cfg.hidden_size), "norm": (cfg.hidden_size,)}
    for name, shape in wanted.items():
        if tuple(getattr(params[name], "shape", ())) != shape:
            raise ValueError(f"Qwen3MoeDecoder: params[{name!r}] must be {list(shape)}, got "
                             f"{list(getattr(params[name], 'shape', ()))}")
    for index, layer in enumerate(layers):
        router = layer.get("router") if isinstance(layer, Mapping) else None
        if tuple(getattr(router, "shape", ())) != (cfg.num_experts, cfg.hidden_size):
            raise ValueError(f"Qwen3MoeDecoder: params['layers'][{index}]['router'] must be "
                             f"[{cfg.num_experts}, {cfg.hidden_size}], got "
                             f"{list(getattr(router, 'shape', ())) if router is not None else 'none'}")
    return list(layers)
