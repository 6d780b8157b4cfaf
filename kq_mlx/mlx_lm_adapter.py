"""Runs an mlx-lm MoE model's experts on a bounded arena, at the seam every mlx-lm MoE family shares.

Every MoE family of mlx-lm hands its routed experts to a ``SwitchGLU`` or ``SwitchMLP``
(``mlx_lm.models.switch_layers``) as ``module(x, indices)``: after its own router and before its own
combine and shared experts. :func:`attach_arena` finds each of them by type and puts an
:class:`ArenaSwitch` there: it maps ``indices`` to arena slots with the layer's slot table
(:func:`kq_mlx.route_shed`) and runs a copy of that same module whose per-expert arrays are cut to
``num_slots`` slots (the arena), so whatever the original's ``__call__`` does (biases, a clamped
activation, ``QuantizedSwitchLinear`` of any mode) runs unchanged; the family's router, scores,
shared experts and combine are untouched. The rules that need no gate weights work for every family:
``exact``, ``tier``, ``shed`` and ``stall``.

For the families whose routers kq knows (:data:`ROUTERS`: Qwen3-MoE, Mixtral), the whole MoE block is
wrapped by :class:`ArenaMoeBlock` instead: it routes exactly as the block does, calls ``route_shed``
against the layer's slot table and runs the same arena on ``slots``, combining by ``mix``; this adds
the rules that rescale gate weights (``route_shed``, ``renormalize``, ``substitute``).

Quantized checkpoints (mlx-lm's ``QuantizedSwitchLinear``: packed weights, scales and biases, any
mode) get an arena of the same class and quantization: each slot holds one expert's packed arrays as
the checkpoint stores them, and mlx-lm's ``gather_qmm`` runs on the slots.

With every expert resident the model produces the original model's bits, and a layer whose published
table holds every expert runs as mlx-lm's own block does: no ``route_shed``, no tier, its report "no
misses" (:attr:`ArenaLayer.full_path`).

:func:`attach_tier` gives each layer a low-precision copy of all its experts
(:class:`kq_host.tier.Tier`, MLX's quantized layout, run by ``gather_qmm``); with rule ``"tier"`` a
miss is computed with its copy at its full weight instead of being shed.

mlx-lm's idioms work on an attached model: ``copy.deepcopy`` (the copy on arrays and compiled graphs of its own;
refused while a residency manager fills the arenas, :func:`attach_exact`), the family's ``Model.shard`` (a
SwitchGLU's ``gate_proj``, ``up_proj`` and ``down_proj`` reach every copy of the experts the layer holds: its
own, the arena's slots, the tier's), a cast through ``model.update(tree_map(...))``, ``save_weights`` /
``load_weights`` and ``nn.quantize`` (the slots quantized as the experts they hold). Slot tables and the last
pass's records are no parameters.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections.abc import Iterable, Sequence
from typing import Callable, Collection

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kq_core.validate import is_int
import kq_mlx
from kq_mlx import report_pack, route_shed_columns
from kq_mlx.route_shed_mlx import from_numpy
from kq_core.contract import holds_every_expert
from kq_core.rules import DEFAULT_RULE, RULE, RULES, check_rule
from kq_host.arena import check_payload, check_slot, checked_writes
from kq_host.residency import LayerReport, PreloadError, deadline_of

# SwitchGLU's projections (a SwitchMLP has fc1 and fc2): the names a tier's weights carry.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# mlx-lm's switch layers sort a call's entries by expert (a different gather_mm kernel) from this many on.
SORTED_FROM = 64
# generate_greedy hands the manager the reports of passes that ran every layer resident this many at a time.
RESIDENT_REPORTS_BATCH = 16


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


# The MoE blocks whose routers kq runs itself (ArenaMoeBlock), with the rules that rescale gate weights. Each
# row of a router's scores is all NaN or in [0, 1] with its largest at least 1 / E (a softmax's top k,
# normalised or not): ArenaMoeBlock._mix_all_resident relies on it.
ROUTERS: dict[str, Callable] = {
    "Qwen3MoeSparseMoeBlock": _route_qwen3_moe,
    "MixtralSparseMoeBlock": _route_mixtral,
}


# What a layer does with a routed expert that is not resident: kq_core.rules' rules (their meanings in RULE), but
# reroute and prior (they change which experts run: JAX only) and uniform (no arena: kq study's baseline).
MISS_RULES: tuple[str, ...] = tuple(rule for rule in RULES if rule not in ("reroute", "prior", "uniform"))
# The rules that need no gate weights: every family, at the SwitchGLU seam.
SEAM_RULES: tuple[str, ...] = tuple(rule for rule in MISS_RULES if not RULE[rule].needs_router)
# An ArenaLayer's attributes kept outside mlx's module tree: its slot table and what the last pass left are no
# parameters (a cast, an update or save_weights of the model leaves them alone).
_OUTSIDE_TREE = frozenset({"slot_table", "last", "last_mix"})
# What a deep copy of a layer starts afresh: its compiled graphs (closures over the layer copied) and the records of
# the last pass, as a layer just attached has them.
_NOT_COPIED = {"_graphs": dict, "_deferred": lambda: None, "last": lambda: None, "last_mix": lambda: None}
# What a deep copy of a layer shares with it: the process group Model.shard split it over (a handle, not state).
_SHARED_IN_COPY = frozenset({"sharding_group"})


def _switch_types() -> tuple[type, ...]:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    return SwitchGLU, SwitchMLP


def _projection_names(switch: nn.Module) -> tuple[str, ...]:
    """The per-expert linear layers of a SwitchGLU / SwitchMLP, in its order (``gate_proj``, ... or ``fc1``, ...)."""
    return tuple(name for name, child in switch.children().items()
                 if isinstance(child, nn.Module) and isinstance(child.get("weight"), mx.array)
                 and child["weight"].ndim == 3)


class ArenaLayer(nn.Module):
    """What :class:`ArenaMoeBlock` and :class:`ArenaSwitch` share: one layer's arena and its slot table.

    Attributes:
        slot_table: ``mx.array int32 [E]`` for the next forward pass (set by :func:`set_tables`, checked where set;
            no parameter of the module).
        rule: one of the class's ``RULES`` (:mod:`kq_core.rules`); default ``"shed"`` (``DEFAULT_RULE``).
        last: ``(inds, scores, RouteShedResult)`` of the last forward pass, for the host.
        last_mix: the weights the last pass combined the experts' outputs with (0: not served).
        compiled: build the layer's graph through ``mx.compile`` (the default): its routing, ``route_shed``,
            experts and combine traced once per rule and input shape, then replayed, and on a CPU stream
            the misses' prestage lists left to :func:`pack_reports`, which ranks every layer's in one
            call. The same bits as with ``False`` (the ops one by one), every rule but ``"stall"`` and
            ``"exact"`` (which read back mid-graph and run uncompiled).
        full_path: with :attr:`compiled`, while the table :func:`set_tables` last published holds every expert
            of the layer in the arena (nothing can miss), run the layer as mlx-lm runs its own block: the
            routed ids remapped to slots by one gather (none when the table is the identity) and the experts,
            no ``route_shed``, no tier, its report "no misses" (the general graph's bits: logits and reports).
            ``False`` keeps the general graph at any residency (the default is True).
        module_path: the path of the layer's SwitchGLU in the model as loaded (``"model.layers.3.mlp.switch_mlp"``):
            the prefix of its tensors in an mlx-lm checkpoint (:meth:`tensor_names`).
        model_layer: the decoder layer's index in that path (3 above).
    """

    RULES: tuple[str, ...] = SEAM_RULES

    def __init__(self, switch: nn.Module, num_slots: int, keep_experts: bool, module_path: str):
        super().__init__()
        object.__setattr__(self, "projections", _projection_names(switch))  # names, not part of the module tree
        self.num_experts = _expert_count(switch)
        self.num_slots = _checked_slots(num_slots, self.num_experts)
        # What the tier takes whole from the layer's own experts, kept where they are dropped: each projection's
        # per-expert bias (gpt-oss), [E, out].
        self.expert_biases = {p: switch[p]["bias"] for p in self.projections if "bias" in switch[p]}
        # The arena: the layer's own SwitchGLU class, each projection a copy of the original (its class,
        # quantization and hyper-parameters) with every per-expert array cut to num_slots zero slots.
        self.arena = copy.copy(switch)
        for projection in self.projections:
            setattr(self.arena, projection, _arena_projection(switch[projection], self.num_experts, num_slots))
        self.keeps_experts = keep_experts
        self.module_path = module_path
        numbers = re.findall(r"\.(\d+)(?=\.|$)", "." + module_path)
        self.model_layer = int(numbers[0]) if numbers else None
        object.__setattr__(self, "_slot_table", mx.full((self.num_experts,), -1, mx.int32))  # not a parameter
        self._published = None  # set_tables' last row for this layer (_Published: outside the module's tree)
        self._rule = DEFAULT_RULE
        self.tier = None  # a copy of the arena holding every expert at low precision (attach_tier)
        self.manager, self.layer, self.timeout = None, None, None  # rule "exact" (attach_exact)
        self.read_retries = 0  # rule "exact": times a failed read is read again before the error
        self.last = None
        self.last_mix = None
        self.compiled = True
        self.full_path = True
        # Outside the module's tree: the compiled graphs (by rule, with the modules they read) and what the
        # last compiled pass left for pack_reports (_Deferred).
        object.__setattr__(self, "_graphs", {})
        object.__setattr__(self, "_deferred", None)

    def __setattr__(self, key: str, value) -> None:
        if key in _OUTSIDE_TREE:  # through the property, or into the instance: never an item of the module's tree
            object.__setattr__(self, key, value)
        else:
            super().__setattr__(key, value)

    def __deepcopy__(self, memo: dict) -> "ArenaLayer":
        """A copy of the layer on arrays of its own (``copy.deepcopy`` of the model): its arena, experts, tier and
        table copied, its rule and options kept; its compiled graphs are built again on its first pass and the
        last pass's records start empty (as after :func:`attach_arena`).

        Raises:
            TypeError: the layer is bound to a residency manager (:func:`attach_exact`), which fills this layer's
                arena and not a copy's.
        """
        if self.manager is not None:
            raise TypeError(f"{self._where()} cannot be deep-copied while bound to a residency manager (attach_exact): "
                            f"the manager writes this layer's arena, not a copy's. Copy the model before attach_exact, "
                            f"then attach_exact the copy to a manager over its own blocks")
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for key, value in self.__dict__.items():
            if key in _NOT_COPIED:
                value = _NOT_COPIED[key]()
            elif key not in _SHARED_IN_COPY:
                value = copy.deepcopy(value, memo)
            object.__setattr__(twin, key, value)
        for key, value in self.items():
            dict.__setitem__(twin, key, copy.deepcopy(value, memo))
        return twin

    def _own_switch(self) -> nn.Module | None:
        """The layer's own SwitchGLU (every expert), or None where attach_arena dropped it."""
        raise NotImplementedError

    def _projection_view(self, projection: str) -> "_ProjectionView":
        return _ProjectionView(self, projection)

    def _set_expert_array(self, projection: str, name: str, value) -> None:
        """Sets the per-expert array ``name`` (``[E, ...]``) of a projection on every copy the layer holds: its own
        experts (when kept), the experts' bias the tier takes (and the tier's), and each slot of the arena that
        holds an expert by the current table (that expert's row). A tier's quantized weights are its own copy and
        stay as they are (attach_tier again for a new one)."""
        own = self._own_switch()
        holder = None if own is None else own[projection]
        if holder is not None and isinstance(holder.get(name), mx.array):
            current = holder[name]
        elif name == "bias" and projection in self.expert_biases:
            current = self.expert_biases[projection]
        else:
            raise AttributeError(self._no_expert_array(projection, name))
        if not isinstance(value, mx.array) or tuple(value.shape) != tuple(current.shape):
            got = list(value.shape) if isinstance(value, mx.array) else type(value).__name__
            raise ValueError(f"{self._where()}: {projection}.{name} must be an mx.array {list(current.shape)} (one row "
                             f"an expert), got {got}")
        if holder is not None and name in holder:
            holder[name] = value
        if name == "bias" and projection in self.expert_biases:
            self.expert_biases[projection] = value
            if self.tier is not None and "bias" in self.tier[projection]:
                self.tier[projection]["bias"] = value
        slots = self.arena[projection].get(name)
        if isinstance(slots, mx.array):
            table = np.array(self.slot_table)
            resident = np.flatnonzero((table >= 0) & (table < self.num_slots))
            if resident.size:
                slots[mx.array(table[resident])] = value[mx.array(resident)].astype(slots.dtype)

    def _no_expert_array(self, projection: str, name: str) -> str:
        """Why ``<projection>.<name>`` cannot be read as the layer's experts' array."""
        if self._own_switch() is None and name in self.arena[projection]:
            return (f"{self._where()}: {projection}.{name}: the layer's own experts were dropped "
                    f"(attach_arena(..., keep_experts=False)); its arena holds {self.num_slots} slots, not "
                    f"{self.num_experts} experts")
        return f"{self._where()}: {projection} has no per-expert array {name!r}"

    @property
    def slot_table(self) -> mx.array:
        """``mx.array int32 [E]``: each expert's slot for the next forward pass, -1 (or any value outside
        ``[0, num_slots)``) where it is not resident. Kept outside the module's parameters.

        Set it through :func:`set_tables`, or by hand: any integer array ``[E]`` (NumPy or MLX) whose values fit
        int32 and that puts no two experts in one slot of the arena.

        Raises:
            ValueError: on setting a table of another shape, of values that are no int32 (a float, NaN, a bool, a
                string, an integer past int32: each would truncate or wrap into some slot), or that puts two
                experts in one slot; naming ``slot_table`` and the layer. The table is then unchanged.
        """
        return self._slot_table

    @slot_table.setter
    def slot_table(self, table) -> None:
        where = self._where()
        try:
            host = np.asarray(table)
        except (TypeError, ValueError, RuntimeError):
            host = None
        if host is None or host.shape != (self.num_experts,):
            got = f"shape {list(host.shape)}" if host is not None else f"{table!r:.80}"
            raise ValueError(f"{where}: slot_table must be [{self.num_experts}] (one slot id an expert), got {got}")
        row = _slot_ids(where, "slot_table", host[None], np.array([self.num_slots]), lambda _: "slot_table ")[0]
        given = isinstance(table, mx.array) and table.dtype == mx.int32
        object.__setattr__(self, "_slot_table", table if given else from_numpy(row))

    def _checked_table(self, table: np.ndarray, source: str) -> mx.array:
        """A host table ``int [E]`` that ``source`` handed the layer, checked as :attr:`slot_table` checks one,
        stored; returns the array stored."""
        row = _slot_ids(self._where(), "slot_table", np.asarray(table)[None], np.array([self.num_slots]),
                        lambda _: f"slot_table from {source} ")[0]
        object.__setattr__(self, "_slot_table", from_numpy(row))
        return self._slot_table

    def _where(self) -> str:
        """The layer as errors name it: its class, path and decoder layer."""
        layer = f" (layer {self.model_layer})" if self.model_layer is not None else ""
        return f"{type(self).__name__} at {self.module_path}{layer}"

    @property
    def rule(self) -> str:
        return self._rule

    @rule.setter
    def rule(self, rule: str) -> None:
        if isinstance(rule, str) and rule in MISS_RULES and rule not in self.RULES:
            raise ValueError(f"{type(self).__name__}: rule {rule!r} rescales the gate weights, which this family's "
                             f"own router computes; it takes {self.RULES} (kq runs the routers of "
                             f"{sorted(ROUTERS)} itself, and gives those every rule of {MISS_RULES})")
        self._rule = check_rule(rule, type(self).__name__, allowed=self.RULES)

    def _source(self, why: str) -> nn.Module:
        """The layer's own SwitchGLU (every expert), kept unless attach_arena dropped it."""
        raise NotImplementedError

    def slot_layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{payload key: (shape, dtype)}`` of one slot: what a loader hands :class:`SwitchGLUArena`.

        A float projection's weight is keyed by the projection (``"gate_proj"``, float32 or narrower);
        every other per-expert array by ``"<projection>.<array>"``: a quantized projection's
        ``"gate_proj.weight"`` (packed uint32), ``"gate_proj.scales"``, ``"gate_proj.biases"``, and a
        projection bias ``"gate_proj.bias"`` (gpt-oss). :meth:`tensor_names` gives each key's tensor in an
        mlx-lm checkpoint.
        """
        return {key: (tuple(array.shape[1:]), _host_dtype(array.dtype)) for key, array in _slot_arrays(self.arena)}

    def tensor_names(self) -> dict[str, str]:
        """``{payload key: tensor name}``: where each of :meth:`slot_layout`'s arrays is stacked ``[E, ...]`` in
        a checkpoint saved from the model as loaded (mlx_lm.convert's, mlx-community's), e.g.
        ``"gate_proj"`` -> ``"model.layers.3.mlp.switch_mlp.gate_proj.weight"``."""
        return {key: f"{self.module_path}.{key}" + ("" if "." in key else ".weight") for key in self.slot_layout()}

    def expert_weights(self, expert: int) -> dict[str, np.ndarray]:
        """One expert's payload (:meth:`slot_layout`'s keys) from the original experts: the in-memory 'disk' for tests."""
        return {key: _to_host(array[expert]) for key, array in _slot_arrays(self._source("expert_weights"))}

    def stacked_expert_weights(self) -> dict[str, np.ndarray]:
        """Every original expert's payload at once, ``{key: [E, ...] host array}`` (one copy of the layer's
        experts in host memory, as the page cache holds a checkpoint's: an in-memory 'disk' whose reads
        touch no device)."""
        return {key: _to_host(array) for key, array in _slot_arrays(self._source("stacked_expert_weights"))}

    def _exact(self, x, inds, scores):
        """Rule ``"exact"``: the routing evaluated and read back, every routed expert made resident by the
        residency manager (:func:`attach_exact`) before it runs: ``(y [..., K, D], RouteShedResult)``.

        When the layer's routed experts fit its slots (beside the pinned ones), one ``acquire`` makes them
        all resident and the arena runs as for any rule. A pass of many tokens (a prompt) may route more:
        its experts are then taken in chunks that fit, the resident ones first, each chunk's experts
        acquired (each read once) and run on the entries routed to them, and the entries' outputs put
        back in order. Each entry's output is the arena's for that entry alone, so the bits are those
        of one call over every entry (each entry's products are its own rows of ``gather_mm``), provided
        a chunk takes the kernel the whole pass would: mlx-lm sorts a call's entries from
        :data:`SORTED_FROM` on, and on MLX-CUDA the sorted kernel's float32 bits differ from the unsorted
        one's, so a chunk of a pass that sorts is repeated up to that many entries (docs/benchmarks.md).
        """
        if self.manager is None:
            raise ValueError(f"{type(self).__name__}: rule 'exact' needs a residency manager: call attach_exact first")
        scores_f32 = scores.astype(mx.float32)
        mx.eval(inds, scores_f32)  # one wait for the routing: the host reads both
        k = inds.shape[-1]
        ids = np.array(inds).reshape(-1, k).astype(np.int64)
        host_scores = np.array(scores_f32).reshape(-1, k)
        pinned = self.manager.pinned_experts.get(self.layer, set())
        wanted = np.unique(ids)
        capacity = self.num_slots - len(pinned)
        if np.setdiff1d(wanted, list(pinned)).size <= capacity:
            table = self._acquire(ids, host_scores)
            self._checked_table(table, "manager.acquire")
            slots = mx.array(table[ids].astype(np.uint32).reshape(inds.shape))
            return self.arena(x, slots), self._served(inds, scores, slots)
        if capacity < 1:
            raise ValueError(f"{type(self).__name__} at {self.module_path}: all {self.num_slots} slots hold pinned "
                             f"experts; none is left for the {wanted.size} experts the pass routes")
        resident = self.manager.snapshot()[self.layer][wanted] >= 0
        ordered = np.concatenate([wanted[resident], wanted[~resident]])
        rank = np.empty(self.num_experts, np.int64)
        rank[ordered] = np.arange(ordered.size)
        flat_ids, flat_scores = ids.reshape(-1), host_scores.reshape(-1)
        chunk_of_entry = rank[flat_ids] // capacity
        x_rows = x.reshape(-1, x.shape[-1])
        outputs, positions, table = [], [], None
        for chunk in range(int(chunk_of_entry.max()) + 1):
            entries = np.flatnonzero(chunk_of_entry == chunk)
            table = self._acquire(flat_ids[entries][None], flat_scores[entries][None])
            self._checked_table(table, "manager.acquire")
            slots = mx.array(table[flat_ids[entries]].astype(np.uint32))[:, None]
            # A chunk takes the kernel the whole pass would: repeated up to SORTED_FROM entries where it sorts.
            copies = -(-SORTED_FROM // entries.size) if ids.size >= SORTED_FROM > entries.size else 1
            out = self.arena(x_rows[mx.array(entries // k)], mx.repeat(slots, copies, axis=1))[:, :1]
            mx.eval(out)  # before the next chunk's reads take its slots
            outputs.append(out.reshape(entries.size, -1))
            positions.append(entries)
        back = np.argsort(np.concatenate(positions), kind="stable")
        y = mx.concatenate(outputs)[mx.array(back)].reshape(*inds.shape, -1)
        # Every routed expert was served: the routing against a table holding them all (no miss, full mix).
        every = np.full(self.num_experts, -1, np.int32)
        every[wanted] = np.arange(wanted.size) % self.num_slots
        return y, self._served(inds, scores, mx.array(every[ids].astype(np.uint32).reshape(inds.shape)))

    @staticmethod
    def _served(inds, scores, slots) -> kq_mlx.RouteShedResult:
        """route_shed's result for a pass whose every routed expert is resident at ``slots`` (uint32, as
        ``inds``): its weights (:func:`~kq_mlx.route_shed_columns.mix_all_kept`, compiled) and no misses."""
        miss_ids, miss_scores, _ = _no_misses(tuple(inds.shape))
        return kq_mlx.RouteShedResult(slots, _mix_all_kept_graph()(scores), miss_ids, miss_scores)

    def _acquire(self, ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """``manager.acquire`` of this layer's routed ``ids``; a read that failed is read again (its routing
        not credited twice) up to :attr:`read_retries` times. Returns the layer's table, ``int32 [E]``."""
        for attempt in range(self.read_retries + 1):
            try:
                return self.manager.acquire(self.layer, ids, scores, timeout=self.timeout,
                                            credit=attempt == 0)
            except PreloadError as error:
                if error.pending or attempt == self.read_retries:
                    raise

    def _experts(self, x, inds, scores, on_miss: str = "shed"):
        """route_shed against the slot table, then the arena (and with ``on_miss="tier"`` the tier for the
        misses) on the slots: ``(y [..., K, D], RouteShedResult)``."""
        if on_miss == "tier" and self.tier is None:
            raise ValueError(f"{type(self).__name__}: rule 'tier' needs a tier: call attach_tier(blocks, tier) first")
        shed = kq_mlx.route_shed(inds.astype(mx.uint32), scores, self.slot_table, num_slots=self.num_slots,
                                 on_miss=on_miss)
        return self._arena_and_tier(x, shed.slots, on_miss), shed

    def _graph(self, rule: str, captured: list[nn.Module], forward: Callable) -> Callable:
        """``forward`` through ``mx.compile``, once per ``rule`` while the ``captured`` modules stay the same
        objects (the arrays it reads besides its arguments, read again at every call: slot writes, new
        tables and replaced submodules are seen). A module replaced whole (a new tier) replaces the rule's
        graph, so the old module is not kept alive by it."""
        modules = tuple(map(id, captured))
        kept = self._graphs.get(rule)
        if kept is None or kept[0] != modules:
            kept = self._graphs[rule] = (modules, mx.compile(forward, inputs=captured))
        return kept[1]

    def _serve(self, inds, scores, slot_table, on_miss: str):
        """``route_shed`` inside a compiled graph: ``(slots, mix, miss bool)`` on a CPU stream (the prestage
        lists left to :func:`pack_reports`), the full ``RouteShedResult`` where a kernel runs it."""
        if kq_mlx.implementation_for() == "ops":
            # The scores are a softmax router's (ArenaMoeBlock) or positive constants (ArenaSwitch): >= 0 or NaN.
            return route_shed_columns.serve(inds.astype(mx.uint32), scores, slot_table, num_slots=self.num_slots,
                                            on_miss=on_miss, nonnegative=True)
        return tuple(kq_mlx.route_shed(inds.astype(mx.uint32), scores, slot_table, num_slots=self.num_slots,
                                       on_miss=on_miss))

    def _arena_and_tier(self, x, slots, on_miss: str):
        """The experts on ``slots``: the arena's, and with ``on_miss="tier"`` the tier's for the slots past it."""
        if on_miss != "tier":
            return self.arena(x, slots)
        if self.tier is None:
            raise ValueError(f"{type(self).__name__}: rule 'tier' needs a tier: call attach_tier(blocks, tier) first")
        from_tier = slots >= self.num_slots
        # The hits through the arena exactly as route_shed's graph runs them: with no miss, the model's bits.
        hits = self.arena(x, mx.where(from_tier, 0, slots))
        misses = self.tier(x, mx.where(from_tier, slots - self.num_slots, 0))
        return mx.where(from_tier[..., None], misses, hits)

    def _keep_compiled(self, inds, scores, last_mix, shed) -> None:
        """Records a compiled pass: ``last`` and ``last_mix``, and where the prestage lists were left to
        :func:`pack_reports`, what it needs to rank them (the ``last`` entry's lists are built lazily)."""
        if len(shed) == 3:
            slots, mix, miss = shed
            shed = kq_mlx.RouteShedResult(slots, mix, *_rank_misses_graph()(inds, scores, miss))
            self.last, self.last_mix = (inds, scores, shed), last_mix
            object.__setattr__(self, "_deferred", _Deferred(self.last, last_mix, miss))
            return
        self.last, self.last_mix = (inds, scores, kq_mlx.RouteShedResult(*shed)), last_mix
        object.__setattr__(self, "_deferred", None)

    def _resident(self) -> _Published | None:
        """The table :func:`set_tables` last published, while it is the layer's and holds every expert in the
        arena (and :attr:`full_path` is on); None otherwise: the general graph runs."""
        published = self._published
        if self.full_path and published is not None and published.full and published.table is self.slot_table:
            return published
        return None

    def _keep_resident(self, inds, scores, slots, route_mix, last_mix) -> None:
        """Records a pass with every expert resident: ``last`` (no misses: ids -1, scores 0.0, as route_shed
        reports them) and ``last_mix``, and for :func:`pack_reports` a pass with nothing to rank."""
        miss_ids, miss_scores, _ = _no_misses(tuple(inds.shape))
        self.last = (inds, scores, kq_mlx.RouteShedResult(slots, route_mix, miss_ids, miss_scores))
        self.last_mix = last_mix
        object.__setattr__(self, "_deferred", _Deferred(self.last, last_mix, None))

    def report(self) -> LayerReport:
        """The last pass's routing and misses as host arrays (call after evaluating the step)."""
        inds, scores, shed = self.last
        k = inds.shape[-1]
        served = mx.where(self.last_mix > 0, scores, 0.0)
        return LayerReport(*(np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)
                             .reshape(-1, k) for a in (inds, scores, shed.miss_ids, shed.miss_scores, served)))


