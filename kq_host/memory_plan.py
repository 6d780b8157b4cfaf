"""A memory budget in bytes, split between what a model keeps whole and the arena of its experts.

A model run through an arena keeps in memory its non-expert weights (attention, embeddings, norms,
routers, shared experts), the KV cache of the context it is asked to hold, the tier (rule ``"tier"``: a
low-precision copy of every expert) and the arena: ``slots`` experts of each MoE layer. :func:`plan_memory`
gives the arena what the budget leaves after the rest, the same number of slots in every layer (the
residency manager keeps one slot count for all layers), and refuses a budget that cannot hold the rest
plus one token's routed experts in every layer, naming the smallest budget that works.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from kq_core.validate import is_int, is_real

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class MemoryPlanError(ValueError):
    """A budget that cannot be read or cannot run the model; the message names the argument."""


def parse_size(value, argument: str = "memory") -> int:
    """Bytes from an int or a text such as ``"8GiB"``, ``"8 GB"``, ``"512MiB"``, ``"1.5g"``.

    Units: B, K/KB/M/MB/G/GB/T/TB (powers of 1000) and KiB/MiB/GiB/TiB (powers of 1024), any case.

    Raises:
        MemoryPlanError: naming ``argument``: not a size, or not above zero.
    """
    if is_int(value):
        size = int(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise MemoryPlanError(f"{argument}: must be a size such as 8GiB, 16GB or 512MiB (bytes if no unit), "
                                  f"got {value!r}")
        number = float(match.group(1)) * _UNITS[unit]
        if not math.isfinite(number):
            raise MemoryPlanError(f"{argument}: must be a finite size, got {value!r}")
        size = int(number)
    else:
        raise MemoryPlanError(f"{argument}: must be a size (an int of bytes or a text such as 8GiB), got {value!r}")
    if size <= 0:
        raise MemoryPlanError(f"{argument}: must be above zero, got {value!r}")
    return size


def format_size(size: float) -> str:
    """``size`` bytes as a short text in binary units (``"7.50 GiB"``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


@dataclass(frozen=True)
class MemoryPlan:
    """Where a budget goes (bytes).

    Attributes:
        budget: the budget given (None: the arena was sized by a residency instead).
        other: the non-expert weights, as the model runs them.
        kv_cache: the KV cache of ``context`` tokens (an estimate from the model's attention shape).
        tier: the low-precision copy of every expert (0 without one).
        arena: ``num_layers * slots * expert`` bytes.
        expert: one expert of one layer (every projection), as the arena holds it.
        num_layers, num_experts, top_k: the model's MoE layers, experts per layer and routed experts a token.
        slots: experts each layer's arena holds.
        context: tokens the KV cache is planned for.
    """

    budget: int | None
    other: int
    kv_cache: int
    tier: int
    arena: int
    expert: int
    num_layers: int
    num_experts: int
    top_k: int
    slots: int
    context: int

    @property
    def residency(self) -> float:
        """The fraction of each layer's experts the arena holds."""
        return self.slots / self.num_experts

    @property
    def total(self) -> int:
        """What the plan keeps in memory: the weights, the KV cache, the tier and the arena."""
        return self.other + self.kv_cache + self.tier + self.arena

    @property
    def all_experts(self) -> int:
        """Every expert of every layer, as the arena holds one."""
        return self.num_layers * self.num_experts * self.expert

    def to_json(self) -> dict:
        return {**asdict(self), "residency": self.residency, "total": self.total, "all_experts": self.all_experts}


def _checked_count(name: str, value, low: int = 1) -> int:
    if not is_int(value) or value < low:
        raise MemoryPlanError(f"{name}: must be an int >= {low}, got {value!r}")
    return int(value)


def plan_memory(*, other: int, expert: int, num_layers: int, num_experts: int, top_k: int, kv_cache: int = 0,
                tier: int = 0, memory=None, residency=None, context: int = 0) -> MemoryPlan:
    """Splits ``memory`` (bytes, or a text :func:`parse_size` reads) or sizes the arena by ``residency``.

    Exactly one of ``memory`` and ``residency`` is given. With ``memory`` the arena gets what is left after
    ``other + kv_cache + tier``, as whole slots, the same in every layer, at most every expert.

    Args:
        other, expert, kv_cache, tier: bytes (see :class:`MemoryPlan`).
        num_layers, num_experts, top_k: the model's MoE layers, experts a layer and experts a token routes to.
        memory: the budget.
        residency: the fraction of each layer's experts to keep, in ``(0, 1]`` (at least one slot).
        context: the tokens ``kv_cache`` was estimated for (recorded in the plan).

    Returns:
        :class:`MemoryPlan`.

    Raises:
        MemoryPlanError: both or neither of ``memory`` and ``residency``, a bad value (named), or a budget
            below the non-expert weights, the KV cache, the tier and one token's routed experts in every
            layer (the message names that smallest budget).
    """
    for name, value in (("other", other), ("expert", expert), ("kv_cache", kv_cache), ("tier", tier)):
        _checked_count(name, value, 0)
    num_layers, num_experts = _checked_count("num_layers", num_layers), _checked_count("num_experts", num_experts)
    top_k = min(_checked_count("top_k", top_k), num_experts)
    if (memory is None) == (residency is None):
        raise MemoryPlanError("memory/residency: give one of them: a budget in bytes (memory) or the fraction "
                              "of each layer's experts to keep (residency)")
    budget = None
    if residency is not None:
        if not is_real(residency) or not 0 < residency <= 1:
            raise MemoryPlanError(f"residency: must be a fraction in (0, 1] of each layer's experts, got "
                                  f"{residency!r}")
        slots = min(num_experts, max(1, round(residency * num_experts)))
    else:
        budget = parse_size(memory)
        fixed = other + kv_cache + tier
        smallest = fixed + num_layers * top_k * expert
        if budget < smallest:
            raise MemoryPlanError(
                f"memory: {format_size(budget)} cannot run this model: its non-expert weights take "
                f"{format_size(other)}, the KV cache of {context} tokens {format_size(kv_cache)}"
                + (f", the tier {format_size(tier)}" if tier else "")
                + f", and one token's {top_k} routed experts in each of {num_layers} MoE layers "
                f"{format_size(num_layers * top_k * expert)}; the smallest budget that works is "
                f"{format_size(smallest)} ({smallest} bytes)")
        slots = min(num_experts, (budget - fixed) // max(num_layers * expert, 1))
    return MemoryPlan(budget=budget, other=int(other), kv_cache=int(kv_cache), tier=int(tier),
                      arena=num_layers * slots * int(expert), expert=int(expert), num_layers=num_layers,
                      num_experts=num_experts, top_k=top_k, slots=int(slots), context=int(context))
