"""Flax NNX MoE modules whose experts live in a bounded arena, with an optional low-precision tier.

:class:`ArenaMoE` is the MoE feed-forward of :mod:`kq_jax.moe` as an ``nnx.Module``: ``__call__(inputs)``
routes with its :class:`Router`, looks the routed experts up in the module's slot table, computes the hits
with the arena's weights and treats the misses by its ``rule`` (:mod:`kq_core.rules`: ``"shed"``, the
default, drops them; ``"tier"`` runs them from the tier's copy; ``"exact"`` reads them; ...), and returns
the output beside the routing reports the host reads back. The step is the library's one MoE step,
:func:`kq_jax.arena_moe.moe_layer`, the one :func:`kq_jax.qwen3_moe_arena.make_step`'s layers run: the
module holds the state, the library computes.
:class:`kq_jax.qwen3_moe_nnx.Qwen3MoeDecoder` is Qwen3-MoE on a stack of these modules.

That state is NNX variables of three kinds of their own, so filters tell them apart from the trainable
:class:`flax.nnx.Param` router: :class:`ArenaSlots` (the arena's weights, ``[S, ...]`` a projection),
:class:`SlotTable` (int32 ``[E]``, -1 = not resident) and :class:`TierCopy` (the tier's packed words, scales
and biases). The host updates them between steps with :meth:`ArenaMoE.set_residency`: the slot tables the
residency manager returns and the arrays of the :class:`kq_jax.arena.JaxArena` it writes. A stack of layers
built with ``nnx.vmap`` holds them ``[L, ...]``, the layout of ``JaxArena.arrays`` and
``ResidencyManager.snapshot()``, so the stack takes them as they are, without a copy.

:class:`DenseMoE` is the same layer with every expert held as a parameter; :meth:`ArenaMoE.from_dense` with
every expert resident gives its output bit for bit.

Weights keep the checkpoint layout kq uses everywhere (``[out, in]``: the router's ``[E, D]``, each
expert's ``[F, D]`` and ``[D, F]``); each name ends with its axes: D the hidden size, F the expert's
intermediate size, E the experts, S the arena's slots.

Needs Flax (``pip install 'kq[nnx]'``); the rest of :mod:`kq_jax` does not import it.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import warnings

import jax
import jax.numpy as jnp
import numpy as np

try:
    from flax import nnx
except ImportError as error:  # the one module of kq_jax that needs Flax
    raise ImportError("kq_jax.nnx needs Flax: pip install 'kq[nnx]'") from error

from kq_core.contract import EXPERT_PROJECTIONS
from kq_core.rules import DEFAULT_RULE, RULE, RULES, check_rule
from kq_core.validate import is_int
from kq_host.tier import BITS, DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE, GROUP_SIZES, quantize, scale_dtype
from kq_jax.api import IMPLS
from kq_jax.arena import pack_reports
from kq_jax.arena_moe import moe_layer, router_topk
from kq_jax.moe import Experts, TierExperts, TierWeights, check_tier, combine, experts_apply, router_probs

# The arena's projections, named as the expert store's tensors, ``JaxArena.arrays`` and the tier's layers.
_TIER_PARTS = ("packed", "scales", "biases")
# The rules an arena module runs: every rule of kq_core.rules but stall, which computes every expert from its
# full weights (DenseMoE is that layer).
MODULE_RULES = tuple(rule for rule in RULES if not RULE[rule].needs_experts)
# on_miss, deprecated: its values and the rule each is. Its "shed" rescaled the kept weights (route_shed).
ON_MISS = ("shed", "tier", "fetch")
ON_MISS_RULES = {"shed": "route_shed", "tier": "tier", "fetch": "exact"}


def resolve_rule(rule, on_miss, where: str) -> str:
    """The rule a module runs, from its ``rule`` or its deprecated ``on_miss`` (at most one given).

    Args:
        rule: a rule of :data:`MODULE_RULES`, or None (:data:`kq_core.rules.DEFAULT_RULE` where ``on_miss`` is
            None too).
        on_miss: None, or a value of :data:`ON_MISS`, taken as its rule of :data:`ON_MISS_RULES` with a
            ``DeprecationWarning`` (``"shed"`` is rule ``"route_shed"``: the kept weights rescaled to the routed
            mass, where rule ``"shed"`` keeps them as they are).
        where: the caller, named in errors and the warning.

    Returns:
        The rule's name.

    Raises:
        ValueError: both given, an ``on_miss`` not of :data:`ON_MISS`, or a ``rule`` not of
            :data:`MODULE_RULES`, naming the argument and listing the names it takes.
    """
    if on_miss is not None:
        if rule is not None:
            raise ValueError(f"{where}: give rule or on_miss, not both (on_miss is deprecated), got rule={rule!r} "
                             f"and on_miss={on_miss!r}")
        if not isinstance(on_miss, str) or on_miss not in ON_MISS:
            raise ValueError(f"{where}: on_miss must be one of {', '.join(ON_MISS)} (deprecated: give rule, one of "
                             f"{', '.join(MODULE_RULES)}), got {on_miss!r}")
        rule = ON_MISS_RULES[on_miss]
        changed = (" (its kept weights rescaled to the row's routed mass; rule='shed' keeps the kept weights as they "
                   "are)") if on_miss == "shed" else ""
        warnings.warn(f"{where}: on_miss is deprecated; on_miss={on_miss!r} is rule={rule!r}{changed}",
                      DeprecationWarning, stacklevel=3)
    rule = DEFAULT_RULE if rule is None else rule
    if rule == "stall":
        raise ValueError(f"{where}: rule 'stall' computes every routed expert from every expert's weights, which an "
                         f"arena module does not hold: DenseMoE is that layer (rule 'exact' gives its output from "
                         f"the arena)")
    return check_rule(rule, where, allowed=MODULE_RULES)


class ArenaSlots(nnx.Variable):
    """The arena's weights of one projection: ``[S, out, in]`` (``[L, S, out, in]`` in a stack of layers)."""