class ArenaSwitch(ArenaLayer):
    """An arena in place of a family's ``SwitchGLU`` / ``SwitchMLP``: ``__call__(x, indices)`` as the original.

    The family's router has chosen ``indices`` (``[..., K]``) and combines the output ``[..., K, D]`` with
    its own scores; the arena serves each routed expert from its slot. Its scores are not seen here, so the
    reports carry position-decreasing pseudo scores (``(K - k) / K`` for the ``k``-th routed entry): the
    misses come ordered by top-k position. Rules (:data:`SEAM_RULES`): ``"shed"`` (a miss's output zeroed;
    the default), ``"tier"`` (a miss from the tier, :func:`attach_tier`), ``"stall"`` (the original module,
    every expert: needs ``keep_experts``), ``"exact"`` (:func:`attach_exact`).
    """

    def __init__(self, switch: nn.Module, num_slots: int, *, keep_experts: bool = True, module_path: str = ""):
        super().__init__(switch, num_slots, keep_experts, module_path)
        if keep_experts:
            self.source = switch

    def _source(self, why: str) -> nn.Module:
        if not self.keeps_experts:
            raise ValueError(f"ArenaSwitch: {why} needs the layer's own experts, dropped by "
                             f"attach_arena(..., keep_experts=False)")
        return self.source

    def _own_switch(self) -> nn.Module | None:
        return self.source if self.keeps_experts else None

    def __getattr__(self, key: str):
        try:
            return super().__getattr__(key)
        except AttributeError:
            # The SwitchGLU's projections, as the family's code reaches them (mlx-lm's Model.shard)
            if key in self.__dict__.get("projections", ()):
                return self._projection_view(key)
            raise

    def __setattr__(self, key: str, value) -> None:
        if key in self.__dict__.get("projections", ()):
            raise TypeError(f"{self._where()}: {key} is the arena's and the layer's experts' projection; it cannot "
                            f"be replaced (update its arrays: they reach every copy)")
        super().__setattr__(key, value)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.compiled and self.rule in ("shed", "tier"):
            return self._compiled_call(x, indices)
        k = indices.shape[-1]
        scores = mx.broadcast_to(mx.arange(k, 0, -1, dtype=mx.float32) / k, indices.shape)
        if self.rule == "stall":
            self.last = (indices, scores, kq_mlx.route_shed(indices.astype(mx.uint32), scores, self.slot_table,
                                                             num_slots=self.num_slots))
            self.last_mix = scores
            return self._source("rule 'stall'")(x, indices)
        if self.rule == "exact":
            y, shed = self._exact(x, indices, scores)
        else:
            y, shed = self._experts(x, indices, scores, on_miss="tier" if self.rule == "tier" else "shed")
        self.last = (indices, scores, shed)
        if self.rule == "shed":
            kept = shed.mix > 0
            self.last_mix = mx.where(kept, scores, 0.0)
            return mx.where(kept[..., None], y, mx.zeros_like(y))
        self.last_mix = scores
        return y

    def _compiled_call(self, x: mx.array, indices: mx.array) -> mx.array:
        """Rules ``"shed"`` and ``"tier"`` as one compiled graph: the uncompiled path's ops and bits."""
        rule = self.rule
        on_miss = "tier" if rule == "tier" else "shed"
        if rule == "tier" and self.tier is None:
            raise ValueError(f"{type(self).__name__}: rule 'tier' needs a tier: call attach_tier(blocks, tier) first")
        resident = self._resident()
        if resident is not None:
            return self._resident_call(x, indices, resident)

        def forward(x, indices, slot_table):
            k = indices.shape[-1]
            scores = mx.broadcast_to(mx.arange(k, 0, -1, dtype=mx.float32) / k, indices.shape)
            shed = self._serve(indices, scores, slot_table, on_miss)
            y = self._arena_and_tier(x, shed[0], on_miss)
            if rule == "shed":
                kept = shed[1] > 0
                return mx.where(kept[..., None], y, mx.zeros_like(y)), scores, mx.where(kept, scores, 0.0), shed
            return y, scores, scores, shed

        captured = [self.arena] + ([self.tier] if rule == "tier" else [])
        out, scores, last_mix, shed = self._graph(rule, captured, forward)(x, indices, self.slot_table)
        self._keep_compiled(indices, scores, last_mix, shed)
        return out

    def _resident_call(self, x: mx.array, indices: mx.array, resident: _Published) -> mx.array:
        """Every expert resident: the slots (a gather, none for the identity table) and the arena, as mlx-lm's
        SwitchGLU on ``indices``. Every entry is served at its pseudo score under both rules."""
        def forward(x, indices, *remap):
            slots = remap[0][indices] if remap else indices.astype(mx.uint32)
            return self.arena(x, slots), slots

        table = [] if resident.remap is None else [resident.remap]
        key = f"{self.rule}: every expert resident" + (", remapped" if table else "")
        out, slots = self._graph(key, [self.arena], forward)(x, indices, *table)
        scores = _position_scores(tuple(indices.shape))
        self._keep_resident(indices, scores, slots, scores, scores)
        return out


