"""``kq demo``: the shipped model generating text through an arena of a fraction of its experts.

A ``qwen3_moe`` checkpoint (the shipped ``models/stdlib-moe`` by default) continues a prompt greedily twice
per framework: once with each layer's experts served from an arena of ``residency`` of them, filled between
tokens by the residency manager from the checkpoint's safetensors files, and once with every expert in
memory. A routed expert that is not in the arena is handled by the ``rule`` (``DEMO_RULES``):

* ``tier``: served by its copy in a low-precision tier of every expert (``tier_bits`` per weight);
* ``route_shed``: shed, the kept weights rescaled to the routed mass; ``shed``: shed, the kept weights as
  they are;
* ``exact``: read before its layer's experts run, the next layer's predicted experts prefetched
  (:class:`kq_jax.exact_loop.ExactLoop`, :func:`kq_mlx.mlx_lm_adapter.attach_exact`): the resident model's
  text at any residency.

:func:`generate_texts` runs one framework, :func:`format_header` and :func:`format_texts` give the lines
``kq demo`` prints; :func:`generate_through_arena` and :func:`generate_exact` are the two generations.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from kq.terminal import render_figures, wrap
from kq_core.contract import EXPERT_PROJECTIONS
from kq_core.rules import check_rule
from kq_core.validate import is_int
from kq_host.tier import DEFAULT_TIER_BITS  # the tier rule's bits where none are given: kq generate's and kq study's

if TYPE_CHECKING:
    from kq.study import RunResult

# The rules kq demo runs (kq_core.rules' names): kq study's tier, route_shed and shed, and exact.
DEMO_RULES: tuple[str, ...] = ("tier", "route_shed", "shed", "exact")
FRAMEWORK_PACKAGES = {"mlx": "mlx_lm", "jax": "jax"}  # each framework and the package it needs, MLX first


def installed_frameworks() -> tuple[str, ...]:
    """The frameworks whose package is installed here, MLX first: ``("mlx", "jax")`` or part of it."""
    return tuple(name for name, package in FRAMEWORK_PACKAGES.items() if importlib.util.find_spec(package) is not None)


@dataclass(frozen=True)
class ModelDemoConfig:
    """One ``kq demo`` of a checkpoint; checked on construction, errors naming ``kq demo``'s options.

    ``layers`` is read from the checkpoint's ``config.json``; ``checkpoint`` None is the shipped model
    (:data:`kq.study.SHIPPED_MODEL`).
    """

    checkpoint: Path | None = None
    prompt: str = "def read_config(path):\n"
    tokens: int = 48  # tokens to generate
    residency: float = 0.25  # fraction of each layer's experts in the arena
    policy: str = "lfu"
    rule: str = "tier"
    tier_bits: int | None = None  # bits per weight of the tier rule's copy (DEFAULT_TIER_BITS if not given); rule tier
    frameworks: tuple[str, ...] = field(default_factory=installed_frameworks)
    layers: int = field(init=False)

    def __post_init__(self):
        from kq.study import SHIPPED_MODEL, checkpoint_config
        from kq_host.tier import BITS

        object.__setattr__(self, "checkpoint", Path(SHIPPED_MODEL if self.checkpoint is None else self.checkpoint))
        object.__setattr__(self, "frameworks", tuple(self.frameworks))
        if not self.frameworks or not set(self.frameworks) <= set(FRAMEWORK_PACKAGES):
            raise ValueError(f"--frameworks must be one or more of {sorted(FRAMEWORK_PACKAGES)}, "
                             f"got {self.frameworks}")
        if not (is_int(self.tokens) and self.tokens >= 1):
            raise ValueError(f"--tokens must be an int >= 1, got {self.tokens!r}")
        if self.tier_bits is not None and self.rule != "tier":
            raise ValueError(f"--tier-bits serves the misses of --rule tier; the rule is {self.rule!r}")
        if self.rule == "tier" and self.tier_bits is None:
            object.__setattr__(self, "tier_bits", DEFAULT_TIER_BITS)
        check_rule(self.rule, "kq demo", argument="--rule", allowed=DEMO_RULES)
        for name, value, known in (("--policy", self.policy, ("lfu", "lru")), ("--tier-bits", self.tier_bits,
                                                                                (*BITS, None))):
            if value not in known:
                raise ValueError(f"{name} must be among {known}, got {value!r}")
        if not 0.0 < self.residency <= 1.0:
            raise ValueError(f"--residency is the fraction of each layer's experts in the arena, in (0, 1]; "
                             f"got {self.residency}")
        if not self.prompt:
            raise ValueError("--prompt is empty: give the model some text to continue")
        object.__setattr__(self, "layers",
                           checkpoint_config(self.checkpoint, self.frameworks[0])["num_hidden_layers"])


@dataclass
class DemoTexts:
    """One framework's continuations of the prompt: ``streamed`` through the arena, ``resident`` with every
    expert in memory, and what the arena's run counted (:class:`kq.study.RunResult`, or :class:`ExactRun`
    for the ``exact`` rule)."""

    framework: str
    streamed: str
    resident: str
    run: RunResult | ExactRun


def _quiet(phase: str) -> None:
    """A ``say`` that says nothing."""


def generate_texts(config: ModelDemoConfig, framework: str, say: Callable[[str], None] = _quiet) -> DemoTexts:
    """The prompt continued by ``framework`` through the arena under ``config.rule``, and with every expert.

    ``say(phase)`` is called as each slow phase starts (loading, building the tier, compiling, generating), its
    text prefixed by ``framework`` (``kq demo`` prints it: :func:`kq.terminal.phase_lines`).
    """
    def said(phase: str) -> None:
        say(f"{framework}: {phase}")

    if config.rule != "exact":
        streamed, result, resident = generate_through_arena(framework, config.checkpoint, config.prompt,
                                                            config.tokens, config.residency, config.policy,
                                                            config.rule, config.tier_bits or DEFAULT_TIER_BITS,
                                                            say=said)
        return DemoTexts(framework, streamed, resident, result)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(config.checkpoint / "tokenizer.json"))
    ids = tokenizer.encode(config.prompt).ids
    run = generate_exact(framework, config.checkpoint, ids, config.tokens, config.residency, config.policy, say=said)
    streamed = tokenizer.decode(run.tokens[len(ids):])
    _, _, resident = generate_through_arena(framework, config.checkpoint, config.prompt, config.tokens, 1.0,
                                            config.policy, "stall", say=said)
    return DemoTexts(framework, streamed, resident, run)


POLICY_WORDS = {"lfu": "the least frequently used expert is evicted first, its counts decayed over time",
                "lru": "the least recently used expert is evicted first"}


def format_header(config: ModelDemoConfig) -> str:
    """What the demo runs; for a rule that changes the text, why the two texts may part (within 100 columns)."""
    misses = {"tier": f"each miss served by its {config.tier_bits}-bit copy in the tier, a quantized copy of every "
                      f"expert",
              "route_shed": "misses shed, the kept weights rescaled", "shed": "misses shed",
              "exact": "each miss read before its layer's experts run, the next layer's predicted experts "
                       "prefetched"}[config.rule]
    lines = [wrap(f"{config.checkpoint}: greedy text after {config.prompt!r}, {config.tokens} tokens, experts "
                  f"served from an arena of {config.residency:.0%} of each layer's experts ({misses}; evicting by "
                  f"{config.policy}: {POLICY_WORDS[config.policy]}), beside the model with every expert in memory.")]
    if config.rule != "exact":
        served = "a miss's low-precision copy" if config.rule == "tier" else "shedding a miss"
        closer = " (more --tier-bits keep it closer)" if config.rule == "tier" else ""
        lines.append(wrap(f"The text through the arena may differ from the resident model's: {served} changes the "
                          f"layer's output a little, and a greedy decode follows the change{closer}. `kq demo --rule "
                          f"exact` reads each miss before its layer runs and gives the resident model's text word "
                          f"for word."))
    return "\n".join(lines)


def format_texts(config: ModelDemoConfig, texts: DemoTexts) -> str:
    """Both texts of one framework, then the arena's figures per generated token, each with what it is (a blank
    line first; the figures within 100 columns)."""
    framework, run = texts.framework, texts.run
    same = "the same text" if texts.streamed == texts.resident else "a different text"
    resident = f"== {framework}: every expert resident ({same})\n{config.prompt}{texts.resident}"
    layers = f"{run.slots} slots in each of the {config.layers} layers"
    if config.rule != "exact":
        s = run.summary()
        first, *rest = run.trace["token_seconds"]
        tier = config.rule == "tier"
        not_run = ("none: the tier runs every miss" if tier else
                   "the misses' share, shed" + (", the kept weights then rescaled to the whole"
                                                if config.rule == "route_shed" else ""))
        figures = [
            ("hit rate", f"{s['hit_rate']:.3f}",
             "fraction of the routed experts found in the arena; the others are misses" +
             (f", each run from its {config.tier_bits}-bit copy" if tier else ", shed")),
            ("gate weight not run", f"{s['shed_mass_per_token']:.3f} of {run.routed_mass / run.tokens:.3f}",
             f"per token, summed over the {config.layers} layers: the gate weight the router gave the experts it "
             f"routed to (the second figure), and the part of it on experts that did not run ({not_run})"),
            ("expert reads", f"{s['reads_per_token']:.1f} per token",
             f"experts read from the checkpoint's files into the arena, {s['mib_per_token']:.2f} MiB per token"),
            ("experts in memory", f"{s['memory_mib']:.1f} MiB",
             f"the arena's {layers}" + (f", and the {config.tier_bits}-bit copy of every expert" if tier else "")),
            ("speed", f"{1 / float(np.median(rest)):.0f} tokens/s",
             f"the median token: its graph, readback and the residency manager's step (the first token, "
             f"compiling, took {first:.2f} s)"),
        ]
        return "\n".join((
            f"\n== {framework}: through the arena ({run.slots} slots per layer)\n{config.prompt}{texts.streamed}",
            resident, f"== {framework}: the arena's figures", render_figures(figures)))
    from_prompt = f" + {run.unused_before} still unused from the prompt" if run.unused_before else ""
    figures = [
        ("hit rate", f"{run.hit_rate:.3f}",
         "fraction of the routed experts in the arena when their layer ran; a prefetch still loading then is a "
         "miss, so this depends on how fast reads land against this framework's compute"),
        ("hit rate, late as hits", f"{run.hit_rate_counting_late:.3f}",
         f"the same, counting the {run.prefetch_late} late prefetches as hits: what the predictions alone cover"),
        ("reads waited for", f"{run.critical_reads_per_token:.1f} per token",
         "expert reads per token waited for before a layer's experts ran"),
        ("MiB read", f"{run.mib_per_token:.2f} per token", "read from the checkpoint's files, prefetches included"),
        ("experts in memory", f"{run.memory_mib:.1f} MiB", f"the arena's {layers}"),
        ("prefetches", f"{run.prefetches} started",
         f"over the {run.generated} tokens: {run.prefetches} started{from_prompt} = {run.prefetch_used} used + "
         f"{run.prefetch_late} late (still loading when routed: waited for) + {run.prefetch_wasted} wasted "
         f"(evicted or failed before any use) + {run.unused_after} still unused at the end"),
        ("speed", f"{1 / float(np.median(run.token_seconds)):.0f} tokens/s",
         "the median generated token, layer by layer with the host between layers"),
    ]
    return "\n".join((
        f"\n== {framework}: the exact loop ({run.slots} slots per layer)\n{config.prompt}{texts.streamed}",
        resident, f"== {framework}: the exact loop's figures", render_figures(figures)))


# ---- through the arena, between tokens ---------------------------------------------------------


def generate_through_arena(framework: str, checkpoint: Path, prompt: str, tokens: int, residency: float,
                           policy: str = "lfu", rule: str = "tier",
                           tier_bits: int = DEFAULT_TIER_BITS, *,
                           say: Callable[[str], None] = _quiet) -> tuple[str, RunResult, str]:
    """Greedy text after ``prompt`` through an arena of ``residency`` (misses under ``rule``), and with every expert.

    The arena's slot tables change between tokens only (:meth:`kq.study_jax.JaxStudy.run`,
    :meth:`kq.study_mlx.MlxStudy.run`).

    Args:
        framework: ``"jax"`` or ``"mlx"``.
        checkpoint: a checkpoint directory :func:`kq.study.checkpoint_config` accepts for ``framework``.
        prompt: the text to continue; it must encode to at least one token.
        tokens: greedy tokens to generate.
        residency: fraction of each layer's experts in the arena, in (0, 1].
        policy: the arena's eviction policy, ``"lfu"`` or ``"lru"``.
        rule: a :data:`kq.study.RULES` rule for a routed expert not in the arena (:mod:`kq_core.rules`).
        tier_bits: bits per weight of the ``tier`` rule's copy of every expert.
        say: called with the name of each slow phase as it starts (loading, building the tier, compiling and
            generating through the arena, generating with every expert).

    Returns:
        ``(text through the arena, its RunResult, text of the resident model)``; at ``residency`` 1 the
        resident model's text is the arena's, generated once.
    """
    from tokenizers import Tokenizer

    from kq.study import StudyConfig
    from kq.study_runner import make_study

    tokenizer = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError(f"prompt {prompt!r} has no tokens: give generate_through_arena at least one")
    say(f"loading the model ({Path(checkpoint).name})")
    study = make_study(StudyConfig(checkpoint=checkpoint, tokens=1, warmup=0, framework=framework, tier_bits=tier_bits))
    if rule == "tier":
        say(f"building the {tier_bits}-bit tier of every expert (read from its cache on disk once built)")
        _build_tier(study, framework)
    texts = []
    for run_residency in (residency, 1.0) if residency < 1.0 else (residency,):
        say(f"compiling, then generating {tokens} tokens through the arena of {run_residency:.0%} of the experts"
            if run_residency < 1.0 else f"generating {tokens} tokens with every expert resident")
        result = study.run(run_residency, policy, rule, prompt=ids, generate=tokens)
        result.tokens = tokens
        texts.append((tokenizer.decode(result.trace["tokens"][len(ids):]), result))
    (streamed, result), (resident, _) = texts[0], texts[-1]
    return streamed, result, resident


def _build_tier(study, framework: str) -> None:
    """Builds ``study``'s tier now (or reads it from its cache on disk), so the arena's run finds it built."""
    if framework == "mlx":
        study.tier()
        return
    from kq_host.checkpoint import open_experts
    from kq_jax import qwen3_moe

    with open_experts(study.config.checkpoint, qwen3_moe.PROJECTIONS) as store:
        study.tier(store)


# ---- the exact layer-by-layer loop ---------------------------------------------------------------


@dataclass
class ExactRun:
    """What one generation through the exact loop did, counted over the generated tokens' steps.

    Every prefetch is in one category: ``prefetches + unused_before == prefetch_used + prefetch_late +
    prefetch_wasted + unused_after`` (``unused_before``: prefetches of the prompt's steps not routed yet
    when the generated tokens began).
    """

    slots: int
    tokens: list[int]
    generated: int = 0
    lookups: int = 0  # routed experts, over the layers
    hits: int = 0  # of those, resident when their layer's acquire ran
    critical_reads: int = 0  # routed experts read (or waited for) on the critical path
    prefetches: int = 0  # reads started by look-ahead
    prefetch_used: int = 0  # landed before their layer routed them: hits
    prefetch_late: int = 0  # still loading when their layer routed them: misses, waited for
    prefetch_wasted: int = 0  # evicted or failed before any use
    unused_before: int = 0
    unused_after: int = 0  # held, never routed yet when the run ended
    bytes_read: int = 0
    memory_mib: float = 0.0
    token_seconds: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Routed experts resident when their layer routed them; a late prefetch is a miss, so this depends
        on how fast the reads land against the framework's compute between a prefetch and its layer."""
        return self.hits / self.lookups if self.lookups else 1.0

    @property
    def hit_rate_counting_late(self) -> float:
        """:attr:`hit_rate` with the late prefetches counted as hits: what the predictions alone cover."""
        return (self.hits + self.prefetch_late) / self.lookups if self.lookups else 1.0

    @property
    def critical_reads_per_token(self) -> float:
        return self.critical_reads / self.generated if self.generated else 0.0

    @property
    def mib_per_token(self) -> float:
        return self.bytes_read / self.generated / 2**20 if self.generated else 0.0


