"""``kq generate``: an mlx-lm MoE model directory generating text with a bounded expert memory.

The model is loaded lazily (``mlx_lm.load(path, lazy=True)``) and :func:`~kq_mlx.mlx_lm_adapter.attach_arena`
puts an arena of ``residency`` of each MoE layer's experts at every SwitchGLU, dropping the layers' own
experts before anything evaluates them: no expert is ever in memory but those in the arena (and the tier).
The residency manager fills the arenas from the directory's safetensors files through
:meth:`kq_host.expert_store.ExpertStore.for_arenas` (one expert's slice of each stacked tensor a read).
The prompt runs through :func:`~kq_mlx.mlx_lm_adapter.prefill` (layer by layer, each routed expert read
once, exactly), then the tokens are generated greedily by :func:`~kq_mlx.mlx_lm_adapter.generate_greedy`
under the rule: ``exact`` (a token that missed runs again once its misses are read: ``mlx_lm.generate``'s
greedy tokens), ``tier`` (a miss computed with its low-precision copy) or ``shed`` (a miss's output
dropped).
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable


from kq.model_options import RULES
from kq_core.rules import check_rule
from kq_core.validate import is_int, is_real
from kq_host.checkpoint import (CheckpointError, check_regular_files)
from kq_host.expert_store import ExpertStoreError
from kq_host.residency import MAX_QUEUE_DEPTH

# The most tokens a run generates: an MLX array's axis (the key-value cache's positions) holds at most int32's.
MAX_TOKENS = 2**31 - 1
# Prompt tokens a prefill pass (mlx-lm's default prefill_step_size).
PREFILL_STEP = 2048


class GenerateError(ValueError):
    """A bad argument or model directory; the message names the argument (``--model``...) or the file."""


@dataclass
class GenerateConfig:
    """What :func:`generate` runs.

    Attributes:
        model: an mlx-lm model directory (``config.json``, ``model*.safetensors``, the tokenizer), float or quantized.
        prompt: the text to continue, or with the tokenizer's chat template the user's message.
        max_tokens: tokens to generate (fewer if the model ends the sequence).
        residency: the fraction of each MoE layer's experts the arena holds, in ``(0, 1]``
            (:data:`kq_mlx.load.DEFAULT_RESIDENCY` where neither it nor ``memory`` is given).
        memory: instead of ``residency``, the memory budget (bytes, or a text such as ``"8GiB"``):
            :func:`kq_host.memory_plan.plan_memory` sizes the arena with what the rest leaves.
        context: tokens of KV cache the budget keeps room for.
        rule: what a generated token's routed expert not in the arena gets (:data:`kq.model_options.RULES`:
            ``exact``, ``tier`` or ``shed``, as :mod:`kq_core.rules` defines them).
        tier_bits, tier_group_size: rule ``tier``: the experts quantized to this many bits
            (:func:`kq_host.tier.build_tier`, cached on disk); default :data:`kq_host.tier.DEFAULT_TIER_BITS`
            bits, groups of :data:`kq_host.tier.DEFAULT_TIER_GROUP_SIZE`.
        tier_model: rule ``tier``: read the tier from a lower-bit mlx-lm conversion of the same model instead.
        queue_depth: the residency manager's reads in flight.
        timeout: seconds a wait for reads may take (None: no limit).
        float32: run every float parameter (a quantized model's scales and biases too) in float32: MLX's CPU
            quantized matmul runs several times faster on float32 than on bfloat16 (the tokens may then differ
            from the model's own dtype's). Float models run in float32 on MLX's CPU backend regardless (its
            gather_mm takes float32 only).
        temp, top_p, top_k, min_p: the sampler (``mlx_lm.sample_utils.make_sampler``; temp 0 is greedy, top_k 0
            and min_p 0 are off).
        seed: MLX's random seed before the sampling (None: as it is).
        chat_template: wrap the prompt in the tokenizer's chat template, where it has one (a user message, after
            ``system_prompt``), as ``mlx_lm.generate`` does.
        system_prompt: the chat template's system message.
        floor: measure the time to first token's floor too (:attr:`GenerateResult.floor_s`): the model loaded
            again with every expert in memory (it must fit) and the prompt's experts read again.
        progress: called with ``(tokens read, tokens in the prompt)`` while the prompt is read.
    """

    model: str | Path
    prompt: str
    max_tokens: int = 64
    residency: float | None = None
    memory: str | int | None = None
    context: int = 4096
    rule: str = "exact"
    tier_bits: int | None = None
    tier_group_size: int | None = None
    tier_model: str | Path | None = None
    queue_depth: int = 8
    timeout: float | None = None
    float32: bool = False
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    chat_template: bool = True
    system_prompt: str | None = None
    floor: bool = False
    progress: Callable[[int, int], None] | None = None


@dataclass
class GenerateResult:
    """What a run produced and measured (times in seconds, sizes in MiB)."""

    text: str
    prompt_tokens: int
    tokens: list[int]
    num_layers: int
    num_experts: int
    slots: int
    quantized: bool
    time_to_first_token_s: float
    generation_s: float
    prompt_tps: float
    generation_tps: float
    hit_rate: float  # routed entries of the generated tokens found resident (the prompt's excluded; NaN: one token)
    prompt_reads: int  # experts read from the start to the first token
    prompt_routed_pairs: int  # distinct (layer, expert) pairs the prompt's prefill routed
    prefill_reads: int  # experts read by the prefill (the prompt but its last token)
    prompt_read_mib: float
    generation_reads: int
    mib_read_per_token: float  # generated tokens only (NaN: one token)
    expert_mib: float  # one expert, as stored
    experts_mib: float  # every expert of the model, as stored
    arena_mib: float
    tier_mib: float
    other_weights_mib: float
    peak_rss_mib: float
    mlx_peak_mib: float
    device: str
    read_bandwidth_gbs: float | None = None  # floor: the prompt's experts read again, bytes over seconds
    resident_prefill_s: float | None = None  # floor: the model with every expert, prompt to first token
    floor_s: float | None = None  # the prompt's distinct experts' bytes / read bandwidth + resident_prefill_s
    stages: dict = field(default_factory=dict)  # seconds: load, tier, prefill
    tier_bits: int | None = None  # rule tier: the tier's bits a weight (None: no tier)
    tier_group_size: int | None = None

    @property
    def memory_bound_mib(self) -> float:
        """The peak resident memory aimed at: arena + tier + the other weights + 1 GiB."""
        return self.arena_mib + self.tier_mib + self.other_weights_mib + 1024.0

    def to_json(self) -> dict:
        """The figures as JSON values: a rate of one token (NaN) as null."""
        figures = {**asdict(self), "memory_bound_mib": self.memory_bound_mib}
        return {key: None if isinstance(value, float) and not math.isfinite(value) else value
                for key, value in figures.items()}


def _fail(argument: str, message: str) -> GenerateError:
    return GenerateError(f"{argument}: {message}")


def check_config(config: GenerateConfig) -> Path:
    """Checks every option before anything loads; returns the model directory.

    Raises:
        GenerateError: naming the argument (``--model``, ``--residency``...) or the file.
    """
    return _checked(config)[0]


def _checked(config: GenerateConfig) -> tuple[Path, dict]:
    """:func:`check_config`'s checks: ``(the model directory, its config.json as read)``."""
    for argument, value in (("--model", config.model), ("--tier-model", config.tier_model)):
        if not isinstance(value, (str, os.PathLike)) and (argument == "--model" or value is not None):
            raise _fail(argument, f"must be a directory path, got {value!r}")
    from kq.model_options import flag_of
    from kq_mlx.load import LoadError, checked_directory

    try:
        model, settings = checked_directory(config.model)
    except LoadError as error:
        raise GenerateError(flag_of(error)) from None
    if config.rule == "tier" and "quantization" not in settings and "quantization_config" in settings:
        method = settings["quantization_config"]
        method = method.get("quant_method") if isinstance(method, dict) else method
        raise _fail("--rule", f"tier: {model} is quantized by its quantization_config ({method!r}), which mlx-lm "
                              f"converts on loading; kq builds a tier from float experts or mlx-community's "
                              f"affine ones (\"quantization\" in config.json)")
    if not isinstance(config.prompt, str) or not config.prompt:
        raise _fail("--prompt", "must be a non-empty text")
    try:
        config.prompt.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate: bytes of the command line that were not UTF-8
        raise _fail("--prompt", f"is not valid text (a character UTF-8 cannot encode at {error.start}: "
                                f"{config.prompt[error.start]!r}); give the prompt in UTF-8") from None
    if not is_int(config.max_tokens) or config.max_tokens < 1:
        raise _fail("--max-tokens", f"must be an int >= 1, got {config.max_tokens!r}")
    if config.max_tokens > MAX_TOKENS:
        raise _fail("--max-tokens", f"must be an int in [1, {MAX_TOKENS}] (an MLX array's axis, the key-value "
                                    f"cache's positions, holds at most {MAX_TOKENS}), got {config.max_tokens!r}")
    residency = config.residency
    if residency is not None and (not is_real(residency) or not 0 < residency <= 1):
        raise _fail("--residency", f"must be a fraction in (0, 1] of each layer's experts, got {residency!r}")
    if residency is not None and config.memory is not None:
        raise _fail("--memory/--residency", "give one of them: a budget in bytes or the fraction of each layer's "
                                            "experts to keep")
    for name, value, low, high in (("--temp", config.temp, 0, math.inf), ("--top-p", config.top_p, 0, 1),
                                   ("--min-p", config.min_p, 0, 1)):
        if not is_real(value) or not low <= value <= high:
            raise _fail(name, f"must be a number in [{low}, {high}], got {value!r}")
    if not is_int(config.top_k) or config.top_k < 0:
        raise _fail("--top-k", f"must be an int >= 0 (0: off), got {config.top_k!r}")
    if config.seed is not None and (not is_int(config.seed) or not 0 <= config.seed < 2**64):
        raise _fail("--seed", f"must be an int in [0, 2**64), got {config.seed!r}")
    if config.system_prompt is not None and not isinstance(config.system_prompt, str):
        raise _fail("--system-prompt", f"must be a text, got {config.system_prompt!r}")
    try:
        check_rule(config.rule, "kq generate", argument="--rule", allowed=RULES)
    except ValueError as error:  # kq generate's errors name the argument first
        raise _fail("--rule", str(error).partition(" --rule ")[2]) from None
    tier_options = config.tier_bits is not None or config.tier_group_size is not None
    if config.rule != "tier" and (tier_options or config.tier_model is not None):
        raise _fail("--tier-bits/--tier-group-size/--tier-model", f"serve the misses of --rule tier; the rule is "
                                                                  f"{config.rule!r}")
    if tier_options and config.tier_model is not None:
        raise _fail("--tier-model", "reads the tier's bits from its checkpoint: give it or --tier-bits, not both")
    if config.tier_model is not None and not Path(config.tier_model).is_dir():
        raise _fail("--tier-model", f"{config.tier_model} is not a directory")
    if config.tier_model is not None:
        _check_regular_files("--tier-model", Path(config.tier_model))
    if (not is_int(config.queue_depth)
            or not 0 <= config.queue_depth <= MAX_QUEUE_DEPTH):
        raise _fail("--queue-depth", f"must be an int in [0, {MAX_QUEUE_DEPTH}], got {config.queue_depth!r}")
    if config.timeout is not None and (not is_real(config.timeout) or not config.timeout > 0):
        raise _fail("--timeout", f"must be a number of seconds > 0, got {config.timeout!r}")
    return model, settings