class ArenaMoeBlock(ArenaLayer):
    """An mlx-lm MoE block whose router kq knows (:data:`ROUTERS`), its experts in an arena of ``num_slots``
    slots: the block's routing, ``route_shed`` and the arena's experts combined by ``mix``. Every rule of
    :data:`MISS_RULES` (default ``"shed"``: :data:`kq_core.rules.DEFAULT_RULE`); the reports carry the router's
    scores."""

    RULES = MISS_RULES

    def __init__(self, block: nn.Module, num_slots: int, *, keep_experts: bool = True, module_path: str = ""):
        name = type(block).__name__
        if name not in ROUTERS:
            raise TypeError(f"ArenaMoeBlock: no router for {name}; supported: {sorted(ROUTERS)} (attach_arena puts "
                            f"an ArenaSwitch at any family's SwitchGLU)")
        super().__init__(block.switch_mlp, num_slots, keep_experts, module_path or "switch_mlp")
        self._route = ROUTERS[name]
        self.block = block
        self.sharding_group = None  # set by mlx-lm's Model.shard: the block sums its output over the group
        if not keep_experts:
            # Dropped before anything evaluates them: from a lazily loaded checkpoint the experts are then
            # never read into memory (the arena is filled from disk by the residency manager).
            block.pop("switch_mlp")

    def _source(self, why: str) -> nn.Module:
        if not self.keeps_experts:
            raise ValueError(f"ArenaMoeBlock: {why} needs the block's own experts, dropped by "
                             f"attach_arena(..., keep_experts=False)")
        return self.block.switch_mlp

    def _own_switch(self) -> nn.Module | None:
        return self.block.switch_mlp if self.keeps_experts else None

    @property
    def switch_mlp(self) -> "_SwitchView":
        """The block's SwitchGLU as the family's code reaches it (``layer.mlp.switch_mlp.gate_proj``: mlx-lm's
        Model.shard): its projections over every copy the layer holds (:class:`_ProjectionView`)."""
        return _SwitchView(self)

    def __call__(self, x: mx.array) -> mx.array:
        group = self.sharding_group
        if group is None:
            return self._forward(x)
        # Sharded (mlx-lm's Model.shard): each process holds a part of every expert; the parts' outputs are
        # summed, as the family's block sums them.
        from mlx.nn.layers.distributed import sum_gradients

        return mx.distributed.all_sum(self._forward(sum_gradients(group)(x)), group=group)

    def _forward(self, x: mx.array) -> mx.array:
        if self.compiled and self.rule in ("route_shed", "shed", "renormalize", "tier"):
            return self._compiled_call(x)
        if self.rule == "substitute":
            inds, scores, shed = self._substitute(x)
        elif self.rule == "tier":
            inds, scores = self._route(self.block, x)
            y, shed = self._experts(x, inds, scores, on_miss="tier")
            self.last, self.last_mix = (inds, scores, shed), shed.mix
            return (y * shed.mix.astype(scores.dtype)[..., None]).sum(axis=-2).astype(y.dtype)
        elif self.rule == "exact":
            inds, scores = self._route(self.block, x)
            y, shed = self._exact(x, inds, scores)
            self.last, self.last_mix = (inds, scores, shed), shed.mix
            return (y * shed.mix.astype(scores.dtype)[..., None]).sum(axis=-2).astype(y.dtype)
        else:
            inds, scores = self._route(self.block, x)
            shed = kq_mlx.route_shed(inds.astype(mx.uint32), scores, self.slot_table, num_slots=self.num_slots)
        self.last = (inds, scores, shed)
        if self.rule == "stall":
            self._source("rule 'stall'")
            self.last_mix = scores
            return self.block(x)
        mix = self._mix(self.rule, inds, scores, shed.mix, self.slot_table)
        self.last_mix = mix
        y = self.arena(x, shed.slots)
        return (y * mix.astype(scores.dtype)[..., None]).sum(axis=-2).astype(y.dtype)

    def _compiled_call(self, x: mx.array) -> mx.array:
        """Rules ``"route_shed"``, ``"shed"``, ``"renormalize"`` and ``"tier"`` as one compiled graph: the
        routing, ``route_shed``, the experts and the combine, the uncompiled path's ops and bits."""
        rule = self.rule
        on_miss = "tier" if rule == "tier" else "shed"
        if rule == "tier" and self.tier is None:
            raise ValueError(f"{type(self).__name__}: rule 'tier' needs a tier: call attach_tier(blocks, tier) first")
        resident = self._resident()
        if resident is not None:
            return self._resident_call(x, resident)

        def forward(x, slot_table):
            inds, scores = self._route(self.block, x)
            shed = self._serve(inds, scores, slot_table, on_miss)
            mix = self._mix(rule, inds, scores, shed[1], slot_table)
            y = self._arena_and_tier(x, shed[0], on_miss)
            return (y * mix.astype(scores.dtype)[..., None]).sum(axis=-2).astype(y.dtype), inds, scores, mix, shed

        captured = [self.block, self.arena] + ([self.tier] if rule == "tier" else [])
        out, inds, scores, mix, shed = self._graph(rule, captured, forward)(x, self.slot_table)
        self._keep_compiled(inds, scores, mix, shed)
        return out

    def _resident_call(self, x: mx.array, resident: _Published) -> mx.array:
        """Every expert resident: the block's routing, the slots (a gather, none for the identity table), the
        arena and the combine, as mlx-lm's block runs them, weighted as the general graph weights a pass
        that misses nothing."""
        rule = self.rule

        def forward(x, *remap):
            inds, scores = self._route(self.block, x)
            slots = remap[0][inds] if remap else inds.astype(mx.uint32)
            mix = self._mix_all_resident(rule, scores)
            y = self.arena(x, slots)
            return (y * mix.astype(scores.dtype)[..., None]).sum(axis=-2).astype(y.dtype), inds, scores, slots, mix

        table = [] if resident.remap is None else [resident.remap]
        key = f"{rule}: every expert resident" + (", remapped" if table else "")
        out, inds, scores, slots, mix = self._graph(key, [self.block, self.arena], forward)(x, *table)
        # route_shed's own weights, for `last`: the combined ones under route_shed and tier, else built lazily.
        route_mix = mix if rule in ("route_shed", "tier") else _mix_all_kept_graph()(scores)
        self._keep_resident(inds, scores, slots, route_mix, mix)
        return out

    @staticmethod
    def _mix_all_resident(rule: str, scores):
        """:meth:`_mix` of a pass whose every routed expert is resident (route_shed, shed, renormalize or tier).

        Under ``route_shed`` the kept weights are rescaled by the row's mass over the kept mass, the same sum
        here, so by 1.0 wherever that sum is finite and positive, and a row whose sum is NaN gets NaN weights:
        a router of :data:`ROUTERS` gives each row all NaN (a NaN or inf input) or scores in ``[0, 1]`` whose
        largest is at least ``1 / E``, so route_shed's weights are the flushed scores, the tier's, without
        the sum.
        """
        if rule in ("route_shed", "tier"):
            return route_shed_columns.mix_all_kept(scores, on_miss="tier")
        if rule == "shed":
            return scores
        mass = mx.sum(scores, axis=-1, keepdims=True)
        return scores / mx.where(mass > 0, mass, 1.0)

    def _substitute(self, x):
        """The routing and its substitutes in one op (kq_mlx.topk_route_shed; Qwen3-MoE routers)."""
        if type(self.block).__name__ != "Qwen3MoeSparseMoeBlock":
            raise ValueError("ArenaMoeBlock: rule 'substitute' needs a Qwen3-MoE router (softmax, then top-k)")
        probs = mx.softmax(self.block.gate(x), axis=-1, precise=True)
        routed = kq_mlx.topk_route_shed(probs, self.slot_table, top_k=self.block.top_k,
                                        normalize=bool(self.block.norm_topk_prob), on_miss="substitute",
                                        num_slots=self.num_slots)
        return routed.indices, routed.scores, routed.shed

    @staticmethod
    def _mix(rule: str, inds, scores, shed_mix, slot_table):
        """The weights under ``rule`` (route_shed, shed, renormalize, substitute or tier), route_shed's ``mix``
        given."""
        if rule in ("route_shed", "substitute", "tier"):
            return shed_mix
        kept = slot_table[inds] >= 0
        if rule == "shed":
            return mx.where(kept, scores, 0.0)
        kept_mass = mx.sum(mx.where(kept, scores, 0.0), axis=-1, keepdims=True)
        return mx.where(kept, scores / mx.where(kept_mass > 0, kept_mass, 1.0), 0.0)


