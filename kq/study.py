"""``kq study``: what shedding costs a trained model, measured by decoding a text through a bounded arena.

A checkpoint (``qwen3_moe``; the shipped ``models/stdlib-moe`` by default) runs over a text as a
decode engine would: one token per step, teacher-forced, every layer's experts served from an
arena of ``residency`` of its experts, the slot tables updated between tokens by the residency
manager reading experts from the checkpoint's safetensors files. The text is decoded in windows no
longer than the sequences the checkpoint was trained on (:func:`window_plan`; ``long_context`` for one
window however long): each window starts with the arena holding each layer's lowest-numbered experts
and an empty key-value cache, and decodes ``warmup`` tokens before any is scored.

Rules for a routed expert that is not resident (``RULES``):

* ``route_shed``: shed it and scale the kept weights so they keep the row's routed mass (kq's op);
* ``shed``: shed it, the kept weights as they are (their sum falls);
* ``renormalize``: shed it and scale the kept weights to sum to 1;
* ``substitute``: serve it with the most probable resident expert the row has not chosen, at the
  missed expert's weight (misses in k order take substitutes in descending probability; a miss
  left without one is shed);
* ``tier``: serve it, at its own weight, with its copy in a low-precision tier of every expert
  (``route_shed(..., on_miss="tier")``; :mod:`kq_host.tier`, ``tier_bits`` and ``tier_group_size``);
* ``stall``: wait for it: the exact output, every miss a read on the token's critical path;
* ``reroute``: cache-aware routing: keep the router's first k/2 choices (a miss among them shed), fill
  the other k/2 places with the most probable resident experts of its top 2k not already chosen, each
  at its own probability (scaled as the router scales its top-k);
* ``prior``: cache-aware routing: the top-k of the router's log-probabilities plus
  :data:`kq_core.rules.RESIDENT_PRIOR` for resident experts, each chosen expert at its own probability (a miss shed).

``reroute`` and ``prior`` run in JAX only; the manager still reads the misses of the router's own top-k.
The baseline ``uniform`` (JAX only) has no arena: every routed expert is served from the tier, as a model
quantized throughout would be; it runs once, listed at residency 0.

Per run: perplexity and bits per byte of the scored tokens, hit rate, shed mass per token (the
routed mass the rule did not serve with the routed expert), reads and MiB read per token, and for
``stall`` the reads on the critical path per token; and the memory the experts take (the arena's
slots, plus the tier for ``tier``), in the checkpoint's dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kq.terminal import progress_bar, render_table
from kq_core.contract import MAX_TOP_K
from kq_core.rules import RESIDENT_PRIOR  # noqa: F401  (the ``prior`` rule's bonus, named in the docstring)
from kq_host.checkpoint import (CHECKPOINT_LAYOUTS, EXPERT_WIDTH_KEYS, MODEL_FILES, CheckpointError,
                                 check_regular_files, check_shards, model_files, read_config, trained_length)
from kq_host.tier import DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE

RULES = ("route_shed", "shed", "renormalize", "substitute", "tier", "stall", "reroute", "prior", "uniform")
JAX_ONLY_RULES = ("reroute", "prior", "uniform")
POLICIES = ("lfu", "lru")
RESIDENCIES = (1.0, 0.75, 0.5, 0.25, 0.125)
SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "models" / "stdlib-moe"


@dataclass(frozen=True)
class StudyConfig:
    checkpoint: Path = SHIPPED_MODEL
    text: Path | None = None  # default: the checkpoint's heldout.txt
    tokens: int = 256  # scored tokens per run
    warmup: int = 64
    residencies: tuple[float, ...] = RESIDENCIES
    policies: tuple[str, ...] = POLICIES
    rules: tuple[str, ...] | None = None  # default: every rule the framework runs
    framework: str = "jax"
    tier_bits: int = DEFAULT_TIER_BITS
    tier_group_size: int = DEFAULT_TIER_GROUP_SIZE
    streams: int = 1  # windows decoded side by side, spread over the text, each with its own arena (JAX)
    long_context: bool = False  # one window of warmup + tokens a stream, past the trained length if longer

    def __post_init__(self):
        if self.framework not in ("jax", "mlx"):
            raise ValueError(f"--framework must be jax or mlx, got {self.framework!r}")
        checkpoint_config(self.checkpoint, self.framework)
        if self.tokens < 1 or self.warmup < 0:
            raise ValueError(f"--tokens must be at least 1 and --warmup at least 0, got {self.tokens}, {self.warmup}")
        trained = trained_length(self.checkpoint)
        if not self.long_context and trained is not None and self.warmup >= trained:
            raise ValueError(f"--warmup {self.warmup} leaves no token to score within the {trained}-token sequences "
                             f"the checkpoint was trained on; give a smaller one (or the long-context setting)")
        if not (isinstance(self.streams, int) and self.streams >= 1):
            raise ValueError(f"--streams must be an int >= 1, got {self.streams!r}")
        if self.streams > 1 and self.framework != "jax":
            raise ValueError("--streams above 1 runs in JAX only; use --framework jax")
        if not all(0.0 < r <= 1.0 for r in self.residencies):
            raise ValueError(f"--residency values must be in (0, 1], got {self.residencies}")
        if self.rules is None:
            object.__setattr__(self, "rules", RULES if self.framework == "jax" else
                               tuple(r for r in RULES if r not in JAX_ONLY_RULES))
        for name, values, known in (("--policies", self.policies, POLICIES), ("--rules", self.rules, RULES)):
            if not set(values) <= set(known):
                raise ValueError(f"{name} must be among {known}, got {values}")
        jax_only = [r for r in self.rules if r in JAX_ONLY_RULES]
        if self.framework == "mlx" and jax_only:
            raise ValueError(f"--rules {', '.join(jax_only)} run in JAX only; use --framework jax for them")
        from kq_host.tier import BITS, GROUP_SIZES

        if self.tier_bits not in BITS or self.tier_group_size not in GROUP_SIZES:
            raise ValueError(f"--tier-bits must be among {BITS} and --tier-group-size among {GROUP_SIZES}, "
                             f"got {self.tier_bits}, {self.tier_group_size}")
        if {"tier", "uniform"} & set(self.rules):
            _check_tier_group_size(checkpoint_config(self.checkpoint, self.framework), self.tier_group_size)


def _check_tier_group_size(raw: dict, group_size: int) -> None:
    """ValueError naming ``--tier-group-size`` unless it divides every expert projection's input width."""
    widths = {key: raw[key] for key in ("hidden_size", EXPERT_WIDTH_KEYS[raw["model_type"]])}
    uneven = [f"{key} {width}" for key, width in widths.items() if width % group_size]
    if uneven:
        raise ValueError(f"--tier-group-size {group_size} does not divide the experts' input widths "
                         f"({', '.join(uneven)} in the checkpoint's config.json); give one among the group "
                         f"sizes that divide {', '.join(f'{key} {width}' for key, width in widths.items())}")