class SlotTable(nnx.Variable):
    """int32 ``[E]`` (``[L, E]`` in a stack): ``slot_table[e]`` is the arena slot of expert e, -1 not resident."""


class TierCopy(nnx.Variable):
    """One array of the tier (:class:`kq_jax.moe.TierWeights`' packed words, scales or biases) of every expert."""


def _check_size(where: str, name: str, value, minimum: int = 1) -> int:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype):
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)


def _rows(where: str, inputs, hidden_size: int):
    """``inputs`` ``[..., D]`` as rows ``[T, D]``; ValueError naming ``inputs`` where D disagrees."""
    if jnp.ndim(inputs) < 1 or jnp.shape(inputs)[-1] != hidden_size:
        raise ValueError(f"{where}: inputs must be [..., {hidden_size}] (the hidden size), got shape "
                         f"{list(jnp.shape(inputs))}")
    if not jnp.issubdtype(jnp.result_type(inputs), jnp.floating):
        raise ValueError(f"{where}: inputs must be floating point (hidden states), got {jnp.result_type(inputs)}")
    return jnp.reshape(inputs, (-1, hidden_size))


def _check_array(where: str, name: str, given, held) -> None:
    """ValueError naming ``name`` unless ``given`` is an array of ``held``'s shape and dtype (never converted)."""
    dtype = getattr(given, "dtype", None)
    if dtype != held.dtype or tuple(getattr(given, "shape", ())) != held.shape:
        raise ValueError(f"{where}: {name} must be {held.dtype} {list(held.shape)}, got "
                         f"{type(given).__name__} {dtype} {list(getattr(given, 'shape', ()))}")