class _ProjectionView(nn.Module):
    """A projection (``gate_proj``, ``up_proj``, ``down_proj``) of a layer whose SwitchGLU an arena took the place
    of, as mlx-lm's code reaches it (``shard_inplace`` in Model.shard, code reading ``switch.gate_proj.weight``).

    Built when asked for, outside the model's tree: one module over every copy of the projection the layer
    holds, its children ``arena`` (the slots), ``experts`` (the layer's own experts, when kept), ``tier`` (when
    attached) and ``expert_bias`` (the experts' bias the tier takes, gpt-oss). An update of its parameters
    reaches each copy (shard_inplace cuts each array by its name: every copy alike). Reading an array
    (``.weight``, ``.bias``) reads the layer's own experts' ``[E, ...]``; setting one sets every copy
    (:meth:`ArenaLayer._set_expert_array`).
    """

    def __init__(self, layer: ArenaLayer, projection: str):
        super().__init__()
        object.__setattr__(self, "_layer", layer)
        object.__setattr__(self, "_projection", projection)
        self["arena"] = layer.arena[projection]
        own = layer._own_switch()
        if own is not None:
            self["experts"] = own[projection]
        if layer.tier is not None:
            self["tier"] = layer.tier[projection]
        if projection in layer.expert_biases:
            self["expert_bias"] = layer.expert_biases[projection]

    def __getattr__(self, key: str):
        layer, projection = self.__dict__["_layer"], self.__dict__["_projection"]
        if key in self:
            return self[key]
        own = layer._own_switch()
        if own is not None:
            if key in own[projection] or hasattr(type(own[projection]), key) or key in own[projection].__dict__:
                return getattr(own[projection], key)
        elif key == "bias" and "expert_bias" in self:
            return self["expert_bias"]
        elif not isinstance(layer.arena[projection].get(key), mx.array) and hasattr(layer.arena[projection], key):
            return getattr(layer.arena[projection], key)  # a hyper-parameter, the same for slots and experts
        raise AttributeError(layer._no_expert_array(projection, key))

    def __setattr__(self, key: str, value) -> None:
        if key.startswith("_"):
            object.__setattr__(self, key, value)
            return
        self.__dict__["_layer"]._set_expert_array(self.__dict__["_projection"], key, value)

    def update(self, parameters: dict, strict: bool = True) -> "_ProjectionView":
        super().update(parameters, strict)
        layer, projection = self.__dict__["_layer"], self.__dict__["_projection"]
        if "expert_bias" in self:
            layer.expert_biases[projection] = self["expert_bias"]
        return self


class _SwitchView(nn.Module):
    """An :class:`ArenaMoeBlock`'s SwitchGLU as the family's code reaches it (``layer.mlp.switch_mlp``): its
    projections as :class:`_ProjectionView` s."""

    def __init__(self, layer: ArenaLayer):
        super().__init__()
        for projection in layer.projections:
            self[projection] = layer._projection_view(projection)


class SwitchGLUArena:
    """The residency manager's arena adapter for :func:`attach_arena`'s layers (one per MoE layer)."""

    def __init__(self, blocks: list[ArenaLayer]):
        slots = {block.num_slots for block in blocks}
        if len(slots) > 1:
            raise ValueError(f"SwitchGLUArena: the blocks hold {sorted(slots)} slots; one manager fills them all, "
                             f"so they hold one number of slots")
        self.blocks = blocks

    @property
    def shape(self) -> tuple[int, int]:
        """``(layers, slots)``: the blocks, and the slots each holds."""
        return len(self.blocks), self.blocks[0].num_slots if self.blocks else 0

    def write_slot(self, layer: int, slot: int, payload: dict[str, np.ndarray]) -> None:
        """One expert into ``[layer, slot]`` (keys and shapes of :meth:`ArenaSwitch.slot_layout`); float
        arrays cast to the arena's dtype through float32, packed quantized weights written as they are.

        Evaluated before it returns: a write built while the last one is still queued cannot update that
        one's output in place and copies the whole array (docs/benchmarks.md).

        Raises:
            ExpertPayloadError: the payload is not one expert of the layer's shapes (nothing written).
            ValueError: ``[layer, slot]`` is not a slot of the arenas (nothing written).
        """
        check_slot(self.shape, layer, slot)
        layout = self.blocks[layer].slot_layout()
        check_payload(payload, layout)
        mx.eval(*self._assign(layer, slot, payload, layout))

    def write_slots(self, layers, slots, payloads) -> list[BaseException | None]:
        """n experts, evaluated once; one error (:func:`kq_host.arena.checked_writes`: that expert not written)
        or None per write."""
        layers, slots, errors = checked_writes(self.shape, layers, slots, payloads,
                                               lambda layer: self.blocks[layer].slot_layout())
        written = []
        for layer, slot, payload, error in zip(layers, slots, payloads, errors):
            if error is None:
                written += self._assign(layer, slot, payload, self.blocks[layer].slot_layout())
        mx.eval(*written)
        return errors

    def _assign(self, layer: int, slot: int, payload, layout) -> list[mx.array]:
        """Writes the slot's arrays (lazily), ``payload`` already checked against ``layout``; returns the
        arrays to evaluate."""
        arrays = dict(_slot_arrays(self.blocks[layer].arena))
        for key, (_, dtype) in layout.items():
            arrays[key][slot] = from_numpy(np.asarray(payload[key], dtype)).astype(arrays[key].dtype)
        return list(arrays.values())


def _expert_count(switch: nn.Module) -> int:
    """E of a SwitchGLU / SwitchMLP: its first projection's leading axis."""
    return switch[_projection_names(switch)[0]]["weight"].shape[0]


def _checked_slots(num_slots, num_experts: int) -> int:
    """``num_slots`` as an int; ValueError naming it unless it is an int in ``[1, num_experts]``."""
    if not is_int(num_slots) or not 1 <= num_slots <= num_experts:
        raise ValueError(f"attach_arena: num_slots must be an int in [1, {num_experts}] (the layer's experts), got "
                         f"{num_slots!r}")
    return int(num_slots)


def _logical_shape(linear: nn.Module) -> tuple[int, int]:
    """``(out, in)`` of one expert of a SwitchLinear, quantized (its packed columns unpacked) or not."""
    out_dims, columns = linear["weight"].shape[-2:]
    bits = getattr(linear, "bits", None)
    return out_dims, columns * 32 // bits if bits else columns


def _slot_arrays(switch) -> list[tuple[str, mx.array]]:
    """``(payload key, [N, ...] array)`` of every per-expert array of a SwitchGLU's / SwitchMLP's projections:
    a float weight keyed by its projection, every other array ``"<projection>.<array>"``."""
    out = []
    for projection in _projection_names(switch):
        module = switch[projection]
        experts = module["weight"].shape[0]
        quantized = module.get("scales") is not None
        for name, value in module.items():
            if isinstance(value, mx.array) and value.ndim and value.shape[0] == experts:
                float_weight = name == "weight" and not quantized
                out.append((projection if float_weight else f"{projection}.{name}", value))
    return out


def _to_host(array: mx.array) -> np.ndarray:
    """A per-expert array as a payload holds it: floats as float32, anything else as it is."""
    return np.array(array.astype(mx.float32) if _host_dtype(array.dtype) == np.float32 else array)


def _host_dtype(dtype) -> np.dtype:
    """The NumPy dtype a payload array has for an arena array of ``dtype``: float32 for floats, else its own."""
    return np.dtype(np.float32) if mx.issubdtype(dtype, mx.floating) else np.dtype(str(dtype).split(".")[-1])


def _arena_projection(source: nn.Module, num_experts: int, num_slots: int) -> nn.Module:
    """A copy of an mlx-lm SwitchLinear / QuantizedSwitchLinear, its per-expert arrays cut to ``num_slots`` zero slots."""
    projection = copy.copy(source)
    for name, value in source.items():
        if isinstance(value, mx.array) and value.ndim and value.shape[0] == num_experts:
            projection[name] = mx.zeros((num_slots, *value.shape[1:]), value.dtype)
    return projection