@contextlib.contextmanager
def building_the_tier():
    """The block of a runner's tier build: a read of the checkpoint's experts that fails there (the disk's error,
    or a file changed since its header was read: :class:`~kq_host.expert_store.ExpertReadError`) raised as the
    residency manager's failed reads are, a :class:`~kq_host.residency.PreloadError` (the command ends at it in
    one line); the checkpoint's other faults as they are."""
    from kq_host.expert_store import ExpertReadError
    from kq_host.residency import PreloadError

    try:
        yield
    except ExpertReadError as error:
        raise PreloadError(f"the tier's build: {error}", [], []) from None


def window_plan(config: StudyConfig) -> list[tuple[int, int]]:
    """How each stream's ``warmup + tokens`` tokens of text are cut into windows: ``(offset, scored)``
    per window, window i being the text's tokens ``offset .. offset + warmup + scored`` decoded from
    position 0 (a fresh key-value cache and arena), its first ``warmup`` tokens unscored.

    By default a window is at most as long as the sequences the checkpoint was trained on
    (:func:`trained_length`: ``warmup + scored <= trained``), so no token is scored at a position the model
    never saw in training, and consecutive windows overlap by ``warmup`` tokens: every token of the text
    after the first ``warmup`` is scored once. With ``config.long_context`` (or no known trained length),
    one window of ``warmup + tokens``.
    """
    trained = trained_length(config.checkpoint)
    span = config.tokens if config.long_context or trained is None else trained - config.warmup
    return [(offset, min(span, config.tokens - offset)) for offset in range(0, config.tokens, span)]


