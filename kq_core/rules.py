"""What a layer does with a routed expert that is not resident: the rules of kq, named and defined once.

A *miss* is a routed expert (one of a token's top-k) that the layer's slot table does not place in the
arena. A rule says what happens to a miss and to the weights of the routed experts the layer keeps, and
what the layer needs beside the arena to run it. Every place kq names a rule takes these names with these
meanings: :func:`kq_jax.arena_moe.arena_moe` and :func:`~kq_jax.arena_moe.moe_layer` (every rule),
:class:`kq_jax.nnx.ArenaMoE` (``rule=``), ``kq study``, ``kq generate`` and the MLX arena layers
(``kq_mlx.mlx_lm_adapter``). This module holds no array code: the backends implement the rules.

The rules (:data:`RULES`; each one's :class:`Rule` in :data:`RULE`):

* ``exact``: the miss is read into the arena before its expert runs (in JAX inside the step, by the host's
  reader); every routed expert at the router's own weight: the resident layer's output, bit for bit.
* ``tier``: the miss runs from its low-precision copy (:mod:`kq_host.tier`) at the router's own weight;
  the kept weights as they are.
* ``shed``: the miss is dropped (weight 0); the kept weights are the router's own, so the row's weights
  sum to less than its routed mass.
* ``route_shed``: the miss is dropped; the kept weights are rescaled, by one factor a row, to carry the
  row's routed mass (``route_shed``'s ``mix``).
* ``renormalize``: the miss is dropped; the kept weights are scaled to sum to 1.
* ``substitute``: the miss is served by the most probable resident expert the row did not choose, at the
  miss's weight (a miss left without one is dropped); the kept weights as they are.
* ``reroute``: cache-aware routing: the router's first k/2 choices kept (a miss among them dropped), the
  other k/2 places filled with the most probable resident experts of its top 2k, each at its own
  probability.
* ``prior``: cache-aware routing: the top-k of the router's log-probabilities plus :data:`RESIDENT_PRIOR`
  for resident experts, each at its own probability (a miss among them dropped).
* ``uniform``: no arena: every routed expert, resident or not, runs from its low-precision copy at the
  router's own weight (the model quantized throughout; the study's baseline).
* ``stall``: every routed expert computed from every expert's weights held in memory, at the router's own
  weight: the exact output, the layer waiting on each miss.

What each needs: ``tier`` and ``uniform`` a tier; ``exact`` a reader of missed experts; ``stall`` every
expert's weights; ``route_shed``, ``renormalize``, ``substitute``, ``reroute`` and ``prior`` the router
inside the layer (its gate weights to rescale, or its probabilities to choose other experts), so an MLX
model runs them only where kq knows the family's router, not at the seam every family shares
(:data:`SEAM_RULES`). ``shed`` needs nothing.

:data:`DEFAULT_RULE` is ``shed``: of the rules that lose something, the best-measured one that runs with
nothing beside the arena, on every backend and family. ``docs/shedding_study.md`` measures the rules on two
trained models (perplexity against the resident model's, paired 95% intervals over 64 windows, NVIDIA H200):

* ``shed`` against ``route_shed``: at 50% residency +7.97% against +18.0% (stdlib-moe) and +6.80% against
  +13.7% (wheels-moe), +8.40% against +12.76% with the 16-bit tier grid; at 25% +72.6% against +167% and
  +59.7% against +134%. Rescaling the kept weights to the routed mass doubles shedding's cost or more,
  at every residency, on both models, so the rescaling rule is not the default.
* ``tier`` costs far less (+0.57% and +0.72% at 50% with a 3-bit tier), but needs a copy of every expert
  in memory beside the arena (on the 4-bit wheels-moe a 3-bit tier in groups of 32 takes 0.89x of the
  experts' memory). It is the rule to choose where a tier fits, not a default that needs none.
* ``reroute`` and ``prior`` recover 0-0.9 points of shedding's cost at 50% residency (inside shed's
  interval) and 5-12 points at 25%, but need the router's probabilities inside the layer (JAX, or an MLX
  family whose router kq knows) and change which experts run; a default must run everywhere.
* ``renormalize`` costs +102% to +1383% where ``shed`` costs +2% to +300% (the first CPU runs, LFU and
  LRU).
"""

from __future__ import annotations

from dataclasses import dataclass

RESIDENT_PRIOR = 1.0  # the ``prior`` rule's bonus to a resident expert's log-probability (nats)