def _path_key(path: str) -> tuple:
    """Sorts module paths in model order (``layers.2`` before ``layers.10``)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.split("."))


def _resolve(model: nn.Module, path: str):
    """The module or list at a dotted path (list items by index)."""
    node = model
    for part in path.split(".") if path else ():
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = _resolve(model, parent_path)
    if isinstance(parent, list):
        parent[int(name)] = new
    else:
        setattr(parent, name, new)


def attach_arena(model: nn.Module, num_slots: int, *, keep_experts: bool = True) -> list[ArenaLayer]:
    """Puts an arena at every ``SwitchGLU`` / ``SwitchMLP`` of an mlx-lm model; returns them, one per MoE layer,
    in model order.

    A block whose router kq knows (:data:`ROUTERS`) is wrapped whole by :class:`ArenaMoeBlock` (every rule of
    :data:`MISS_RULES`); every other family gets an :class:`ArenaSwitch` in place of its SwitchGLU (the rules
    of :data:`SEAM_RULES`), found by type wherever it sits (``switch_mlp``, ``experts``, ``switch_glu``,
    nested, inside lists). Each records its path (``module_path``): :meth:`ArenaSwitch.tensor_names`.

    Args:
        model: an mlx-lm MoE model, quantized or not.
        num_slots: arena slots per layer.
        keep_experts: keep each layer's own experts (for rule ``"stall"`` and ``expert_weights``).
            ``False`` drops them; with a model from ``mlx_lm.load(path, lazy=True)`` they are then never
            read, and only the other weights, the arenas and the experts' projection biases (gpt-oss's
            ``[E, out]`` a projection, for the tier) take memory.

    Raises:
        TypeError: the model has no SwitchGLU / SwitchMLP, or already runs on arenas.
        ValueError: ``num_slots`` is not an int in ``[1, E]`` (a layer's experts); no layer was replaced then.
    """
    switch_types = _switch_types()
    named = dict(model.named_modules())
    if any(isinstance(module, ArenaLayer) for module in named.values()):
        raise TypeError("attach_arena: the model already runs on arenas (attach_arena was called on it)")
    switches = sorted((path for path, module in named.items() if isinstance(module, switch_types)), key=_path_key)
    if not switches:
        raise TypeError(f"attach_arena: {type(model).__module__}.{type(model).__name__} has no SwitchGLU or "
                        f"SwitchMLP (mlx_lm.models.switch_layers): no MoE layer to put an arena in")
    for path in switches:  # checked before any layer is built: building one with keep_experts=False drops its experts
        _checked_slots(num_slots, _expert_count(named[path]))
    replaced = []  # (the path a layer takes the place of, the layer)
    for path in switches:
        parent_path, _, name = path.rpartition(".")
        parent = named.get(parent_path)
        if type(parent).__name__ in ROUTERS and name == "switch_mlp":
            replaced.append((parent_path, ArenaMoeBlock(parent, num_slots, keep_experts=keep_experts, module_path=path)))
        else:
            replaced.append((path, ArenaSwitch(named[path], num_slots, keep_experts=keep_experts, module_path=path)))
    for path, layer in replaced:
        _replace(model, path, layer)
    return [layer for _, layer in replaced]


class LayerWrapper(nn.Module):
    """A decoder layer wrapped: the wrapper holds it as ``layer`` (a child in the module tree) and hands on the
    attributes it lacks to it, as a family's model reads its decoder layers' attributes (``use_sliding``,
    ``self_attn``, ...). Subclasses add what runs around the layer's ``__call__``.

    Args:
        layer: the decoder layer wrapped, an ``mlx.nn.Module``.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def __getattr__(self, key: str):
        try:
            return super().__getattr__(key)
        except AttributeError:
            inner = self.get("layer")
            if inner is None:
                raise
            return getattr(inner, key)


class _LookaheadLayer(LayerWrapper):
    """A decoder layer, then the next MoE block's router on its output (normalised as that layer
    normalises its MoE input, its attention skipped): the next layer's predicted experts, ``predicted``."""

    def __init__(self, layer: nn.Module, following: nn.Module, norm: nn.Module):
        super().__init__(layer)
        self.following, self.norm = following, norm
        self.predicted = None
        self.prefetch = None  # attach_exact: called with the evaluated predictions, ids and scores

    def __setattr__(self, key: str, value) -> None:
        if key == "predicted":  # what the last pass predicted: no parameter
            object.__setattr__(self, key, value)
        else:
            super().__setattr__(key, value)

    def __call__(self, x, *args, **kwargs):
        out = self.layer(x, *args, **kwargs)
        following = self.following
        self.predicted, scores = following._route(following.block, self.norm(out))
        if self.prefetch is not None:
            mx.eval(self.predicted, scores)
            self.prefetch(np.array(self.predicted), np.array(scores.astype(mx.float32)))
        return out


def attach_lookahead(model: nn.Module, blocks: list[ArenaMoeBlock]) -> None:
    """After each decoder layer but the last, the next layer's router predicts its experts from this
    layer's output, in the same graph (:func:`pack_predictions` reads them); the output is unchanged.

    Args:
        model: an mlx-lm model whose blocks :func:`attach_arena` wrapped (``blocks``), one MoE block per
            layer. Call it last: the decoder layers are wrapped in turn.
    """
    seams = [index for index, block in enumerate(blocks) if not isinstance(block, ArenaMoeBlock)]
    if seams:
        raise ValueError(f"attach_lookahead: predicts with kq's own routers ({sorted(ROUTERS)}); layers {seams} run "
                         f"at the SwitchGLU seam ({blocks[seams[0]].module_path}), their family's router unknown")
    # mlx-lm's `model.layers` is a fresh slice of the inner model's list (pipeline_layers): wrap in the list.
    layers = getattr(model, "model", model).layers
    if len(blocks) != len(layers):
        raise ValueError(f"attach_lookahead: needs one MoE block per layer, got {len(blocks)} for {len(layers)}")
    for index in range(len(layers) - 1):
        layers[index] = _LookaheadLayer(layers[index], blocks[index + 1], layers[index + 1].post_attention_layernorm)


def pack_predictions(model: nn.Module) -> mx.array:
    """The predictions of the last pass (:func:`attach_lookahead`): int32 ``[L, T, K]``, layer l's experts
    as predicted after layer l - 1; layer 0's -1 (nothing runs before it)."""
    layers = model.layers
    predicted = [layer.predicted for layer in layers[:-1]]
    first = predicted[0].reshape(-1, predicted[0].shape[-1]).astype(mx.int32)
    return mx.stack([mx.full(first.shape, -1, mx.int32)] + [p.reshape(first.shape).astype(mx.int32)
                                                            for p in predicted])


class _CannotPutBack(Exception):
    """A cache found in a state its restorer cannot put back as it was (another pass wrote it since)."""


def _restorable(cache) -> bool:
    """Whether :func:`_restorer` can put ``cache`` back (without building a restorer)."""
    from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

    if isinstance(cache, CacheList):
        return all(_restorable(part) for part in cache.caches)
    return isinstance(cache, ArraysCache) or type(cache) is RotatingKVCache or cache.is_trimmable()


def _restorer(cache) -> tuple[Callable[[], None], list[mx.array]] | None:
    """What puts one mlx-lm cache back as it is now: ``(restore, saved)``, or None for a cache that cannot be put
    back. ``saved`` are the arrays it copied (lazily) to do so: evaluated before the pass writes the cache, they
    let that write reuse the cache's memory (:meth:`_CacheCheckpoint.settle`).

    A ``RotatingKVCache`` (a sliding window) gets its counters and arrays back, wrapped or not
    (:func:`_rotating_restorer`); any other trimmable cache (``KVCache`` and its kin) is trimmed back to its
    offset; an ``ArraysCache`` (the state of a linear-attention or state-space layer, replaced a pass at a time)
    gets its arrays back; a ``CacheList`` each of its caches.
    """
    from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

    if isinstance(cache, CacheList):
        parts = [_restorer(part) for part in cache.caches]
        if None in parts:
            return None
        return (lambda: [restore() for restore, _ in parts]), [array for _, saved in parts for array in saved]
    if isinstance(cache, ArraysCache):
        arrays, left_padding, lengths = list(cache.cache), cache.left_padding, cache.lengths

        def restore():
            cache.cache, cache.left_padding, cache.lengths = list(arrays), left_padding, lengths
        return restore, []
    if type(cache) is RotatingKVCache:
        return _rotating_restorer(cache)
    if cache.is_trimmable():
        offset = cache.offset
        return (lambda: cache.trim(cache.offset - offset)), []
    return None


def _rotating_restorer(cache) -> tuple[Callable[[], None], list[mx.array]]:
    """:func:`_restorer` of an mlx-lm ``RotatingKVCache``, before the window wraps or after.

    A pass of several tokens (or one that grows or trims the window) gives the cache new ``keys`` and ``values``
    arrays: the ones kept here are the cache's as they were. A pass of one token writes its entry in place, at
    one position of the window: ``cache.keys[..., i:i + 1, :] = k`` rebinds the very array object the cache
    (and any reference to it) holds to the written array, so what the position held is copied first, one entry
    a layer (a gather into an array of its own: a view would share, and keep, the whole window's memory), and
    written back. The counters (``offset``, ``_idx``, ``keep``, ``max_size``) are put back too. The cache is
    then the one before the pass, bit for bit.

    Restore raises :class:`_CannotPutBack` where the cache was written in place by more than that one pass
    since (a later pass's checkpoint must be restored first).
    """
    keys, values = cache.keys, cache.values
    counters = (cache.offset, cache._idx, cache.keep, cache.max_size)
    overwritten = None  # (position, keys there, values there): what a one-token pass overwrites in place
    if keys is not None:
        width = keys.shape[2]
        grows = cache.offset >= width and width < cache.max_size
        if not grows and width <= cache.max_size:  # mlx-lm's _update_in_place writes into these arrays
            position = cache.keep if cache._idx == cache.max_size else cache._idx
            where = mx.array([position])
            overwritten = (position, mx.take(keys, where, axis=2), mx.take(values, where, axis=2))

    def restore():
        offset, index = counters[:2]
        if cache.keys is keys and cache.values is values:  # the same arrays: written in place, or not at all
            if (cache.offset, cache._idx) != (offset, index):
                if overwritten is None or (cache.offset, cache._idx) != (offset + 1, overwritten[0] + 1):
                    raise _CannotPutBack
                position, old_keys, old_values = overwritten
                cache.keys[..., position:position + 1, :] = old_keys
                cache.values[..., position:position + 1, :] = old_values
        else:  # replaced: the arrays kept here are the cache's as they were
            cache.keys, cache.values = keys, values
        cache.offset, cache._idx, cache.keep, cache.max_size = counters

    return restore, [] if overwritten is None else list(overwritten[1:])


class _CacheCheckpoint:
    """Caches as they were when added; :meth:`restore` puts every one back (a pass undone).

    Checkpoints of passes run one after another are restored newest first."""

    def __init__(self, caches=()):
        self._restorers: dict[int, tuple[object, Callable[[], None] | None]] = {}
        self._pending: list[mx.array] = []
        for cache in caches:
            self.add(cache)

    def add(self, cache) -> None:
        if id(cache) not in self._restorers:
            restorer = _restorer(cache)
            self._restorers[id(cache)] = (cache, None if restorer is None else restorer[0])
            if restorer is not None:
                self._pending += restorer[1]

    def restorable(self) -> bool:
        return all(restore is not None for _, restore in self._restorers.values())

    def arrays(self) -> list[mx.array]:
        """The copies the restorers made and :meth:`settle` has not evaluated: evaluated with (before) the pass,
        or at the latest when restored."""
        return list(self._pending)

    def settle(self) -> None:
        """Evaluates the restorers' copies now: call it where the caches' arrays are evaluated already (no wait),
        before the pass, so that a one-token pass writes the cache in place (a copy still to be made would hold
        the array and have the write copy the whole window)."""
        if self._pending:
            mx.eval(self._pending)
            self._pending = []

    def start(self) -> None:
        """Dispatches the restorers' copies (``mx.async_eval``) where the caches' arrays are still being computed
        (an overlapped pass): they run after those, and once they have run before the pass is dispatched, the
        pass writes the cache in place."""
        if self._pending:
            mx.async_eval(self._pending)

    def restore(self) -> None:
        """Puts every cache back; raises RuntimeError naming the caches that cannot be put back."""
        stuck = [type(cache).__name__ for cache, restore in self._restorers.values() if restore is None]
        for cache, restore in self._restorers.values():
            if restore is not None:
                try:
                    restore()
                except _CannotPutBack:
                    stuck.append(type(cache).__name__)
        self._restorers.clear()
        self._pending = []
        if stuck:
            raise RuntimeError(f"the pass failed after its {', '.join(stuck)} caches took its tokens, and those "
                               f"cannot be cut back: make a new cache (mlx_lm.models.cache.make_prompt_cache) and "
                               f"feed the tokens again")


class _SharedCheckpoint:
    """The current pass's checkpoint, shared by a model's guarded decoder layers."""

    def __init__(self):
        self.checkpoint = _CacheCheckpoint()


class _PassGuardLayer(LayerWrapper):
    """A decoder layer that records the caches it is handed; when it raises, every cache the pass has
    touched (from the first decoder layer on) is put back as it was before the pass, then the error goes on."""

    def __init__(self, layer: nn.Module, shared: _SharedCheckpoint, first: bool):
        super().__init__(layer)
        self._shared, self._first = shared, first

    def __call__(self, *args, **kwargs):
        from mlx_lm.models.cache import _BaseCache

        if self._first:
            self._shared.checkpoint = _CacheCheckpoint()
        checkpoint = self._shared.checkpoint
        for value in (*args, *kwargs.values()):
            if isinstance(value, _BaseCache):
                checkpoint.add(value)
        checkpoint.settle()  # the caches hold the last pass, evaluated by the caller: no wait
        try:
            return self.layer(*args, **kwargs)
        except BaseException as error:
            try:
                checkpoint.restore()
            except RuntimeError as stuck:
                raise stuck from error
            raise


def _check_blocks(function: str, model: nn.Module, blocks: list[ArenaLayer]) -> None:
    """ValueError unless ``blocks`` are the arenas :func:`attach_arena` put in ``model``, every one."""
    inside = {id(module) for module in model.modules() if isinstance(module, ArenaLayer)}
    given = {id(block) for block in blocks} if isinstance(blocks, (list, tuple)) else set()
    if not inside or given != inside or len(blocks) != len(inside):
        raise ValueError(f"{function}: blocks must be attach_arena(model)'s layers, every one ({len(inside)} in the "
                         f"model); got {len(blocks) if isinstance(blocks, (list, tuple)) else type(blocks).__name__}"
                         f"{' of another model' if isinstance(blocks, (list, tuple)) and given - inside else ''}")


def _check_manager_shape(function: str, manager, blocks: list[ArenaLayer]) -> None:
    """ValueError where ``manager`` is not of the blocks' layers and slots."""
    if manager.num_layers != len(blocks) or any(block.num_slots != manager.num_slots for block in blocks):
        raise ValueError(f"{function}: the manager has {manager.num_layers} layers of {manager.num_slots} slots; "
                         f"the model {len(blocks)} blocks of {sorted({b.num_slots for b in blocks})}")


def _checked_read_retries(function: str, read_retries) -> int:
    """``read_retries`` as an int; ValueError naming it where it is no int >= 0."""
    if not is_int(read_retries) or read_retries < 0:
        raise ValueError(f"{function}: read_retries must be an int >= 0, got {read_retries!r}")
    return int(read_retries)


def _check_cache(function: str, cache, model: nn.Module) -> None:
    """ValueError naming ``cache`` where it is not ``model``'s cache: a list of one cache a layer."""
    from mlx_lm.models.cache import make_prompt_cache

    layers = len(make_prompt_cache(model))
    if (not isinstance(cache, (list, tuple)) or len(cache) != layers
            or not all(hasattr(layer_cache, "state") for layer_cache in cache)):
        wrong_length = isinstance(cache, (list, tuple)) and len(cache) != layers
        got = f"{len(cache)} caches" if wrong_length else f"{cache!r:.80}"
        raise ValueError(f"{function}: cache must be the model's cache, a list of one cache a layer ({layers} "
                         f"layers: mlx_lm.models.cache.make_prompt_cache(model)), got {got}")


def _vocabulary_size(model: nn.Module) -> int | None:
    """The token ids ``model`` takes: the rows of its token embedding (the embedding named ``embed_tokens``, else
    its first), else its args' ``vocab_size``; None where it has neither."""
    embeddings = [(path, module) for path, module in model.named_modules()
                  if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding))]
    if embeddings:
        _, embedding = next(((path, module) for path, module in embeddings
                             if path.rpartition(".")[2] == "embed_tokens"), embeddings[0])
        return int(embedding.weight.shape[0])
    vocabulary = getattr(getattr(model, "args", None), "vocab_size", None)
    if is_int(vocabulary) and vocabulary > 0:
        return int(vocabulary)
    return None