def text_windows(segment: np.ndarray, config: StudyConfig) -> list[tuple[np.ndarray, int]]:
    """``(tokens [..., warmup + scored + 1], scored)`` of each window of :func:`window_plan`, cut from a
    stream's ``segment`` ``[..., warmup + tokens + 1]`` (streams side by side on the leading axis)."""
    return [(segment[..., offset:offset + config.warmup + scored + 1], scored)
            for offset, scored in window_plan(config)]


def merged(runs: list["RunResult"], tokens: int, scored_bytes: int) -> "RunResult":
    """One run of a stream's windows, decoded one after another (:func:`window_plan`), in text order."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    out = dataclasses.replace(first, tokens=tokens, bytes=scored_bytes, bits=0.0, token_bits=[], trace={},
                              windows=len(runs), context=max(r.context for r in runs))
    for name in ("hits", "lookups", "shed_mass", "routed_mass", "reads", "bytes_read", "critical_reads", "seconds"):
        setattr(out, name, sum(getattr(r, name) for r in runs))
    for run in runs:
        for bits in run.token_bits:
            out.score(bits)
        for key, values in run.trace.items():
            out.trace.setdefault(key, []).extend(values)
    if first.layer_hit_rates:  # every layer looks up as many entries a token: weighted by the windows' lookups
        out.layer_hit_rates = list(np.average([r.layer_hit_rates for r in runs], axis=0,
                                              weights=[max(r.lookups, 1) for r in runs]))
    return out


def window_note(result: "RunResult") -> str:
    """One line saying how ``result``'s tokens were windowed against the length the model was trained on."""
    trained = result.trained_length
    if trained is None:
        return (f"Scored in {result.windows} window(s) a stream of at most {result.context} tokens; the checkpoint "
                f"records no training length.")
    if result.context > trained:
        return (f"LONG CONTEXT: scored in {result.windows} window(s) a stream of up to {result.context} tokens, past "
                f"the {trained}-token sequences the checkpoint was trained on (positions {trained} on never seen "
                f"in training).")
    return (f"Scored in {result.windows} window(s) a stream of at most {result.context} tokens (each decoded afresh, "
            f"its warm-up unscored), within the {trained}-token sequences the checkpoint was trained on.")