def generate_exact(framework: str, checkpoint, prompt_ids: list[int], tokens: int, residency: float,
                   policy: str = "lfu", *, lookahead: bool = True, queue_depth: int = 8,
                   say: Callable[[str], None] = _quiet) -> ExactRun:
    """``tokens`` greedy tokens after ``prompt_ids`` through an arena of ``residency`` of each layer's experts.

    Each layer's misses are read before its experts run (:meth:`kq_host.residency.ResidencyManager.acquire`)
    and, with ``lookahead``, the next layer's predicted experts are prefetched: the text is the model's with
    every expert in memory, at any residency.

    Args:
        framework: ``"jax"`` (:class:`kq_jax.exact_loop.ExactLoop`) or ``"mlx"`` (mlx-lm with
            :func:`kq_mlx.mlx_lm_adapter.attach_exact`); the prompt is fed one token at a time.
        checkpoint: a Qwen3-MoE checkpoint directory (float or mlx-community's quantized layout) or, with
            ``"mlx"``, a float Mixtral one (its experts' ``w1``, ``w3``, ``w2`` are the arena's gate, up, down).
        prompt_ids: the prompt's token ids, at least one.
        tokens: greedy tokens to generate.
        residency: fraction of each layer's experts in the arena (at least top-k slots).
        policy: the arena's eviction policy, ``"lfu"`` or ``"lru"``.
        lookahead: prefetch the next layer's predicted experts.
        queue_depth: the residency manager's reads in flight; 0 reads inline (nothing is late then, so
            the counts depend on the routing alone: the same in both frameworks).
        say: called with the name of each slow phase as it starts (loading, compiling and generating).

    Returns:
        :class:`ExactRun`, ``tokens`` the prompt and the generated ids.
    """
    from kq.study import checkpoint_config
    from kq_host.checkpoint import CHECKPOINT_LAYOUTS, Quantization, expert_count, open_experts
    from kq_host.residency import ResidencyManager

    if framework not in ("jax", "mlx"):
        raise ValueError(f"generate_exact: framework must be 'jax' or 'mlx', got {framework!r}")
    if not prompt_ids:
        raise ValueError("generate_exact: the prompt has no tokens")
    config = checkpoint_config(checkpoint, framework)
    layers, experts, top_k = config["num_hidden_layers"], expert_count(config), config["num_experts_per_tok"]
    template, projections, _ = CHECKPOINT_LAYOUTS[config["model_type"]]
    slots = max(top_k, round(residency * experts))
    quantized = Quantization.of(checkpoint) is not None
    # JAX's arena holds float experts; MLX's arena takes a quantized checkpoint's arrays as stored, under
    # mlx-lm's stacked names (the arena's own).
    stored_as_is = quantized and framework == "mlx"
    arena_names = dict(zip(projections, EXPERT_PROJECTIONS))

    def load(layer, expert, slot):
        read = store.read_expert(layer, expert)
        return read if stored_as_is else {arena_names[name]: array for name, array in read.items()}

    say(f"loading the model ({Path(checkpoint).name})")
    with open_experts(checkpoint, projections, template=template, dequantized=framework == "jax") as store:
        arena, step = (_jax_loop if framework == "jax" else _mlx_loop)(checkpoint, slots, len(prompt_ids) + tokens,
                                                                     store, quantized)
        # closed however the run ends (a failed read ends it), before the store it reads
        with ResidencyManager(layers, experts, slots, arena=arena, policy=policy, queue_depth=queue_depth,
                              loader=load, bytes_per_expert=store.expert_nbytes(0)) as manager:
            for layer in range(layers):
                manager.preload(layer, range(slots))
            run = ExactRun(slots, list(prompt_ids), memory_mib=layers * slots * store.expert_nbytes(0) / 2**20)
            forward = step(manager, lookahead)
            say(f"compiling, then generating {tokens} tokens through the exact loop's arena of {slots} slots")
            for position in range(len(prompt_ids) + tokens - 1):
                if position == len(prompt_ids) - 1:
                    _, before = manager.stats()
                    ahead_before = manager.lookahead_stats()
                start = time.perf_counter()
                next_id = forward(run.tokens[position], position)  # ends the manager's token too
                if position >= len(prompt_ids) - 1:
                    run.tokens.append(next_id)
                    run.token_seconds.append(time.perf_counter() - start)
            _, after = manager.stats()
            ahead_after = manager.lookahead_stats()
    since = after.since(before)
    ahead = {name: int(ahead_after[name].sum() - ahead_before[name].sum())
             for name in ("critical_reads", "prefetches", "prefetch_used", "prefetch_late", "prefetch_wasted")}
    run.generated, run.lookups, run.hits, run.bytes_read = tokens, since.lookups, since.hits, since.bytes_read
    run.critical_reads, run.prefetches = ahead["critical_reads"], ahead["prefetches"]
    run.prefetch_used, run.prefetch_late, run.prefetch_wasted = (ahead["prefetch_used"], ahead["prefetch_late"],
                                                                 ahead["prefetch_wasted"])
    run.unused_before = int(ahead_before["prefetch_unused"].sum())
    run.unused_after = int(ahead_after["prefetch_unused"].sum())
    return run