@dataclass(frozen=True)
class Rule:
    """One rule: what it does to a miss and to the kept weights, and what the layer needs to run it.

    Attributes:
        name: the rule's name, as every backend takes it.
        miss: what the layer does with a routed expert that is not resident.
        kept: what the layer does with the weights of the routed experts it keeps.
        needs_tier: a low-precision copy of every expert (:mod:`kq_host.tier`).
        needs_reader: a reader of missed experts called before their experts run (in JAX inside the step:
            :mod:`kq_jax.miss_fetch`).
        needs_router: the router inside the layer: its gate weights (to rescale the kept ones) or its
            probabilities (to choose other experts); an MLX model has it only where kq knows the family's
            router.
        needs_experts: every expert's weights in memory, not an arena.
        exact: the layer's output is the resident layer's.
    """

    name: str
    miss: str
    kept: str
    needs_tier: bool = False
    needs_reader: bool = False
    needs_router: bool = False
    needs_experts: bool = False
    exact: bool = False

    @property
    def needs(self) -> tuple[str, ...]:
        """What the layer needs beside the arena, as words: ``("tier",)``, ``("reader",)``, ... or ``()``."""
        return tuple(word for word, flag in (("tier", self.needs_tier), ("reader", self.needs_reader),
                                             ("router", self.needs_router), ("every expert", self.needs_experts))
                     if flag)

    @property
    def meaning(self) -> str:
        """One line: the miss, the kept weights and what the rule needs."""
        needs = ", ".join(self.needs) or "nothing"
        return f"{self.name}: a miss {self.miss}; kept weights {self.kept}; needs {needs}"


_OWN = "the router's own"
RULE: dict[str, Rule] = {rule.name: rule for rule in (
    Rule("exact", "is read into the arena before its expert runs, at its own weight", _OWN, needs_reader=True,
         exact=True),
    Rule("tier", "runs from its low-precision copy at its own weight", _OWN, needs_tier=True),
    Rule("shed", "is dropped (weight 0)", _OWN + " (the row's sum falls)"),
    Rule("route_shed", "is dropped (weight 0)", "rescaled, one factor a row, to carry the row's routed mass",
         needs_router=True),
    Rule("renormalize", "is dropped (weight 0)", "scaled to sum to 1", needs_router=True),
    Rule("substitute", "is served by the most probable resident expert the row did not choose, at its weight",
         _OWN, needs_router=True),
    Rule("reroute", "among the first k/2 choices is dropped; the other k/2 places go to the most probable "
         "resident experts of the top 2k", "each chosen expert's own probability", needs_router=True),
    Rule("prior", "is dropped; the top-k is taken with RESIDENT_PRIOR added to resident experts' "
         "log-probabilities", "each chosen expert's own probability", needs_router=True),
    Rule("uniform", "runs from its low-precision copy at its own weight, as every hit does (no arena is read)",
         _OWN, needs_tier=True),
    Rule("stall", "is computed from every expert's weights held in memory", _OWN, needs_experts=True,
         exact=True),
)}
RULES: tuple[str, ...] = tuple(RULE)
DEFAULT_RULE = "shed"
# The rules of a model kq_mlx.load loads (kq generate, serve, chat and plan): those that need neither the router's
# probabilities nor every expert in memory.
LOADER_RULES: tuple[str, ...] = ("exact", "tier", "shed")
TIER_RULES: tuple[str, ...] = tuple(name for name, rule in RULE.items() if rule.needs_tier)
ROUTER_RULES: tuple[str, ...] = tuple(name for name, rule in RULE.items() if rule.needs_router)
# The rules a layer runs knowing only which experts it routed to, not their weights: what an MLX model gets at
# the SwitchGLU / SwitchMLP seam every family shares.
SEAM_RULES: tuple[str, ...] = tuple(name for name, rule in RULE.items() if not rule.needs_router)
EXACT_RULES: tuple[str, ...] = tuple(name for name, rule in RULE.items() if rule.exact)


def check_rule(name, where: str, *, argument: str = "rule", allowed=None) -> str:
    """``name`` if it is one of the rules ``allowed`` (default :data:`RULES`), else a ValueError.

    Args:
        name: the rule given.
        where: the caller, named first in the message (``"arena_moe"``, ``"ArenaMoE"``).
        argument: the argument's name in the caller (``"rule"``, ``"--rule"``).
        allowed: the rules the caller runs, a subset of :data:`RULES` (None: every rule).

    Returns:
        ``name``, a ``str``.

    Raises:
        ValueError: ``name`` is no rule the caller runs (or not a string), naming ``argument`` and listing
            the names it takes.
    """
    names = RULES if allowed is None else tuple(allowed)
    unknown = [rule for rule in names if rule not in RULE]
    if unknown:
        raise ValueError(f"check_rule: allowed holds {unknown}, which are no rules of kq_core.rules.RULES")
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"{where}: {argument} must be one of {', '.join(names)}; got {name!r}")
    return name