def checkpoint_config(checkpoint, framework: str = "jax") -> dict:
    """The checkpoint's ``config.json``, checked to be one ``framework`` can run; errors name ``--checkpoint``."""
    directory = Path(checkpoint)
    path = directory / "config.json"
    try:
        if directory.is_dir():  # before anything opens a file: a FIFO would hang its reader
            check_regular_files(directory)
    except CheckpointError as error:
        raise ValueError(f"--checkpoint: {error}") from None
    except OSError as error:
        raise ValueError(f"--checkpoint: {directory}: unreadable ({type(error).__name__}: {error})") from None
    if not path.is_file():
        raise ValueError(f"--checkpoint: {directory} holds no config.json (a qwen3_moe checkpoint directory, as "
                         f"mlx_lm.convert or models/train.py writes)")
    try:
        raw = read_config(directory)
    except CheckpointError as error:
        raise ValueError(f"--checkpoint: {error}") from None
    model_types = ("qwen3_moe",) if framework == "jax" else tuple(sorted(CHECKPOINT_LAYOUTS))
    model_type = raw.get("model_type")
    if model_type not in model_types:
        also = " (--framework mlx also runs mixtral)" if framework == "jax" else ""
        raise ValueError(f"--checkpoint: {path} has model_type {model_type!r}; kq study --framework {framework} "
                         f"runs {', '.join(model_types)}{also}")
    missing = [key for key in _required_keys(model_type, framework) if key not in raw]
    if missing:
        raise ValueError(f"--checkpoint: {path} lacks {', '.join(missing)}")
    experts_key = CHECKPOINT_LAYOUTS[model_type][2]
    for key in ("num_hidden_layers", experts_key, "num_experts_per_tok", "hidden_size",
                EXPERT_WIDTH_KEYS[model_type]):
        if not isinstance(raw.get(key), int) or isinstance(raw[key], bool) or raw[key] < 1:
            raise ValueError(f"--checkpoint: {path}: {key} must be an int >= 1, got {raw.get(key)!r}")
    most = min(raw[experts_key], MAX_TOP_K)
    if raw["num_experts_per_tok"] > most:
        raise ValueError(f"--checkpoint: {path}: num_experts_per_tok {raw['num_experts_per_tok']} exceeds "
                         f"{most} ({experts_key} {raw[experts_key]}; route_shed takes at most {MAX_TOP_K})")
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"--checkpoint: {directory} holds no tokenizer.json")
    _check_weights_files(directory)
    return raw


def _check_weights_files(directory: Path) -> None:
    """ValueError naming ``--checkpoint`` and the file where the directory holds no safetensors file, one
    whose header cannot be read (truncated, corrupt), a tensor in two files, or lacks a shard its index names."""
    from kq_host.expert_store import ExpertStoreError, read_safetensors_headers

    files = model_files(directory)
    if not files:
        raise ValueError(f"--checkpoint: {directory} holds no {MODEL_FILES} weights file")
    try:
        check_shards(directory)
    except CheckpointError as error:
        raise ValueError(f"--checkpoint: {error}") from None
    try:
        read_safetensors_headers(files)
    except ExpertStoreError as error:
        raise ValueError(f"--checkpoint: {error}; the weights cannot be read") from None


def _required_keys(model_type: str, framework: str) -> list[str]:
    """The ``config.json`` fields the framework's model of ``model_type`` cannot do without."""
    import dataclasses
    import importlib

    if framework == "jax":
        from kq_jax.qwen3_moe import Qwen3MoeConfig as args
    else:
        args = importlib.import_module(f"mlx_lm.models.{model_type}").ModelArgs
    required = [f.name for f in dataclasses.fields(args)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    return required + [key for key in ("num_hidden_layers", CHECKPOINT_LAYOUTS[model_type][2]) if key not in required]


@dataclass
class RunResult:
    residency: float
    slots: int
    policy: str
    rule: str
    tokens: int
    bits: float  # total over the scored tokens
    bytes: int
    hits: int = 0
    lookups: int = 0
    shed_mass: float = 0.0  # summed over layers and scored tokens
    routed_mass: float = 0.0
    reads: int = 0
    bytes_read: int = 0
    critical_reads: int = 0
    window: int = 64  # scored tokens per bootstrap window (a stream's, with streams)
    memory_bytes: int = 0  # the experts' memory: arena slots of every layer, plus the tier for "tier"
    seconds: float = 0.0
    trace: dict = field(default_factory=dict)
    token_bits: list = field(default_factory=list)  # each scored token's bits, in text order
    layer_hit_rates: list = field(default_factory=list)  # each layer's hit rate (over its streams)
    windows: int = 1  # windows decoded a stream (window_plan)
    context: int = 0  # the longest window's tokens: the most context a scored token had
    trained_length: int | None = None  # the length of the sequences the checkpoint was trained on

    def score(self, bits: float) -> None:
        """Adds one scored token's bits."""
        self.bits += bits
        self.token_bits.append(bits)

    @property
    def perplexity(self) -> float:
        return math.exp(self.bits * math.log(2) / self.tokens)

    @property
    def bits_per_byte(self) -> float:
        return self.bits / self.bytes

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("trace", "token_bits")}
        out.update(perplexity=self.perplexity, bits_per_byte=self.bits_per_byte,
                   hit_rate=self.hits / self.lookups if self.lookups else 1.0,
                   shed_mass_per_token=self.shed_mass / self.tokens, reads_per_token=self.reads / self.tokens,
                   mib_per_token=self.bytes_read / self.tokens / 2**20,
                   critical_reads_per_token=self.critical_reads / self.tokens,
                   memory_mib=self.memory_bytes / 2**20)
        return out