def _check_flag(where: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: {name} must be a bool, got {value!r}")
    return bool(value)


class Router(nnx.Module):
    """Softmax router over E experts and its top-k, renormalised where ``normalize`` (Qwen3-MoE's
    ``norm_topk_prob``).

    Its kernel keeps the checkpoint's layout (``mlp.gate.weight``, ``[E, D]``), as the experts do, so a
    layer built from a checkpoint computes the router's product as :mod:`kq_jax.qwen3_moe` does.

    Args:
        hidden_size: D; num_experts: E; top_k: experts a token routes to, ``1 <= top_k <= min(E, 64)``.
        normalize: renormalise the top-k weights to sum to 1 (True) or keep the softmax's (False).
        dtype: the kernel's dtype.
        rngs: ``nnx.Rngs`` with a ``params`` stream.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, normalize: bool = True,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        hidden_size = _check_size("Router", "hidden_size", hidden_size)
        num_experts = _check_size("Router", "num_experts", num_experts)
        top_k = _check_size("Router", "top_k", top_k)
        if top_k > min(num_experts, 64):
            raise ValueError(f"Router: top_k must be at most min(num_experts, 64) = {min(num_experts, 64)}, "
                             f"got {top_k}")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"Router: dtype must be a floating-point dtype (the weights'), got {np.dtype(dtype)}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.normalize = _check_flag("Router", "normalize", normalize)
        self.kernel_ED = nnx.Param(_normal(rngs, (num_experts, hidden_size), hidden_size, dtype))

    def probs(self, rows):
        """The softmax over experts, float32 ``[T, E]``, of ``rows`` ``[T, D]``."""
        return router_probs(rows, self.kernel_ED[...].T)

    def __call__(self, inputs):
        """The router's top-k: ``inputs`` ``[..., D]`` -> ``(weights_TX float32, experts_TX int32)``, each
        ``[T, top_k]`` over the ``T`` rows of ``inputs`` (:func:`kq_jax.arena_moe.router_topk`)."""
        experts_TX, weights_TX = router_topk(self.probs(_rows("Router", inputs, self.hidden_size)),
                                             top_k=self.top_k, normalize=self.normalize)
        return weights_TX, experts_TX


class DenseMoE(nnx.Module):
    """The MoE feed-forward with every expert held as a parameter: SwiGLU experts ``down(silu(gate(x)) *
    up(x))`` mixed by the :class:`Router`'s top-k (:func:`kq_jax.moe.moe_ffn_resident` where ``normalize``,
    :func:`kq_jax.qwen3_moe.moe_resident` in general).

    Args:
        hidden_size: D; intermediate_size: F (each expert's); num_experts: E; top_k, normalize: as
            :class:`Router`'s.
        dtype: the weights' dtype.
        rngs: ``nnx.Rngs`` with a ``params`` stream.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 normalize: bool = True, dtype=jnp.float32, rngs: nnx.Rngs):
        self.router = Router(hidden_size, num_experts, top_k, normalize=normalize, dtype=dtype, rngs=rngs)
        d, f, e = self.router.hidden_size, _check_size("DenseMoE", "intermediate_size", intermediate_size), num_experts
        self.kernel_gating_EFD = nnx.Param(_normal(rngs, (e, f, d), d, dtype))
        self.kernel_up_proj_EFD = nnx.Param(_normal(rngs, (e, f, d), d, dtype))
        self.kernel_down_proj_EDF = nnx.Param(_normal(rngs, (e, d, f), f, dtype))

    def experts(self) -> Experts:
        """Every expert's weights: gate, up ``[E, F, D]``, down ``[E, D, F]``."""
        return Experts(self.kernel_gating_EFD[...], self.kernel_up_proj_EFD[...], self.kernel_down_proj_EDF[...])

    def __call__(self, inputs):
        """``inputs`` ``[..., D]`` -> outputs ``[..., D]`` (float32 weights: float32)."""
        rows = _rows("DenseMoE", inputs, self.router.hidden_size)
        weights_TX, experts_TX = self.router(rows)
        outputs = combine(experts_apply(rows, self.experts(), experts_TX), weights_TX)
        return jnp.reshape(outputs, jnp.shape(inputs)[:-1] + outputs.shape[-1:])

    @classmethod
    def from_qwen3_moe(cls, layer: Mapping[str, jax.Array], cfg) -> "DenseMoE":
        """The MoE layer of a Qwen3-MoE checkpoint: ``layer`` one entry of
        :func:`kq_jax.qwen3_moe.load_params`' ``"layers"`` (``router`` ``[E, D]``, ``gate_proj`` and
        ``up_proj`` ``[E, F, D]``, ``down_proj`` ``[E, D, F]``; its other arrays unread), ``cfg`` its
        :class:`kq_jax.qwen3_moe.Qwen3MoeConfig`. Its output is :func:`kq_jax.qwen3_moe.moe_resident`'s.

        Raises:
            ValueError: ``layer`` lacks one of those arrays or holds one of another shape or dtype.
        """
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        shapes = {"router": (e, d), "gate_proj": (e, f, d), "up_proj": (e, f, d), "down_proj": (e, d, f)}
        if not isinstance(layer, Mapping) or not set(shapes) <= set(layer):
            given = sorted(layer) if isinstance(layer, Mapping) else type(layer).__name__
            raise ValueError(f"DenseMoE.from_qwen3_moe: layer must map {sorted(shapes)} to arrays, got {given}")
        dtype = getattr(layer["router"], "dtype", None)
        for name, shape in shapes.items():
            given = layer[name]
            if getattr(given, "dtype", None) != dtype or tuple(getattr(given, "shape", ())) != shape:
                raise ValueError(f"DenseMoE.from_qwen3_moe: layer[{name!r}] must be {dtype} {list(shape)} (the "
                                 f"config's sizes, the router's dtype), got {getattr(given, 'dtype', None)} "
                                 f"{list(getattr(given, 'shape', ()))}")
        module = cls(d, f, e, cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob, dtype=dtype, rngs=nnx.Rngs(0))
        module.router.kernel_ED.set_value(jnp.asarray(layer["router"]))
        for variable, name in ((module.kernel_gating_EFD, "gate_proj"), (module.kernel_up_proj_EFD, "up_proj"),
                               (module.kernel_down_proj_EDF, "down_proj")):
            variable.set_value(jnp.asarray(layer[name]))
        return module