def _token_ids(function: str, prompt, vocabulary: int | None) -> list[int]:
    """``prompt`` (a sequence of ints or a 1-D integer array) as ints in ``[0, vocabulary)``; ValueError naming
    ``prompt`` otherwise (an empty prompt, anything else, an id outside the vocabulary)."""
    if isinstance(prompt, mx.array):
        prompt = np.array(prompt)
    ids = None
    if isinstance(prompt, (Sequence, np.ndarray)) and not isinstance(prompt, (str, bytes)):
        try:
            ids = np.asarray(prompt)
        except (ValueError, TypeError):  # ragged, or items NumPy cannot take
            ids = None
    if ids is not None and ids.ndim == 1 and ids.size == 0:
        raise ValueError(f"{function}: the prompt must hold at least one token")
    if ids is None or ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(f"{function}: prompt must be token ids, a list of ints or a 1-D integer array, got "
                         f"{prompt!r:.80}")
    outside = (ids < 0) | (ids >= vocabulary) if vocabulary is not None else ids < 0
    if outside.any():
        position = int(np.argmax(outside))
        raise ValueError(f"{function}: prompt's token ids must lie in [0, {vocabulary}) (the model's vocabulary), "
                         f"got {int(ids[position])} at position {position}")
    return ids.tolist()


def _decoder_layers(model: nn.Module, blocks: list[ArenaLayer]) -> list:
    """The model's list of decoder layers: where the first arena's path is indexed (``model.layers``)."""
    parts = blocks[0].module_path.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if index is not None:
        layers = _resolve(model, ".".join(parts[:index]))
        if isinstance(layers, list):
            return layers
    return getattr(model, "model", model).layers


def attach_exact(model: nn.Module, blocks: list[ArenaLayer], manager, *, lookahead: bool | None = None,
                 prefetch_budget: int | None = None, timeout: float | None = None) -> None:
    """Makes the model exact at any residency, layer by layer: each block evaluates its routing, and
    ``manager.acquire`` makes every routed expert resident before the block's experts run (the misses
    read on the critical path); with ``lookahead`` (None: where kq knows every layer's router,
    :class:`ArenaMoeBlock`), after each layer but the last the next layer's predicted experts are
    evaluated and ``manager.prefetch`` starts reading them (at most ``prefetch_budget`` a layer). The logits are the model's with every expert resident, bit for bit.
    Call ``manager.next_token()`` after each token. Called again, it binds every layer (and the look-ahead's
    prefetch) to the new ``manager`` and options.

    A pass that raises (a read failed or timed out: :class:`~kq_host.residency.PreloadError`) leaves every
    KV cache as it was before the pass: the decoder layers are wrapped so that each records its cache's
    state, and the caches the pass touched are cut back before the error goes on. Running the same tokens
    again (once the reads can land) gives the model's logits. A sliding window (``RotatingKVCache``) is put back
    bit for bit, wrapped or not. A cache that cannot be cut back turns the error into a RuntimeError saying so.

    Args:
        model: an mlx-lm model whose MoE blocks :func:`attach_arena` wrapped (``blocks``, one per layer).
        manager: a :class:`kq_host.residency.ResidencyManager` of ``len(blocks)`` layers whose loader
            fills :class:`SwitchGLUArena` ``(blocks)``.
        timeout: seconds each ``acquire`` waits for its reads (None: no limit); past it the pass raises
            PreloadError listing the reads still out.

    Raises:
        ValueError: ``blocks`` are not the model's arenas (every one), the manager's shape is not the
            blocks', ``timeout`` is not None or a number >= 0, or ``lookahead=True`` with layers at the
            SwitchGLU seam.
    """
    deadline_of("attach_exact", timeout)  # the manager's own check of a timeout
    _check_blocks("attach_exact", model, blocks)
    _check_manager_shape("attach_exact", manager, blocks)
    for layer, block in enumerate(blocks):
        block.rule, block.manager, block.layer, block.timeout = "exact", manager, layer, timeout
    if lookahead is None:
        lookahead = all(isinstance(block, ArenaMoeBlock) for block in blocks)
    seams = [index for index, block in enumerate(blocks) if not isinstance(block, ArenaMoeBlock)]
    if lookahead and seams:
        raise ValueError(f"attach_exact: lookahead predicts with kq's own routers ({sorted(ROUTERS)}); layers {seams} "
                         f"run at the SwitchGLU seam ({blocks[seams[0]].module_path}): pass lookahead=False")
    layers = _decoder_layers(model, blocks)
    # A call again (another manager, other options) starts from the decoder layers as attach_exact found them.
    for index, layer in enumerate(layers):
        if isinstance(layer, _PassGuardLayer):
            layers[index] = layer.layer
    if lookahead and not isinstance(layers[0], _LookaheadLayer):
        attach_lookahead(model, blocks)
    for layer, wrapped in enumerate(layers[:-1]):
        if isinstance(wrapped, _LookaheadLayer):  # predicting still (the same graph), prefetching only if asked
            wrapped.prefetch = (functools.partial(manager.prefetch, layer + 1, budget=prefetch_budget)
                                if lookahead else None)
    shared = _SharedCheckpoint()
    for index in range(len(layers)):
        layers[index] = _PassGuardLayer(layers[index], shared, index == 0)