# ---- runs --------------------------------------------------------------------------------------


def window_result(config: StudyConfig, length: int, residency: float, slots: int, policy: str, rule: str,
                   scored_bytes: int, warmup: int | None = None) -> RunResult:
    """An empty :class:`RunResult` for one window of ``length`` tokens (``warmup`` of them unscored,
    ``config.warmup`` by default)."""
    warmup = config.warmup if warmup is None else warmup
    return RunResult(residency, slots, policy, rule, max(length - 1 - warmup, 0), 0.0, scored_bytes,
                     context=length - 1, trained_length=trained_length(config.checkpoint))


def text_tokens(config: StudyConfig, tokenizer) -> tuple[np.ndarray, int]:
    """The text's first ``warmup + tokens + 1`` tokens, and the bytes of the scored ones; with
    ``streams`` above 1, that many windows of as many tokens ``[streams, warmup + tokens + 1]``, spread
    evenly over the text without overlapping, and the bytes of all their scored tokens."""
    path = Path(config.text or Path(config.checkpoint) / "heldout.txt")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise ValueError(f"--text: cannot read {path} ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"--text: {path} is not UTF-8 text (byte {error.start})") from None
    if "\0" in text:
        raise ValueError(f"--text: {path} holds NUL characters, not text")
    needed = config.warmup + config.tokens + 1
    tokens = np.array(tokenizer.encode(text).ids, np.int32)
    if tokens.size < needed * config.streams:
        raise ValueError(f"--text: {path} has {tokens.size} tokens; --streams x (--warmup + --tokens + 1) = "
                         f"{config.streams} x {needed}")
    if config.streams == 1:
        tokens = tokens[:needed]
        return tokens, len(tokenizer.decode(tokens[config.warmup + 1:].tolist()).encode())
    starts = np.linspace(0, tokens.size - needed, config.streams).astype(np.int64)
    windows = np.stack([tokens[start:start + needed] for start in starts])
    return windows, sum(len(tokenizer.decode(w[config.warmup + 1:].tolist()).encode()) for w in windows)


def layer_hit_rates(before, after, layers: int) -> list[float]:
    """Each model layer's hit rate between two ``manager.stats()`` per-layer lists, manager layers
    ``l * n .. (l + 1) * n - 1`` being layer l's (n streams); empty where the manager keeps none."""
    if not after:
        return []
    per = len(after) // layers
    rates = []
    for layer in range(layers):
        span = range(layer * per, (layer + 1) * per)
        lookups = sum(after[i].lookups - before[i].lookups for i in span)
        rates.append(sum(after[i].hits - before[i].hits for i in span) / lookups if lookups else 1.0)
    return rates


def decode_through_arena(tokens: list[int], warmup: int, result: RunResult, manager, token, *,
                         generate: int = 0) -> RunResult:
    """Teacher-forced decode of ``tokens``, the residency manager's step between tokens; then, with
    ``generate``, that many greedy tokens more (appended to ``tokens``, kept in ``result.trace``).

    ``token(position, token_id, tables)`` runs one token against the slot tables and returns
    ``(logits [1, V], report)``, every layer's :class:`~kq_host.residency.LayerReport` stacked
    (``[L, 1, k]`` arrays, ``served`` included). The arena starts with each layer's lowest-numbered
    experts; the predictions of the given tokens from ``warmup`` on are scored, and the statistics count
    from ``warmup`` on.
    """
    try:  # the manager closed however the run ends (a failed read ends it)
        for layer in range(manager.num_layers):
            manager.preload(layer, range(manager.num_slots))
        tables = manager.snapshot()
        given = len(tokens)
        start = time.perf_counter()
        token_seconds = []
        for position in range(given - 1 + generate):
            if position == warmup:
                layers_before, before = manager.stats()
            token_start = time.perf_counter()
            logits, report = token(position, tokens[position], tables)
            if position + 1 >= given:
                tokens.append(int(np.argmax(np.asarray(logits)[0])))
            elif position >= warmup:
                result.score(token_bits(logits, tokens[position + 1]))
            if position >= warmup:
                for layer in range(manager.num_layers):
                    scores = report.scores[layer]
                    result.routed_mass += float(scores.sum())
                    result.shed_mass += float(scores.sum() - report.served[layer].sum())
                    if result.rule == "stall":  # each missing expert read before the token goes on
                        routed = report.indices[layer].astype(np.int64)
                        result.critical_reads += int((tables[layer][routed] < 0).sum())
            tables = manager.step(report)
            manager.raise_failures(f"token {position}")  # a shed read would change the figures unsaid
            token_seconds.append(time.perf_counter() - token_start)
        layers_after, after = manager.stats()
    finally:
        manager.close()
    since = after.since(before)
    result.hits, result.lookups = since.hits, since.lookups
    result.layer_hit_rates = layer_hit_rates(layers_before, layers_after, manager.num_layers)
    result.reads, result.bytes_read = since.reads_landed, since.bytes_read
    result.seconds = time.perf_counter() - start
    result.trace["tokens"] = tokens
    result.trace["token_seconds"] = token_seconds  # each token's graph, readback and manager step
    return result


def token_bits(logits, target: int) -> float:
    logits = np.asarray(logits[0], np.float64)
    top = logits.max()
    return float((top + math.log(np.exp(logits - top).sum()) - logits[target]) / math.log(2))


def grid(config: StudyConfig, rules=RULES) -> list[tuple[float, str, str]]:
    """The runs, for the configured rules among ``rules``. At 100% residency each rule runs once, with the
    first policy: no expert is ever evicted, so the policies agree, but a rule may still change the output
    with no miss at all (``renormalize`` scales every row's weights to 1)."""
    runs = []
    for residency in config.residencies:
        for policy in config.policies:
            for rule in (r for r in config.rules if r in rules and r != "uniform"):
                if residency == 1.0 and policy != config.policies[0]:
                    continue
                runs.append((residency, policy, rule))
    if "uniform" in config.rules and "uniform" in rules:
        runs.append((0.0, "-", "uniform"))
    return runs


def run_study(study, *, progress: bool = True) -> tuple[RunResult, list[RunResult]]:
    """The resident run and every run of the study's grid; ``study`` from :func:`kq.study_runner.make_study`."""
    runs = grid(study.config, study.rules)
    results = []
    with progress_bar(len(runs) + 1, enabled=progress, description="kq study") as advance:
        resident = study.resident()
        advance("resident")
        for residency, policy, rule in runs:
            results.append(study.run(residency, policy, rule))
            advance(f"{residency:.3g} {policy} {rule}")
    return resident, results


def paired_interval(run: RunResult, resident: RunResult, *, window: int | None = None, level: float = 0.95,
                    resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of ``run``'s perplexity over ``resident``'s, minus one, paired by token.

    The scored tokens are cut into consecutive windows of ``window`` (default ``run.window``: 64, or
    a stream's scored tokens when streams ran; a last, shorter one dropped, so nearby tokens, which
    share the arena's state, stay together); windows are drawn with replacement, and the ratio is
    taken over the drawn windows' tokens in both runs.

    Returns:
        ``(low, high)``: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles; NaN where fewer than
        two windows fit.
    """
    window = window or run.window
    count = min(len(run.token_bits), len(resident.token_bits)) // window
    if count < 2:
        return math.nan, math.nan
    cut = count * window
    gap = (np.asarray(run.token_bits[:cut]) - np.asarray(resident.token_bits[:cut])).reshape(count, window).sum(1)
    draws = np.random.default_rng(seed).integers(0, count, size=(resamples, count))
    ratios = np.exp(gap[draws].sum(axis=1) * math.log(2) / cut) - 1.0
    return tuple(float(q) for q in np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2]))


def format_table(resident: RunResult, results: list[RunResult]) -> str:
    header = ("residency", "slots", "policy", "rule", "perplexity", "vs resident", "95% interval", "bits/byte",
              "hit rate",
              "shed mass/token", "reads/token", "MiB/token", "critical reads/token", "expert MiB")
    rows = [("100%", resident.slots, "-", "resident", f"{resident.perplexity:.3f}", "-", "-",
             f"{resident.bits_per_byte:.4f}", "-", "-", "-", "-", "-", _mib(resident.memory_bytes))]
    for r in results:
        s = r.summary()
        low, high = paired_interval(r, resident)
        rows.append((f"{r.residency:.1%}", r.slots, r.policy, r.rule, f"{r.perplexity:.3f}",
                     f"{r.perplexity / resident.perplexity - 1:+.1%}",
                     "-" if math.isnan(low) else f"[{low:+.1%}, {high:+.1%}]", f"{r.bits_per_byte:.4f}",
                     f"{s['hit_rate']:.3f}", f"{s['shed_mass_per_token']:.3f}", f"{s['reads_per_token']:.2f}",
                     f"{s['mib_per_token']:.3f}", f"{s['critical_reads_per_token']:.2f}" if r.rule == "stall" else "-",
                     _mib(r.memory_bytes)))
    return render_table(header, rows, left=(2, 3)) + "\n" + window_note(resident)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}" if nbytes else "-"


def write_json(config: StudyConfig, resident: RunResult, results: list[RunResult], path, *,
               lookahead: dict | None = None) -> None:
    """Every run's numbers, and ``lookahead`` (:func:`kq.replay.replay_grid`'s result) where given."""
    import platform

    import jax

    payload = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "jax": jax.__version__,
               "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
               "resident": resident.summary(),
               "runs": [dict(r.summary(), interval_95=paired_interval(r, resident)) for r in results]}
    if lookahead is not None:
        payload["lookahead"] = lookahead
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


def write_plot(resident: RunResult, results: list[RunResult], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in sorted({r.policy for r in results}):
        for rule in RULES:
            line = sorted((r.residency, r.perplexity, r.hits / max(r.lookups, 1)) for r in results
                          if r.rule == rule and (r.policy == policy or r.residency == 1.0))
            if len(line) < 2 or not any(r.rule == rule and r.policy == policy for r in results):
                continue
            style = "-" if policy == "lfu" else "--"
            left.plot([x for x, _, _ in line], [y for _, y, _ in line], style, marker="o", label=f"{rule} ({policy})")
            if rule == RULES[0]:
                right.plot([x for x, _, _ in line], [h for _, _, h in line], style, marker="o", label=policy)
    left.axhline(resident.perplexity, color="gray", linewidth=0.8, label="resident")
    left.set(xlabel="residency (fraction of each layer's experts)", ylabel="perplexity", yscale="log",
             title="held-out perplexity")
    right.set(xlabel="residency", ylabel="hit rate", title="hit rate (route_shed)", ylim=(0, 1.02))
    left.legend(fontsize=7)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