def _jax_loop(checkpoint, slots: int, length: int, store, quantized: bool):
    import jax.numpy as jnp

    from kq_jax import qwen3_moe
    from kq_jax.arena import JaxArena
    from kq_jax.exact_loop import ExactLoop

    cfg = qwen3_moe.Qwen3MoeConfig.load(checkpoint)
    params = qwen3_moe.load_params(checkpoint, cfg, experts=False)
    shapes = {name: (shape, np.float32) for name, (shape, _) in store.expert_shapes(0).items()}
    arena = JaxArena(cfg.num_hidden_layers, slots, shapes)

    def step(manager, lookahead):
        loop = ExactLoop(params, cfg, manager, arena, length=length, lookahead=lookahead)
        return lambda token, position: int(jnp.argmax(loop.step(token, position)[0]))

    return arena, step


def _mlx_loop(checkpoint, slots: int, length: int, store, quantized: bool):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kq_mlx.mlx_lm_adapter import SwitchGLUArena, attach_arena, attach_exact

    model, _ = load(str(Path(checkpoint)), lazy=True)
    blocks = attach_arena(model, slots, keep_experts=False)
    if not mx.metal.is_available() and not quantized:
        model.set_dtype(mx.float32)  # MLX's CPU gather_mm takes float32 only
    cache = make_prompt_cache(model)

    def step(manager, lookahead):
        attach_exact(model, blocks, manager, lookahead=lookahead)

        def forward(token, position):
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
            next_id = int(mx.argmax(logits).item())
            manager.next_token()  # ExactLoop.step ends the token itself; attach_exact leaves it to the caller
            return next_id

        return forward

    return SwitchGLUArena(blocks), step