def attach_tier(blocks: list[ArenaLayer], tier) -> None:
    """Gives every block the low-precision copy of its layer's experts, for rule ``"tier"``.

    Args:
        blocks: :func:`attach_arena`'s wrappers, one per layer.
        tier: a :class:`kq_host.tier.Tier` of ``len(blocks)`` layers and the blocks' expert count,
            projections named as the layers' (``block.projections``: ``gate_proj``, ``up_proj``,
            ``down_proj`` for a SwitchGLU, ``fc1``, ``fc2`` for a SwitchMLP); its scales and biases go
            to the device in the arena's float dtype. Projection biases (gpt-oss) are the layer's own
            experts', which :func:`attach_arena` keeps (:attr:`ArenaLayer.expert_biases`) even with
            ``keep_experts=False``.

    Raises:
        ValueError: ``tier`` is no Tier, its bits or group size disagree with its arrays
            (:func:`kq_host.tier.check_tier`), or its layers, experts, projections or their shapes do not
            match the blocks. No block's tier is changed then.
    """
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from kq_host.tier import check_tier

    check_tier(tier, "attach_tier: the tier")
    if tier.num_layers != len(blocks) or any(tier.num_experts != b.num_experts for b in blocks):
        raise ValueError(f"attach_tier: the tier holds {tier.num_layers} layers of {tier.num_experts} experts, the "
                         f"model {len(blocks)} MoE layers of {blocks[0].num_experts}")
    for layer, block in enumerate(blocks):
        if set(tier.weights) != set(block.projections):
            raise ValueError(f"attach_tier: the tier's projections are {sorted(tier.weights)}, the layers' "
                             f"{block.projections}")
        for projection, weight in tier.weights.items():
            out_dims, words = weight.packed.shape[-2:]
            want = _logical_shape(block.arena[projection])
            if (out_dims, words * 32 // tier.bits) != want:
                raise ValueError(f"attach_tier: the tier's {projection} experts are [{out_dims}, "
                                 f"{words * 32 // tier.bits}] (out, in), layer {layer}'s {list(want)}")
    lows = []
    for layer, block in enumerate(blocks):
        low = copy.copy(block.arena)
        for projection, weight in tier.layer(layer).items():
            arena_weight = block.arena[projection]["weight"]
            float_dtype = arena_weight.dtype if mx.issubdtype(arena_weight.dtype, mx.floating) else mx.float32
            out_dims, words = weight.packed.shape[1:]
            linear = QuantizedSwitchLinear(words * 32 // tier.bits, out_dims, tier.num_experts, bias=False,
                                           group_size=tier.group_size, bits=tier.bits)
            linear["weight"] = mx.array(weight.packed)
            linear["scales"], linear["biases"] = (mx.array(np.asarray(a, np.float32)).astype(float_dtype)
                                                  for a in (weight.scales, weight.biases))
            if projection in block.expert_biases:  # a projection bias (gpt-oss): every expert's, full precision
                linear["bias"] = block.expert_biases[projection]
            setattr(low, projection, linear)
        lows.append(low)
    for block, low in zip(blocks, lows):
        block.tier = low


class _Deferred:
    """What a compiled pass on a CPU stream (or any resident pass) left for :func:`pack_reports`: the ``last``
    and ``last_mix`` it set (the report is this pass's while the layer still holds them) and its misses, bool
    ``[..., K]`` (None: a resident pass, nothing missed)."""

    __slots__ = ("last", "last_mix", "miss")

    def __init__(self, last: tuple, last_mix: mx.array, miss: mx.array):
        self.last, self.last_mix, self.miss = last, last_mix, miss


@functools.lru_cache(maxsize=None)
def _rank_misses_graph() -> Callable:
    """:func:`kq_mlx.route_shed_columns.rank_misses` compiled (traced once per shape)."""
    return mx.compile(route_shed_columns.rank_misses)


@functools.lru_cache(maxsize=None)
def _pack_deferred_graph() -> Callable:
    """Every layer's report of a token, the prestage lists ranked in one call over the layers' rows, packed
    as :func:`kq_mlx.report_pack.pack` packs them: one compiled graph (traced once per layer count and shape)."""
    def pack(ids, scores, miss, mix):
        joined = {"ids": mx.concatenate(ids, axis=0), "scores": mx.concatenate(scores, axis=0),
                  "mix": mx.concatenate(mix, axis=0)}
        joined["miss_ids"], joined["miss_scores"] = route_shed_columns.rank_misses(
            joined["ids"], joined["scores"], mx.concatenate(miss, axis=0))
        return report_pack.pack_joined(joined, len(ids))
    return mx.compile(pack)


@functools.lru_cache(maxsize=None)
def _pack_resident_graph() -> Callable:
    """:func:`_pack_deferred_graph`'s packing of a token whose every layer missed nothing: the prestage lists
    are route_shed's empty ones (ids -1, scores +0.0), nothing ranked; one compiled graph."""
    def pack(ids, scores, mix):
        joined = {"ids": mx.concatenate(ids, axis=0), "scores": mx.concatenate(scores, axis=0),
                  "mix": mx.concatenate(mix, axis=0)}
        joined["miss_ids"] = mx.full(joined["ids"].shape, -1, mx.int32)
        joined["miss_scores"] = mx.zeros(joined["ids"].shape, mx.float32)
        return report_pack.pack_joined(joined, len(ids))
    return mx.compile(pack)


class _Published:
    """A slot table row as :func:`set_tables` last handed it to a block: its bytes (``key``: an unchanged row is
    one comparison), the array it made, whether it holds every expert in the block's arena (``full``: every
    entry in ``[0, num_slots)``) and then, unless it is the identity, the row as uint32 slots on the device
    (``remap``, the gather of the resident path)."""

    __slots__ = ("key", "table", "full", "remap")

    def __init__(self, row: np.ndarray, table: mx.array, num_slots: int):
        self.key, self.table = row.tobytes(), table
        self.full = bool(holds_every_expert(row, num_slots))
        identity = self.full and np.array_equal(row, np.arange(row.size))
        self.remap = mx.array(row.astype(np.uint32)) if self.full and not identity else None


@functools.lru_cache(maxsize=16)
def _no_misses(shape: tuple[int, ...]) -> tuple[mx.array, mx.array, mx.array]:
    """A pass of ``shape`` ``[..., K]`` that missed nothing: route_shed's prestage list (int32 -1, float32 +0.0)
    and the misses (bool False), evaluated once per shape."""
    arrays = (mx.full(shape, -1, mx.int32), mx.zeros(shape, mx.float32), mx.zeros(shape, mx.bool_))
    mx.eval(arrays)
    return arrays


@functools.lru_cache(maxsize=16)
def _position_scores(shape: tuple[int, ...]) -> mx.array:
    """:class:`ArenaSwitch`'s pseudo scores for ``shape`` ``[..., K]``: ``(K - k) / K``, float32, evaluated."""
    k = shape[-1]
    scores = mx.broadcast_to(mx.arange(k, 0, -1, dtype=mx.float32) / k, shape)
    mx.eval(scores)
    return scores


@functools.lru_cache(maxsize=None)
def _mix_all_kept_graph() -> Callable:
    """:func:`kq_mlx.route_shed_columns.mix_all_kept` compiled (traced once per shape)."""
    return mx.compile(route_shed_columns.mix_all_kept)


_INT32 = np.iinfo(np.int32)


def _slot_ids(caller: str, argument: str, tables: np.ndarray, num_slots: np.ndarray,
              row_name: Callable[[int], str]) -> np.ndarray:
    """``tables``, a host array ``[L, E]`` (its shape checked), as int32 slot ids, checked in one vectorised pass
    over its rows (:func:`_as_slot_ids`, then :func:`_check_one_expert_a_slot`)."""
    ids = _as_slot_ids(caller, argument, tables, row_name)
    _check_one_expert_a_slot(caller, ids, num_slots, row_name)
    return ids


def _as_slot_ids(caller: str, argument: str, tables: np.ndarray, row_name: Callable[[int], str]) -> np.ndarray:
    """``tables`` ``[L, E]`` as int32 (no copy for int32); ValueError naming ``argument`` (and through ``row_name``
    the row) where it holds values that are no int32: floats, NaN, bools, strings, integers past int32 (each would
    truncate or wrap into some slot)."""
    kind = tables.dtype.kind
    if kind not in "iu":
        detail = ""
        if kind == "f" and tables.size:
            with np.errstate(invalid="ignore"):
                bad = (~np.isfinite(tables) | (tables != np.trunc(tables)) | (tables < _INT32.min)
                       | (tables > _INT32.max))
            if bad.any():
                row, expert = (int(i) for i in np.argwhere(bad)[0])
                detail = f": {row_name(row)}holds {tables[row, expert]} for expert {expert}, which is no slot"
        raise ValueError(f"{caller}: {argument} must hold integer slot ids, got {tables.dtype}{detail} (a slot id is "
                         f"an int32; -1: not resident)")
    if tables.size and tables.dtype.itemsize >= 4 and tables.dtype != np.int32:
        outside = (tables < _INT32.min) | (tables > _INT32.max)
        if outside.any():
            row, expert = (int(i) for i in np.argwhere(outside)[0])
            raise ValueError(f"{caller}: {row_name(row)}holds {int(tables[row, expert])} for expert {expert}, outside "
                             f"int32 (it would wrap into another slot)")
    return tables.astype(np.int32, copy=False)


def _check_one_expert_a_slot(caller: str, ids: np.ndarray, num_slots: np.ndarray,
                             row_name: Callable[[int], str]) -> None:
    """ValueError naming the row (``row_name``) where two experts of a row of ``ids`` (int32 ``[L, E]``) share a
    slot in ``[0, num_slots[row])``; one vectorised pass over the rows. Values outside that range (-1, or past
    the arena) are experts not resident, any number of them."""
    held = np.where((ids >= 0) & (ids < num_slots[:, None]), ids, -1)
    ordered = np.sort(held, axis=-1)
    shared = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if shared.any():
        row = int(np.argmax(shared.any(axis=-1)))
        slot = int(ordered[row, 1:][shared[row]][0])
        first, second = (int(e) for e in np.flatnonzero(held[row] == slot)[:2])
        raise ValueError(f"{caller}: {row_name(row)}puts experts {first} and {second} in slot {slot}; a slot holds "
                         f"one expert")


def set_tables(blocks: list[ArenaLayer], tables: np.ndarray) -> None:
    """Hands each block its layer's slot table for the next forward pass (``tables``: int ``[L, E]``).

    Only the rows that changed since this function last set them travel to the device, each as an array
    of its own, so an unchanged arena (every step at full residency) adds nothing to the next graph. A
    block whose ``slot_table`` was set some other way since always gets its row. Whether a row holds every
    expert in the block's arena is decided here, once a row: such a block runs its resident path
    (:attr:`ArenaLayer.full_path`) until a row with a miss is set.

    Args:
        blocks: :func:`attach_arena`'s layers, one a row.
        tables: any integer array ``[L, E]`` (NumPy, MLX, nested lists) of values that fit int32: row ``l`` is
            block ``l``'s slot of each expert, a value outside ``[0, num_slots)`` (-1) an expert not resident
            (``ResidencyManager.snapshot()`` / ``step``'s tables).

    Raises:
        ValueError: ``tables`` of another shape, of values that are no int32 (floats, NaN, bools, strings,
            integers past int32: each would truncate or wrap into some slot), or with a row that puts two experts
            in one slot (the arena would run one on the other's weights and report no miss), naming the row, its
            layer and what is wrong. Checked before any block's table changes, in one vectorised pass over the
            rows that changed (a row as published before was checked then).
    """
    try:
        given = np.asarray(tables)
    except (TypeError, ValueError, RuntimeError):  # ragged, or an array NumPy cannot take
        given = None
    if (given is None or given.ndim != 2 or given.shape[0] != len(blocks)
            or any(b.num_experts != given.shape[1] for b in blocks)):
        got = f"shape {given.shape}" if given is not None else f"{tables!r:.80}"
        raise ValueError(f"set_tables: tables must be int [L, E] with L = {len(blocks)} blocks and E = "
                         f"{blocks[0].num_experts if blocks else '?'} experts, got {got}")
    def row_name(row: int) -> str:
        return f"tables[{row}] (layer {row}, {blocks[row].module_path}) "

    tables = _as_slot_ids("set_tables", "tables", given, row_name)
    changed = []  # the rows to send: a row as published before was checked then
    for index, (block, row) in enumerate(zip(blocks, tables)):
        published = block._published
        if published is None or published.table is not block.slot_table or published.key != row.tobytes():
            changed.append(index)
    if changed:
        _check_one_expert_a_slot("set_tables", tables[changed], np.array([blocks[i].num_slots for i in changed]),
                                 lambda row: row_name(changed[row]))
    for index in changed:
        block, row = blocks[index], tables[index]
        object.__setattr__(block, "_slot_table", from_numpy(row))
        block._published = _Published(row, block.slot_table, block.num_slots)


def pack_reports(blocks: list[ArenaLayer]) -> mx.array:
    """Every block's last routing and misses in one array of the graph, so the host reads a token's
    reports back in one transfer (:meth:`kq_host.residency.LayerReport.from_packed`).

    A few ops a token however many layers there are (:mod:`kq_mlx.report_pack`: one kernel launch on
    MLX's CUDA backend). After compiled passes on a CPU stream (:attr:`ArenaLayer.compiled`) the prestage
    lists the layers left unranked are ranked here, every layer's rows in one call, in one compiled graph.

    Returns:
        int32 ``[5, L, T, K]`` (:mod:`kq_core.reports`): ids, scores, miss ids, miss scores and the scores
        of the entries served (float fields as float32 bits); ``T`` the rows of the last pass.
    """
    deferred = [getattr(block, "_deferred", None) for block in blocks]
    # On MLX-CUDA a pass leaves nothing to rank (route_shed is a kernel there; a resident pass's `last` holds
    # its report), and the layers' fields go in one launch below, where the graphs here launch a copy each.
    if blocks and not report_pack.one_launch() and all(d is not None and d.last is block.last
                                                       and d.last_mix is block.last_mix
                                                       for d, block in zip(deferred, blocks)):
        ids = [d.last[0] for d in deferred]
        if len({(tuple(a.shape), a.dtype) for a in ids}) == 1:
            scores, mix = [d.last[1] for d in deferred], [d.last_mix for d in deferred]
            if all(d.miss is None for d in deferred):
                return _pack_resident_graph()(ids, scores, mix)
            nothing = _no_misses(tuple(ids[0].shape))[2]
            return _pack_deferred_graph()(ids, scores, [nothing if d.miss is None else d.miss for d in deferred],
                                          mix)
    lasts = [block.last for block in blocks]
    return report_pack.pack({"ids": [inds for inds, _, _ in lasts], "scores": [scores for _, scores, _ in lasts],
                             "miss_ids": [shed.miss_ids for _, _, shed in lasts],
                             "miss_scores": [shed.miss_scores for _, _, shed in lasts],
                             "mix": [block.last_mix for block in blocks]})


def _read_token(token: mx.array) -> int:
    """The host's read of a pass's greedy token: the wait for the pass."""
    return int(token.item())


def _resident_reports(passes: list[list[tuple]]) -> list[LayerReport]:
    """The reports of passes that ran every layer resident, each given as its layers' report fields
    (:data:`kq_mlx.report_pack.INPUT_FIELDS`, one shape), packed in one launch and read back in one transfer:
    the bits :func:`pack_reports` gives each pass. Passes of more than one are padded to
    :data:`RESIDENT_REPORTS_BATCH` with the last one, so the packing takes one form however many there are;
    a pass alone (a prompt's, of other rows) is packed alone."""
    layers = len(passes[0])
    padded = passes + [passes[-1]] * (RESIDENT_REPORTS_BATCH - len(passes) if len(passes) > 1 else 0)
    packed = np.array(report_pack.pack({name: [fields[layer][i] for fields in padded for layer in range(layers)]
                                        for i, name in enumerate(report_pack.INPUT_FIELDS)}))
    packed = packed.reshape(packed.shape[0], len(padded), layers, *packed.shape[2:])
    return [LayerReport.from_packed(packed[:, p]) for p in range(len(passes))]


def prefill(model: nn.Module, blocks: list[ArenaLayer], manager, prompt, cache, *, timeout: float | None = None,
            read_retries: int = 2, step_size: int = 2048) -> mx.array:
    """Runs a prompt through the arenas exactly, layer by layer, each routed expert read once.

    Each layer's routing over the prompt's tokens is evaluated and its routed experts are made resident by
    ``manager.acquire`` before they run; when they exceed the layer's slots they run in chunks that fit,
    the resident first, the tokens grouped by expert (:meth:`ArenaLayer._exact`): each missing expert is
    read once a pass. The logits and the cache are the unmodified model's, bit for bit, at any residency.
    The prompt goes in passes of ``step_size`` tokens (mlx-lm's ``prefill_step_size``); after each pass
    ``manager.next_token()`` ends it. The blocks' rules and exact settings are as before on return, their
    tables the manager's.

    Args:
        model: the mlx-lm model, its experts on :func:`attach_arena`'s ``blocks``.
        manager: the :class:`~kq_host.residency.ResidencyManager` filling the arenas (:class:`SwitchGLUArena`).
        prompt: token ids in the model's vocabulary (its embedding's rows), a sequence of ints or a 1-D integer
            array (at least one).
        cache: the model's cache (``mlx_lm.models.cache.make_prompt_cache(model)``), extended by the prompt.
        timeout: seconds each ``acquire`` may wait for its reads (None: no limit).
        read_retries: times a failed read is read again (the routing not credited again) before the error.
        step_size: the most tokens a pass.

    Returns:
        float ``[V]``: the logits after the prompt's last token (the model's dtype), evaluated.

    Raises:
        ValueError: an empty prompt, an id outside the vocabulary, a bad ``step_size``, ``timeout``,
            ``read_retries`` or ``cache``, ``blocks`` that are not the model's arenas (every one), or a
            manager of another shape.
        PreloadError: a read failed ``read_retries`` more times or was out past ``timeout`` (the message
            names the layer and the experts); the cache is then as before the pass that failed (a
            RuntimeError says so where a cache cannot be cut back).
    """
    deadline_of("prefill", timeout)  # the manager's own check of a timeout
    read_retries = _checked_read_retries("prefill", read_retries)
    if not is_int(step_size) or step_size < 1:
        raise ValueError(f"prefill: step_size must be an int >= 1, got {step_size!r}")
    tokens = _token_ids("prefill", prompt, _vocabulary_size(model))
    _check_cache("prefill", cache, model)
    _check_blocks("prefill", model, blocks)
    _check_manager_shape("prefill", manager, blocks)
    with _layer_by_layer(blocks, manager, timeout=timeout, read_retries=read_retries):
        for start in range(0, len(tokens), step_size):
            with _cache_restored_on_error("prefill", cache, read_retries):
                logits = model(mx.array([tokens[start:start + step_size]]), cache=cache)[0, -1]
                mx.eval(logits, [c.state for c in cache])
            manager.next_token()
    return logits


@contextlib.contextmanager
def _cache_restored_on_error(caller: str, cache, read_retries: int):
    """Yields the caches' checkpoint (:class:`_CacheCheckpoint`) for a pass run inside; on any error the caches
    go back to it (a RuntimeError says so where one cannot be cut back), and a PreloadError goes on named by
    ``caller``, saying how many times each failed read was retried (unless a read again was still out)."""
    checkpoint = _CacheCheckpoint(cache)
    checkpoint.settle()  # each pass run so starts from evaluated caches: no wait
    try:
        yield checkpoint
    except BaseException as error:
        try:
            checkpoint.restore()
        except RuntimeError as stuck:
            raise stuck from error
        if isinstance(error, PreloadError):
            retried = (f" (each failed read retried {read_retries} times)" if error.failed and not error.pending
                       else "")
            raise PreloadError(f"{caller}: {error}{retried}", error.failed, error.pending) from error
        raise


@contextlib.contextmanager
def _layer_by_layer(blocks: list[ArenaLayer], manager, *, timeout: float | None, read_retries: int):
    """The blocks under rule ``"exact"``, bound to ``manager`` (layer by layer, each routed expert made
    resident before it runs, its routing credited); on leaving, their rules and exact settings as before and
    their tables the manager's."""
    settings = ("rule", "manager", "layer", "timeout", "read_retries")
    saved = [tuple(getattr(block, name) for name in settings) for block in blocks]
    try:
        for layer, block in enumerate(blocks):
            block.rule, block.manager, block.layer, block.timeout = "exact", manager, layer, timeout
            block.read_retries = read_retries
        yield
    finally:
        for block, values in zip(blocks, saved):
            for name, value in zip(settings, values):
                setattr(block, name, value)
        set_tables(blocks, manager.snapshot())


def generate_greedy(model: nn.Module, blocks: list[ArenaLayer], manager, prompt: list[int], max_tokens: int,
                    *, overlap: bool = True, exact: bool = False, timeout: float | None = None,
                    read_retries: int = 2, on_token: Callable[[int], None] | None = None,
                    prefill_prompt: bool | None = None, cache: list | None = None,
                    stop_tokens: Collection[int] = ()) -> list[int]:
    """Greedy decode through the arenas as an engine runs it: one readback per token, the host's boundary
    overlapped with the next token.

    Each token's graph ends in its greedy token and :func:`pack_reports` (but where every layer ran its
    resident path: below), evaluated together with ``mx.async_eval``; the next token's input is that
    token, on the device. With ``overlap`` the next
    token's graph is built while this token runs, this token is read back, and the next token is
    dispatched (before the read where every layer of this token ran its resident path: it cannot miss)
    before this token's boundary (``manager.step`` on its reports, :func:`set_tables`), so it
    runs with the tables of the boundary before; a slot the boundary writes
    while a token is in flight is copied, not changed under it (MLX arrays are never mutated while a
    graph holds them). Without ``overlap`` each boundary comes before the next token. A token whose every
    layer ran its resident path (it cannot miss, and the manager has nothing to read or evict) reads back
    its greedy token alone: its reports are packed and read with others, :data:`RESIDENT_REPORTS_BATCH` at
    a time, each handed to its own ``manager.step`` in order and before any later token's report (all of
    them before this function returns or raises): ``on_token`` may see such a token before the manager
    has its report.

    With ``exact`` a token is kept only if it ran with every routed expert resident: when its reports
    show misses, the pass goes with its report (the layers after its first miss ran on a wrong input, so
    their routing is not the token's: nothing of it is credited or read), the cache is put back as it was
    before the token (the next token's entries, built on it, with it) and the token runs again layer by
    layer, as :func:`prefill` runs a prompt: each layer's routing evaluated, credited and its routed experts
    made resident (``manager.acquire``) before they run, so a token runs at most twice, and an arena too
    small for one token's experts runs them in chunks that fit. While tokens need reads
    (the last one missed, or read experts running layer by layer), the next one runs layer by layer at
    once, not overlapped (its routing credited by ``acquire``, the token ended by ``manager.next_token()``);
    the first token that reads nothing goes back to the overlapped graph. The
    tokens are the unmodified model's at any residency: each miss is read on the token's critical path. A missed expert whose read failed (this token, or earlier: the
    manager then backs off from it) is read again at once through ``manager.acquire``, up to
    ``read_retries`` times; a read that keeps failing raises PreloadError naming it, and the manager
    serves a later call once the reads succeed again.

    With ``prefill_prompt`` (default: ``exact``) the prompt but its last token goes through :func:`prefill`
    (layer by layer, each routed expert read once, exactly), then its last token as the first pass of
    the loop: mlx-lm's ``generate_step`` order, so with ``exact`` the tokens are ``mlx_lm.generate``'s
    greedy ones. Without it the prompt goes in one pass (``exact=False``: run under the rule) or a token
    a pass (``exact=True``).

    Args:
        model: the mlx-lm model, its blocks wrapped by :func:`attach_arena` (``blocks``).
        manager: the :class:`~kq_host.residency.ResidencyManager` filling the blocks' arenas.
        prompt: the prompt's token ids in the model's vocabulary, a sequence of ints or a 1-D integer array (at
            least one); max_tokens: tokens to generate, an int (at least one).
        overlap: dispatch the next token before this token's boundary.
        exact: run a token again until it misses nothing (needs caches that can be put back: KV caches,
            sliding windows (``RotatingKVCache``, wrapped or not) and the arrays caches of linear-attention and
            state-space layers).
        timeout: with ``exact``, seconds each wait for reads (``acquire``) may take (None: no limit).
        read_retries: with ``exact``, times a missed expert whose read failed is read again before the
            error (0: the first failure raises).
        on_token: called with each generated id as it is kept (to stream the output).
        prefill_prompt: the prompt but its last token through :func:`prefill` (None: ``exact``).
        cache: the model's cache to extend (``make_prompt_cache(model)``, holding the tokens before ``prompt``
            if any; default: a new one).
        stop_tokens: ids that end the generation (an end-of-sequence id), ints or a 1-d integer array: the
            first one generated is the last id returned.

    Returns:
        The ``max_tokens`` generated ids, or fewer ending in an id of ``stop_tokens``.

    Raises:
        ValueError: an empty prompt, an id outside the vocabulary, ``max_tokens`` no int >= 1, a bad
            ``timeout``, ``read_retries``, ``stop_tokens`` or ``cache``, ``blocks`` that are not the model's
            arenas (every one), a manager of another shape, or ``exact`` with a cache that cannot be put
            back.
        PreloadError: with ``exact``, a read failed ``read_retries`` more times, or reads were out past
            ``timeout`` (``.failed`` and ``.pending`` list them). The cache is then as before the pass that
            failed; the layers that pass acquired before the failure keep their credits.
    """
    from mlx_lm.models.cache import make_prompt_cache

    prompt = _token_ids("generate_greedy", prompt, _vocabulary_size(model))
    if not is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"generate_greedy: max_tokens must be an int >= 1, got {max_tokens!r}")
    deadline_of("generate_greedy", timeout)  # the manager's own check of a timeout
    read_retries = _checked_read_retries("generate_greedy", read_retries)
    if hasattr(stop_tokens, "ndim") and hasattr(stop_tokens, "dtype"):  # a NumPy or MLX array: 1-d, its items checked
        ids = np.asarray(stop_tokens)
        if ids.ndim == 1:
            stop_tokens = tuple(ids.tolist())
    elif isinstance(stop_tokens, Iterable) and not isinstance(stop_tokens, (str, bytes)):
        stop_tokens = tuple(stop_tokens)  # an iterator read once, here
    if (isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, Iterable)
            or hasattr(stop_tokens, "ndim") or not all(is_int(t) for t in stop_tokens)):
        raise ValueError(f"generate_greedy: stop_tokens must be a collection of token ids (ints), got "
                         f"{stop_tokens!r:.80}")
    stop_tokens = frozenset(int(t) for t in stop_tokens)
    _check_blocks("generate_greedy", model, blocks)
    _check_manager_shape("generate_greedy", manager, blocks)
    if cache is None:
        cache = make_prompt_cache(model)
    else:
        _check_cache("generate_greedy", cache, model)
    if exact and not all(_restorable(layer_cache) for layer_cache in cache):
        raise ValueError("generate_greedy: exact=True runs a token again, which needs caches that can be put "
                         "back (KV caches, sliding windows or arrays caches); this model's cannot")
    if prefill_prompt is None:
        prefill_prompt = exact
    if prefill_prompt and len(prompt) > 1:
        prefill(model, blocks, manager, prompt[:-1], cache, timeout=timeout, read_retries=read_retries)
        prompt = list(prompt[-1:])
    set_tables(blocks, manager.snapshot())
    tokens: list[int] = []

    def build(x, settled: bool = False):  # (input, greedy token, packed reports, the cache as it was before: exact
        # only, and where every layer ran its resident path (the pass cannot miss) its layers' report fields,
        # packed with other such passes' later in place of the packed reports). `settled`: the caches hold the
        # passes before, evaluated (the checkpoint's copies made now, no wait); else the copies are dispatched
        # behind the pass in flight (no wait either) and evaluated with this pass at the latest.
        before = _CacheCheckpoint(cache) if exact else None
        if before is not None and settled:
            before.settle()
        elif before is not None:
            before.start()
        token = mx.argmax(model(x, cache=cache)[0, -1], axis=-1)
        if all(block._deferred is not None and block._deferred.miss is None and block._deferred.last is block.last
               for block in blocks):
            fields = [(block.last[0], block.last[1], block.last[2].miss_ids, block.last[2].miss_scores,
                       block.last_mix) for block in blocks]
            return x, token, None, before, fields
        return x, token, pack_reports(blocks), before, None

    def outputs(built):  # what evaluating a built pass evaluates: the checkpoint's copies first
        return (built[3].arrays() if built[3] is not None else []) + [a for a in built[1:3] if a is not None]

    def dispatch(x):  # the passes before are evaluated (read back)
        built = build(x, settled=True)
        mx.async_eval(*outputs(built))
        return built

    def run_layer_by_layer(x):  # as dispatch, each layer's routed experts made resident before they run
        reads = manager.lookahead_stats()["critical_reads"].sum()
        with _cache_restored_on_error("generate_greedy", cache, read_retries) as before:
            with _layer_by_layer(blocks, manager, timeout=timeout, read_retries=read_retries):
                token = mx.argmax(model(x, cache=cache)[0, -1], axis=-1)
                packed = pack_reports(blocks)
                mx.eval(token, packed)
        return (x, token, packed, before, None), bool(manager.lookahead_stats()["critical_reads"].sum() > reads)

    # Exact without prefill runs the prompt a token a pass, as it decodes: a pass needs every expert it
    # routes resident.
    forced = list(prompt[1:]) if exact else []
    # How the current pass ran: "graph" (the rule's graph, dispatched; its report goes to manager.step) or
    # "layered" (layer by layer: credited by acquire, the token ended by manager.next_token()).
    current, kind = dispatch(mx.array([prompt[:1] if exact else prompt])), "graph"
    layered = False  # exact: the last token needed a read, so the next one runs layer by layer at once
    # The report fields of resident passes not yet handed to the manager, oldest first. Such a pass cannot
    # miss, and with every expert resident the manager has nothing to read or evict: its report changes
    # the manager's counts alone, so the reports go RESIDENT_REPORTS_BATCH at a time (one packing, one
    # readback), each to its own manager.step in order, and always before a later pass's.
    unreported: list[list[tuple]] = []

    def report_resident():
        if unreported:
            for resident_report in _resident_reports(unreported):
                set_tables(blocks, manager.step(resident_report))
            unreported.clear()

    try:
        while len(tokens) < max_tokens:
            more = bool(forced) or len(tokens) + 1 < max_tokens
            following_input = mx.array([forced[:1]]) if forced else current[1].reshape(1, 1)
            # The next token is built while this one runs, and dispatched once this one is read: a read then
            # waits for this token alone, wherever a read waits for the whole stream.
            following = build(following_input) if overlap and more and not layered else None
            early = following is not None and current[4] is not None
            if early:  # this token cannot miss (every layer resident): the next one goes before it is read
                mx.async_eval(*outputs(following))
            token = _read_token(current[1])
            report, missed = None, False
            if current[4] is not None:  # resident: its report goes with others (above)
                if unreported and unreported[0][0][0].shape != current[4][0][0].shape:
                    report_resident()  # a pass of other rows (the prompt's) is packed apart
                unreported.append(current[4])
                if len(unreported) == RESIDENT_REPORTS_BATCH:
                    report_resident()
            else:
                report_resident()
                report = LayerReport.from_packed(np.array(current[2]))
                missed = exact and bool((report.miss_ids >= 0).any())
            if missed and following is not None:
                # The token built on this one goes, its entries in the caches computed first (left lazy, they kept
                # its graph and the arenas' arrays it read, and every slot write of the run again copied its array
                # whole), then cut back: newest first, as the caches took them.
                mx.eval(outputs(following))
                following[3].restore()
                following = None
            if following is not None and not missed and not early:
                mx.async_eval(*outputs(following))
            if missed:
                # The layers after its first miss ran on a wrong input: the pass and its report go (nothing
                # credited, nothing read for it), and the token runs again layer by layer, its routing credited
                # and its misses read by acquire.
                current[3].restore()
                current, _ = run_layer_by_layer(current[0])
                kind, layered = "layered", True
                continue
            if kind == "graph" and report is not None:
                tables = manager.step(report)
            elif kind == "layered":
                tables = manager.next_token()
            if report is not None or kind != "graph":
                set_tables(blocks, tables)
            if forced:
                forced.pop(0)
            else:
                tokens.append(token)
                if on_token is not None:
                    on_token(token)
                if token in stop_tokens:
                    if following is not None:
                        mx.eval(outputs(following))  # dispatched ahead: let it finish before the caller goes on
                    break
            if not more:
                continue
            if following is not None:
                current, kind = following, "graph"
            elif layered:
                current, layered = run_layer_by_layer(following_input)
                kind = "layered"
            else:
                current, kind = dispatch(following_input), "graph"
    except BaseException:
        try:  # the passes kept before the error are credited; the error that ended the loop goes on
            report_resident()
        except Exception:  # noqa: BLE001 - the manager failing again says less than the first error
            pass
        raise
    report_resident()
    return tokens