def _check_regular_files(argument: str, directory: Path) -> None:
    """GenerateError naming ``argument`` and the file where the directory holds a FIFO, a device or a socket
    (:func:`kq_host.checkpoint.check_regular_files`), or cannot be listed."""
    try:
        check_regular_files(directory)
    except CheckpointError as error:
        raise _fail(argument, str(error)) from None
    except OSError as error:
        raise _fail(argument, f"{directory}: unreadable ({type(error).__name__}: {error})") from None


def _read_failed(what: str, error: Exception):
    """A read of the experts that failed, as the residency manager reports its own: the disk's state, not an
    argument (``kq generate`` ends at it in one line, exit 1)."""
    from kq_host.residency import PreloadError

    return PreloadError(f"{what}: {error}", [], [])


def _nbytes(arrays) -> int:
    return sum(array.nbytes for array in arrays)


def _peak_rss_mib() -> float:
    """This process's peak resident set: ``VmHWM`` where ``/proc`` has it (``ru_maxrss`` outlives ``exec``: a
    process started by a large one reports its parent's peak), else ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def generate(config: GenerateConfig, on_text: Callable[[str], None] | None = None) -> GenerateResult:
    """Generates ``config.max_tokens`` tokens after ``config.prompt`` with a bounded expert memory.

    What the run warns of (a prompt past the model's positions, a tier no smaller than the experts it stands in
    for, the tier cache's troubles) is a ``UserWarning``, shown as one line ``warning: ...``.

    Args:
        config: what to run (:class:`GenerateConfig`).
        on_text: called with each new piece of text as the tokens come (mlx-lm's streaming detokenizer).

    Returns:
        :class:`GenerateResult`.

    Raises:
        GenerateError: a bad option, a directory mlx-lm cannot load, a model with no MoE layer, a tier that
            does not fit the model.
        kq_host.residency.PreloadError: reads failed or ran past ``config.timeout``, or a read of the tier's
            build or of ``config.floor``'s re-read failed (the disk's error, or a file changed since its header
            was read).
    """
    with _one_line_warnings():
        return _generate(config, on_text)


@contextlib.contextmanager
def _one_line_warnings():
    """Warnings shown as one line ``warning: MESSAGE`` within the block (Python's format names the source file
    and line, then quotes the line): a command's user reads what, not where. Only the format changes: the
    filters, and a program's own ``showwarning`` or recording, are as they were."""
    formatted = warnings.formatwarning

    def one_line(message, category, filename, lineno, line=None) -> str:
        return f"warning: {' '.join(str(message).split())}\n"

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = formatted


def _generate(config: GenerateConfig, on_text: Callable[[str], None] | None) -> GenerateResult:
    """:func:`generate`'s run: the model from :func:`kq_mlx.load.load`, the tokens from ``mlx_lm.stream_generate``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from kq.model_options import flag_of
    from kq_mlx.load import LoadError, load, stream_of

    model_dir, settings = _checked(config)
    mx.reset_peak_memory()  # MLX's peak from here: the load, the tier's build, the prompt and the tokens
    started = time.perf_counter()
    try:
        model, tokenizer = load(model_dir, memory=config.memory, residency=config.residency, rule=config.rule,
                                tier_bits=config.tier_bits, tier_group_size=config.tier_group_size,
                                tier_model=config.tier_model, context=config.context, queue_depth=config.queue_depth,
                                timeout=config.timeout, float32=config.float32)
    except LoadError as error:
        raise GenerateError(flag_of(error)) from None
    stream = stream_of(model)
    try:
        stages = {"load_s": time.perf_counter() - started}
        manager, plan, blocks = stream.manager, stream.plan, stream.blocks
        prompt = _prompt_ids(tokenizer, config)
        _warn_past_positions(settings, len(prompt), config.max_tokens)
        if config.seed is not None:
            mx.random.seed(config.seed)
        sampler = make_sampler(config.temp, top_p=config.top_p, min_p=config.min_p, top_k=config.top_k)
        stream.reset_prompt()
        texts, tokens, first, first_token_at = [], [], None, None
        clock = time.perf_counter()
        for response in stream_generate(model, tokenizer, prompt, max_tokens=config.max_tokens, sampler=sampler,
                                        prefill_step_size=PREFILL_STEP, prompt_progress_callback=config.progress):
            if first_token_at is None:
                first_token_at, first = time.perf_counter(), manager.stats()[1]
            tokens.append(int(response.token))
            if response.text:
                texts.append(response.text)
                if on_text is not None:
                    on_text(response.text)
        ended = time.perf_counter()
        stream.end_pass()  # the last pass's reports to the manager
        stages["prefill_s"] = first_token_at - clock
        if config.rule != "exact":
            manager.raise_failures("generation")
        generated = manager.stats()[1].since(first)
        expert_bytes = stream.store.expert_nbytes(0)
        arena_bytes = sum(_nbytes(a for _, a in tree_flatten(block.arena.parameters())) for block in blocks)
        routed = stream.prompt_routed
        prefill_reads = stream.prompt_reads if stream.prompt_reads is not None else first.reads_landed
        tier_format = stream.tier_format or (None, None)
        result = GenerateResult(
            text="".join(texts), prompt_tokens=len(prompt), tokens=tokens, num_layers=len(blocks),
            num_experts=plan.num_experts, slots=plan.slots, quantized=_quantized(model),
            time_to_first_token_s=first_token_at - clock, generation_s=ended - first_token_at,
            prompt_tps=len(prompt) / (first_token_at - clock),
            generation_tps=(len(tokens) - 1) / (ended - first_token_at) if len(tokens) > 1 else float("nan"),
            hit_rate=generated.hit_rate if len(tokens) > 1 and generated.lookups else math.nan,
            prompt_reads=first.reads_landed, prompt_routed_pairs=sum(len(experts) for experts in routed),
            prefill_reads=prefill_reads, prompt_read_mib=first.reads_landed * expert_bytes / 2**20,
            generation_reads=generated.reads_landed,
            mib_read_per_token=(generated.reads_landed * expert_bytes / 2**20 / (len(tokens) - 1) if len(tokens) > 1
                                else math.nan),
            expert_mib=expert_bytes / 2**20, experts_mib=len(blocks) * plan.num_experts * expert_bytes / 2**20,
            arena_mib=arena_bytes / 2**20, tier_mib=stream.tier_bytes / 2**20,
            other_weights_mib=plan.other / 2**20, peak_rss_mib=_peak_rss_mib(),
            mlx_peak_mib=mx.get_peak_memory() / 2**20, device=str(mx.default_device()), stages=stages,
            tier_bits=tier_format[0], tier_group_size=tier_format[1])
        if config.floor:
            try:
                result.read_bandwidth_gbs = _read_bandwidth(stream.store, routed)
            except ExpertStoreError as error:  # the disk failed, or the file changed since the run read it
                raise _read_failed("--floor: the prompt's experts read again", error) from None
    finally:
        stream.close()
    if config.floor:
        result.resident_prefill_s = _resident_prefill_seconds(model_dir, prompt,
                                                              config.float32 or not result.quantized)
        reads_s = (0.0 if result.read_bandwidth_gbs is None
                   else result.prompt_routed_pairs * expert_bytes / (result.read_bandwidth_gbs * 1e9))
        result.floor_s = reads_s + result.resident_prefill_s
    return result


def _quantized(model) -> bool:
    """Whether the model runs quantized layers as loaded (mlx-lm quantizes some ``quantization_config`` models on
    loading, gpt-oss's mxfp4, and dequantizes others, fp8)."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from kq_mlx.mlx_lm_adapter import ArenaLayer

    return any(isinstance(module, (nn.QuantizedLinear, QuantizedSwitchLinear)) for module in model.modules()
               if not isinstance(module, ArenaLayer))


def _prompt_ids(tokenizer, config: GenerateConfig) -> list[int]:
    """The prompt's ids as ``mlx_lm.generate`` makes them: the chat template's (the system message, then the prompt
    as the user's, the assistant's turn begun) where the tokenizer has one and ``chat_template`` is on, else the
    text encoded (:func:`_encode`)."""
    if config.chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": config.system_prompt}] if config.system_prompt else [])
        messages.append({"role": "user", "content": config.prompt})
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        if ids:
            return ids
    return _encode(tokenizer, config.prompt)


def _encode(tokenizer, prompt: str) -> list[int]:
    """The prompt's ids as ``mlx_lm.generate`` encodes a text (the BOS token added unless the text starts with it)."""
    add_special_tokens = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
    ids = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    if not ids and getattr(tokenizer, "vocab_size", 2) <= 1:  # mlx-lm builds an empty one where there is none
        raise _fail("--model", "its tokenizer has no vocabulary: the directory holds no tokenizer files "
                               "(tokenizer.json, tokenizer_config.json)")
    if not ids:
        raise _fail("--prompt", "encodes to no token")
    return ids


def _warn_past_positions(settings: dict, prompt_tokens: int, max_tokens: int) -> None:
    """A warning where the prompt, or the prompt and the tokens asked for, run past the positions the model was
    made for (``config.json``'s ``max_position_embeddings``): the text there is unlikely to follow."""
    positions = settings.get("max_position_embeddings")
    if not is_int(positions) or positions < 1:
        return
    if prompt_tokens > positions:
        warnings.warn(f"--prompt: its {prompt_tokens} tokens run past the {positions} positions the model was made "
                      f"for (config.json's max_position_embeddings); the text generated after it is unlikely to "
                      f"follow it", stacklevel=3)
    elif prompt_tokens + max_tokens > positions:
        warnings.warn(f"--max-tokens: the prompt's {prompt_tokens} tokens and {max_tokens} more run past the "
                      f"{positions} positions the model was made for (config.json's max_position_embeddings); "
                      f"the text past position {positions} is unlikely to follow it", stacklevel=3)


def _read_bandwidth(store, routed: list[set]) -> float | None:
    """GB/s of reading the prompt's routed experts again through the store's reader pool (None: the prompt
    routed none, a prompt of one token)."""
    start = time.perf_counter()
    before = store.bytes_read
    futures = [store.submit(layer, expert) for layer, experts in enumerate(routed) for expert in sorted(experts)]
    for future in futures:
        future.result()
    seconds = time.perf_counter() - start
    return (store.bytes_read - before) / seconds / 1e9 if futures else None


def _resident_prefill_seconds(model_dir: Path, prompt: list[int], float32: bool) -> float:
    """The unmodified model's time from the prompt to its first token, every expert in memory (best of 3)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(model_dir))
    if float32:
        model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    best = math.inf
    for _ in range(3):
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        for begin in range(0, len(prompt) - 1, PREFILL_STEP):
            model(mx.array([prompt[begin:min(begin + PREFILL_STEP, len(prompt) - 1)]]), cache=cache)
            mx.eval([c.state for c in cache])
        mx.eval(mx.argmax(model(mx.array([prompt[-1:]]), cache=cache)[0, -1]))
        best = min(best, time.perf_counter() - start)
    return best


def format_summary(result: GenerateResult) -> str:
    """The run's figures, a few lines for the terminal."""
    lines = [
        f"prompt: {result.prompt_tokens} tokens, {result.prompt_tps:.1f} tokens/s, first token after "
        f"{result.time_to_first_token_s:.3f} s; {result.prompt_reads} experts read "
        f"({result.prompt_routed_pairs} (layer, expert) pairs routed), {result.prompt_read_mib:.1f} MiB",
        f"generation: {len(result.tokens)} tokens, "
        + (f"{result.generation_tps:.1f} tokens/s, hit rate {result.hit_rate:.3f}, "
           f"{result.mib_read_per_token:.2f} MiB read a token" if len(result.tokens) > 1
           else "the first alone (no rate, nothing generated after it)"),
        f"arena: {result.slots} of {result.num_experts} experts x {result.num_layers} MoE layers, "
        f"{result.arena_mib:.1f} MiB (all experts {result.experts_mib:.1f} MiB); "
        + (f"tier ({result.tier_bits}-bit, groups of {result.tier_group_size}) {result.tier_mib:.1f} MiB; "
           if result.tier_bits is not None else "")
        + f"other weights {result.other_weights_mib:.1f} MiB",
        f"peak memory: {result.peak_rss_mib:.0f} MiB resident (bound {result.memory_bound_mib:.0f} MiB), "
        f"MLX {result.mlx_peak_mib:.0f} MiB ({result.device})",
    ]
    if result.floor_s is not None:
        read = ("nothing to read" if result.read_bandwidth_gbs is None
                else f"read {result.read_bandwidth_gbs:.2f} GB/s")
        lines.append(f"time to first token's floor: {result.floor_s:.3f} s ({read}, "
                     f"resident prefill {result.resident_prefill_s:.3f} s): "
                     f"{result.time_to_first_token_s / result.floor_s:.2f}x")
    return "\n".join(lines)