class ArenaMoE(nnx.Module):
    """The MoE feed-forward on an arena of S expert slots, a slot table, and (rules ``"tier"`` and
    ``"uniform"``) a low-precision copy of every expert.

    The arena starts empty (zeros, every table entry -1); :meth:`set_residency` fills it, or
    :meth:`from_dense` builds it from a :class:`DenseMoE`'s weights. The tier starts as zeros too (a miss
    served from it before :meth:`set_tier`, or a restored state, loads it contributes zeros). ``__call__``
    works under ``nnx.jit``, ``nnx.vmap`` / ``nnx.scan`` over a stack of layers and ``nnx.grad`` (the output
    is differentiable in the router's kernel through the gate weights), and with its input rows sharded and
    the variables replicated: under rules ``shed``, ``route_shed``, ``renormalize``, ``substitute``, ``tier``
    and ``uniform`` each device stays on its own rows, no collective (:mod:`kq_jax.partition`); ``reroute``
    and ``prior`` take XLA's ``top_k`` of the probabilities and ``exact`` reads its misses for all rows, which
    gather the rows.

    Args:
        hidden_size: D; intermediate_size: F; num_experts: E; num_slots: S; top_k, normalize: as
            :class:`Router`'s.
        rule: what the layer does with a routed expert that is not resident, a rule of :data:`MODULE_RULES`
            (:mod:`kq_core.rules`; None: :data:`kq_core.rules.DEFAULT_RULE`, ``"shed"``): e.g. ``"shed"`` (the
            miss dropped, the kept weights the router's), ``"route_shed"`` (the kept weights rescaled to the
            row's routed mass), ``"tier"`` (the miss from the tier at its own weight) or ``"exact"`` (the
            miss's expert read inside the program by ``fetch``: the output is the resident layer's;
            :mod:`kq_jax.miss_fetch`).
        on_miss: deprecated, for ``rule``: ``"shed"`` is rule ``"route_shed"``, ``"tier"`` rule ``"tier"``,
            ``"fetch"`` rule ``"exact"`` (:data:`ON_MISS_RULES`; a ``DeprecationWarning``).
        fetch: rule ``"exact"``'s reader, ``fetch(layer, ids) -> (gate, up, down)`` of the experts ``ids``
            (e.g. a :class:`kq_host.miss_reader.MissReader`); called from inside the step, only when the
            layer misses.
        tier_bits, tier_group_size: the tier's format (:mod:`kq_host.tier`; default
            :data:`~kq_host.tier.DEFAULT_TIER_BITS` bits in groups of :data:`~kq_host.tier.DEFAULT_TIER_GROUP_SIZE`),
            used where the rule needs a tier;
            D and F must be multiples of ``tier_group_size``.
        dtype: the router's and the arena's dtype (the tier's scales and biases are
            :func:`kq_host.tier.scale_dtype`'s for it).
        impl: ``topk_route_shed``'s (``"auto"``: the Pallas kernel on a GPU, the jnp reference elsewhere).
        rngs: ``nnx.Rngs`` with a ``params`` stream (the router's initial kernel).

    Raises:
        ValueError: a size, ``rule``, ``on_miss``, ``impl`` or a tier option the layer cannot take, naming it.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, num_slots: int, top_k: int, *,
                 normalize: bool = True, rule: str | None = None, on_miss: str | None = None,
                 tier_bits: int = DEFAULT_TIER_BITS, tier_group_size: int = DEFAULT_TIER_GROUP_SIZE, dtype=jnp.float32,
                 impl: str = "auto", fetch=None, rngs: nnx.Rngs):
        rule = resolve_rule(rule, on_miss, "ArenaMoE")
        self.router = Router(hidden_size, num_experts, top_k, normalize=normalize, dtype=dtype, rngs=rngs)
        d, e = self.router.hidden_size, self.router.num_experts
        f = _check_size("ArenaMoE", "intermediate_size", intermediate_size)
        s = _check_size("ArenaMoE", "num_slots", num_slots)
        if impl not in IMPLS:
            raise ValueError(f"ArenaMoE: impl must be one of {IMPLS}, got {impl!r}")
        if RULE[rule].needs_reader != callable(fetch):
            raise ValueError(f"ArenaMoE: fetch must be a callable exactly when rule='exact' (on_miss='fetch'), got "
                             f"rule={rule!r} and fetch={fetch!r}")
        self.intermediate_size, self.num_slots, self.rule, self.impl = f, s, rule, impl
        self.fetch = fetch
        self.arena_gating_SFD = ArenaSlots(jnp.zeros((s, f, d), dtype))
        self.arena_up_proj_SFD = ArenaSlots(jnp.zeros((s, f, d), dtype))
        self.arena_down_proj_SDF = ArenaSlots(jnp.zeros((s, d, f), dtype))
        self.slot_table_E = SlotTable(jnp.full((e,), -1, jnp.int32))
        self.tier_bits = self.tier_group_size = None
        if RULE[rule].needs_tier:
            for name, value, allowed in (("tier_bits", tier_bits, BITS), ("tier_group_size", tier_group_size,
                                                                          GROUP_SIZES)):
                if not is_int(value) or value not in allowed:
                    raise ValueError(f"ArenaMoE: {name} must be one of {allowed}, got {value!r}")
            for name, width in (("hidden_size", d), ("intermediate_size", f)):
                if width % tier_group_size:
                    raise ValueError(f"ArenaMoE: {name} {width} is not a multiple of tier_group_size "
                                     f"{tier_group_size}; the tier quantizes each row in groups of that many")
            self.tier_bits, self.tier_group_size = int(tier_bits), int(tier_group_size)
            scales = jnp.dtype(scale_dtype(jnp.dtype(dtype)))  # the tier's 16-bit scales for weights of dtype
            for projection, (out, width) in zip(("gating", "up_proj", "down_proj"), ((f, d), (f, d), (d, f))):
                words, groups = width * tier_bits // 32, width // tier_group_size
                setattr(self, f"tier_{projection}_packed", TierCopy(jnp.zeros((e, out, words), jnp.uint32)))
                setattr(self, f"tier_{projection}_scales", TierCopy(jnp.zeros((e, out, groups), scales)))
                setattr(self, f"tier_{projection}_biases", TierCopy(jnp.zeros((e, out, groups), scales)))

    # ---- the state, as kq_jax.moe's functions take it -------------------------------------------

    def arena(self) -> Experts:
        """The arena's weights: gate, up ``[S, F, D]``, down ``[S, D, F]``."""
        return Experts(self.arena_gating_SFD[...], self.arena_up_proj_SFD[...], self.arena_down_proj_SDF[...])

    def tier(self) -> TierExperts:
        """The tier of every expert (rules ``"tier"`` and ``"uniform"``), as :func:`kq_jax.moe.tier_experts`
        builds it.

        Raises:
            ValueError: the module's rule serves nothing from a tier and it holds none.
        """
        if not RULE[self.rule].needs_tier:
            raise ValueError(f"ArenaMoE.tier: this module's rule {self.rule!r} serves nothing from a tier, and it "
                             f"holds no tier")
        return TierExperts(*(TierWeights(*(getattr(self, f"tier_{projection}_{part}")[...] for part in _TIER_PARTS))
                             for projection in ("gating", "up_proj", "down_proj")),
                           bits=self.tier_bits, group_size=self.tier_group_size)

    # ---- the step ----------------------------------------------------------------------------------

    def __call__(self, inputs, layer=0):
        """One MoE step on the arena.

        Args:
            inputs: ``[..., D]``, e.g. ``[B, T, D]``; its ``T`` rows (every leading position) are routed.
            layer: int or int32 scalar, the layer ``fetch`` is told it reads for (rule ``"exact"``).

        Returns:
            ``(outputs [..., D], reports int32 [F, T, top_k])``: the report of :mod:`kq_core.reports` for
            one layer over the rows of ``inputs``, its ``F`` fields in ``REPORT_FIELDS`` order (the routed ids,
            their scores, the misses, -1 padded, their scores, the scores served; scores as float32 bits).
            Stacked over layers on axis 1 (``nnx.scan(..., out_axes=(nnx.Carry, 1))``) they are
            ``[F, L, T, top_k]``, ``kq_jax.arena.pack_reports``' layout, what
            ``kq_host.residency.LayerReport.from_packed`` reads.

        Raises:
            ValueError: ``inputs``' last axis is not D (at trace time under ``nnx.jit``).
        """
        rows = _rows("ArenaMoE", inputs, self.router.hidden_size)
        arena, table, tier = self.arena(), self.slot_table_E[...], None
        if RULE[self.rule].needs_tier:
            tier = self.tier()
            check_tier(tier, arena, num_experts=self.router.num_experts, where="ArenaMoE: tier")
        # The library's one step (kq_jax.qwen3_moe_arena.make_step's layers run it too): the router, then
        # arena_moe runs the hits and the misses under the rule and combines them.
        outputs, report = moe_layer(rows, self.router.kernel_ED[...].T, table,
                                    rule=self.rule, top_k=self.router.top_k,
                                    normalize=self.router.normalize, weights=arena, num_slots=self.num_slots,
                                    tier=tier, impl=self.impl, fetch=self.fetch, layer=layer)
        outputs = jnp.reshape(outputs, jnp.shape(inputs)[:-1] + outputs.shape[-1:])
        return outputs, pack_reports([report])[:, 0]

    # ---- the host side, between steps ----------------------------------------------------------

    def set_residency(self, slot_table, arena: Mapping[str, jax.Array] | None = None) -> None:
        """Points the module at the host's new residency: call it between steps, outside ``nnx.jit``.

        Args:
            slot_table: int ``[E]`` (``[L, E]`` for a stack of layers): ``ResidencyManager.step``'s or
                ``snapshot()``'s tables, or ``acquire``'s table of one layer. An entry outside ``[0, S)``
                counts as not resident.
            arena: ``{"gate_proj": [S, F, D], "up_proj": [S, F, D], "down_proj": [S, D, F]}`` (each
                ``[L, S, ...]`` for a stack), the arena's dtype, e.g. ``JaxArena.arrays``; held as they are,
                not copied. None keeps the arena. A :class:`~kq_jax.arena.JaxArena` donates its arrays
                when it writes a slot, so after every write hand the module its new ``arrays``.

        Raises:
            ValueError: a shape, dtype or projection name that is not the module's, or a NumPy table that maps
                two experts to one slot, naming the argument (nothing is changed then). A JAX table's values
                are taken as they are.
        """
        table_variable = self.slot_table_E
        table = np.asarray(slot_table) if not isinstance(slot_table, jax.Array) else slot_table
        if not jnp.issubdtype(table.dtype, jnp.integer) or table.shape != table_variable[...].shape:
            raise ValueError(f"ArenaMoE.set_residency: slot_table must be int {list(table_variable[...].shape)}, "
                             f"got {table.dtype} {list(table.shape)}")
        if isinstance(table, np.ndarray):
            bounds = np.iinfo(np.int32)
            if table.size and (table.min() < bounds.min or table.max() > bounds.max):
                raise ValueError("ArenaMoE.set_residency: slot_table holds values outside int32")
            rows = table.reshape(-1, table.shape[-1])
            held = np.where((rows >= 0) & (rows < self.num_slots), rows, -1)
            ordered = np.sort(held, axis=-1)
            shared = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
            if shared.any():
                row = int(np.argwhere(shared)[0, 0])
                raise ValueError(f"ArenaMoE.set_residency: slot_table{'' if table.ndim == 1 else f'[{row}]'} maps "
                                 f"two experts to slot {int(ordered[row, 1:][shared[row]][0])}; a slot holds one "
                                 f"expert")
        elif np.dtype(table.dtype).itemsize >= 4 and table.dtype != jnp.int32:  # its values stay on the device
            raise ValueError(f"ArenaMoE.set_residency: a JAX slot_table must be int32 (or a narrower int), got "
                             f"{table.dtype}: its values past int32 would wrap")
        variables = dict(zip(EXPERT_PROJECTIONS, (self.arena_gating_SFD, self.arena_up_proj_SFD,
                                                 self.arena_down_proj_SDF)))
        if arena is not None:
            if not isinstance(arena, Mapping) or set(arena) != set(EXPERT_PROJECTIONS):
                names = sorted(arena) if isinstance(arena, Mapping) else type(arena).__name__
                raise ValueError(f"ArenaMoE.set_residency: arena must map exactly {list(EXPERT_PROJECTIONS)} to "
                                 f"arrays, got {names}")
            for name, variable in variables.items():
                _check_array("ArenaMoE.set_residency", f"arena[{name!r}]", arena[name], variable[...])
        table_variable.set_value(jnp.asarray(table, jnp.int32))
        if arena is not None:
            for name, variable in variables.items():
                variable.set_value(jnp.asarray(arena[name]))

    def set_tier(self, tier: TierExperts) -> None:
        """Loads the tier (rules ``"tier"`` and ``"uniform"``): :func:`kq_jax.moe.tier_experts` of
        ``Tier.layer(l)``, every array ``[E, ...]`` (``[L, E, ...]`` for a stack), in this module's format.

        Raises:
            ValueError: the module holds no tier, or ``tier``'s format, a shape or a dtype is not the
                module's (nothing is changed then).
        """
        if not RULE[self.rule].needs_tier:
            raise ValueError(f"ArenaMoE.set_tier: this module's rule {self.rule!r} serves nothing from a tier, and "
                             f"it holds no tier")
        if not isinstance(tier, TierExperts):
            raise ValueError(f"ArenaMoE.set_tier: tier must be a kq_jax.moe.TierExperts, got {type(tier).__name__}")
        if (tier.bits, tier.group_size) != (self.tier_bits, self.tier_group_size):
            raise ValueError(f"ArenaMoE.set_tier: tier is bits={tier.bits}, group_size={tier.group_size}; this "
                             f"module's tier_bits={self.tier_bits}, tier_group_size={self.tier_group_size}")
        pairs = [(getattr(self, f"tier_{projection}_{part}"), getattr(getattr(tier, field), part), f"{field}.{part}")
                 for projection, field in zip(("gating", "up_proj", "down_proj"), Experts._fields)
                 for part in _TIER_PARTS]
        for variable, given, name in pairs:
            _check_array("ArenaMoE.set_tier", f"tier.{name}", given, variable[...])
        for variable, given, _ in pairs:
            variable.set_value(jnp.asarray(given))

    @classmethod
    def from_dense(cls, dense: DenseMoE, *, resident: Sequence[int] | None = None, num_slots: int | None = None,
                   rule: str | None = None, on_miss: str | None = None, tier_bits: int = DEFAULT_TIER_BITS,
                   tier_group_size: int = DEFAULT_TIER_GROUP_SIZE, impl: str = "auto", fetch=None) -> "ArenaMoE":
        """The arena layer of a :class:`DenseMoE`'s weights: its router, and the experts ``resident`` in
        slots 0, 1, ... (the rest of the slots empty); the tier, where the rule needs one, quantized from
        every expert on the host (:func:`kq_host.tier.quantize`).

        With every expert resident the output is ``dense``'s, bit for bit.

        Args:
            dense: the layer (concrete weights, not traced).
            resident: expert ids, distinct, in slot order (None: every expert, expert e in slot e).
            num_slots: S, at least ``len(resident)`` (None: ``len(resident)``).
            rule, on_miss, tier_bits, tier_group_size, impl, fetch: as for :class:`ArenaMoE`.

        Raises:
            ValueError: ``resident`` holds an id outside ``[0, E)`` or twice, or ``num_slots`` is too small.
        """
        if not isinstance(dense, DenseMoE):
            raise ValueError(f"ArenaMoE.from_dense: dense must be a DenseMoE, got {type(dense).__name__}")
        rule = resolve_rule(rule, on_miss, "ArenaMoE.from_dense")
        router, experts = dense.router, dense.experts()
        e = router.num_experts
        ids = np.arange(e) if resident is None else np.asarray(resident).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"ArenaMoE.from_dense: resident must be int expert ids, got {ids.dtype} {ids.tolist()}")
        ids = ids.astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= e or np.unique(ids).size != ids.size):
            raise ValueError(f"ArenaMoE.from_dense: resident must be distinct expert ids in [0, {e}), got "
                             f"{ids.tolist()}")
        num_slots = max(ids.size, 1) if num_slots is None else num_slots
        _check_size("ArenaMoE.from_dense", "num_slots", num_slots)
        if num_slots < ids.size:
            raise ValueError(f"ArenaMoE.from_dense: num_slots {num_slots} cannot hold the {ids.size} resident experts")
        kernel = router.kernel_ED[...]
        if experts.gate.dtype != kernel.dtype:
            raise ValueError(f"ArenaMoE.from_dense: the dense layer's experts are {experts.gate.dtype} and its "
                             f"router {kernel.dtype}; the arena layer keeps one dtype")
        module = cls(router.hidden_size, experts.gate.shape[1], e, num_slots, router.top_k,
                     normalize=router.normalize, rule=rule, tier_bits=tier_bits, tier_group_size=tier_group_size,
                     dtype=kernel.dtype, impl=impl, fetch=fetch, rngs=nnx.Rngs(0))
        module.router.kernel_ED.set_value(kernel)
        table = np.full(e, -1, np.int32)
        table[ids] = np.arange(ids.size, dtype=np.int32)
        module.set_residency(table, {name: jnp.zeros((num_slots, *w.shape[1:]), w.dtype).at[:ids.size].set(w[ids])
                                     for name, w in zip(EXPERT_PROJECTIONS, experts)})
        if RULE[rule].needs_tier:
            module.set_tier(TierExperts(*(TierWeights(*(jnp.asarray(a) for a in quantize(
                np.asarray(w), bits=tier_bits, group_size=tier_group_size))) for w in experts),
                bits=tier_bits, group_size=tier_group_size))
        return module
