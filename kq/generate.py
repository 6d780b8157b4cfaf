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
import json
import math
import os
import resource
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from kq_core.validate import is_int, is_real
from kq_host.checkpoint import (MODEL_FILES, CheckpointError, check_packed_words, check_regular_files, check_shards,
                                model_files, refusal_summary)
from kq_host.expert_store import ExpertStoreError, read_safetensors_headers
from kq_host.residency import MAX_QUEUE_DEPTH

RULES = ("exact", "tier", "shed")
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
        prompt: the text to continue.
        max_tokens: tokens to generate (fewer if the model ends the sequence).
        residency: the fraction of each MoE layer's experts the arena holds, in ``(0, 1]``.
        rule: what a routed expert not in the arena gets (:data:`RULES`).
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
        overlap: build and dispatch the next token before this token's boundary (generate_greedy's overlap):
            faster, but a slot written while a token is in flight copies its layer's arena arrays, so the
            peak memory holds the written layers' arenas twice. Off: the arena is written in place.
        floor: measure the time to first token's floor too (:attr:`GenerateResult.floor_s`): the model loaded
            again with every expert in memory (it must fit) and the prompt's experts read again.
    """

    model: str | Path
    prompt: str
    max_tokens: int = 64
    residency: float = 0.25
    rule: str = "exact"
    tier_bits: int | None = None
    tier_group_size: int | None = None
    tier_model: str | Path | None = None
    queue_depth: int = 8
    timeout: float | None = None
    float32: bool = False
    overlap: bool = False
    floor: bool = False


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
    model = Path(config.model)
    try:
        if not model.is_dir():
            raise _fail("--model", f"{model} is not a directory (an mlx-lm model directory: config.json, "
                                   f"{MODEL_FILES})")
        _check_regular_files("--model", model)  # before anything opens a file: a FIFO would hang its reader
        if not (model / "config.json").is_file():
            raise _fail("--model", f"{model} has no config.json: not an mlx-lm model directory")
        if not model_files(model):
            raise _fail("--model", f"{model} holds no {MODEL_FILES} file (the weights files mlx-lm loads)")
        check_shards(model)
        for path in model_files(model):
            if not path.is_file():  # a pipe or a device would block mlx-lm's load, a directory fail it
                raise _fail("--model", f"{path} is not a regular file (mlx-lm loads every {MODEL_FILES} file)")
        settings = json.loads((model / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise _fail("--model", f"{model / 'config.json'} is not JSON ({error})") from None
    except CheckpointError as error:
        raise _fail("--model", str(error)) from None
    except (OSError, ValueError) as error:
        if isinstance(error, GenerateError):
            raise
        raise _fail("--model", f"{model}: unreadable ({type(error).__name__}: {error})") from None
    if not isinstance(settings, dict):
        raise _fail("--model", f"{model / 'config.json'} holds {type(settings).__name__}, not a JSON object")
    top_k = settings.get("num_experts_per_tok")  # the key of every family mlx-lm names a routing width for
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise _fail("--model", f"{model / 'config.json'}: num_experts_per_tok must be an int >= 1 (the experts a "
                               f"token routes to), got {top_k!r}")
    if "quantization" in settings:  # mlx-community's layout: each quantized module's words as mlx-lm takes them
        try:
            check_packed_words(read_safetensors_headers(model_files(model)))
        except ExpertStoreError as error:
            raise _fail("--model", str(error)) from None
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
    if not is_real(residency) or not 0 < residency <= 1:
        raise _fail("--residency", f"must be a fraction in (0, 1] of each layer's experts, got {residency!r}")
    if config.rule not in RULES:
        raise _fail("--rule", f"must be one of {', '.join(RULES)}, got {config.rule!r}")
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


def _load(model_dir: Path):
    """``(model, tokenizer)`` from mlx-lm, lazily: no weight is read until it is evaluated."""
    from mlx_lm import load

    try:
        return load(str(model_dir), lazy=True)
    except Exception as error:  # noqa: BLE001 - mlx-lm's errors for a directory it cannot load vary by cause
        raise _fail("--model", f"mlx-lm cannot load {model_dir} ({type(error).__name__}: "
                               f"{refusal_summary(error)})") from None


def expert_tensor_names(model_dir: Path, blocks) -> dict[int, dict[str, str]]:
    """Each MoE layer's ``{payload key: tensor name}`` in the directory's files: the stacked tensors of the
    model as loaded (mlx-lm's and mlx-community's checkpoints), or where those are absent the Hugging Face
    layout's tensor per expert (``...mlp.experts.{expert}.gate_proj.weight``, stacked by mlx-lm on loading).

    Raises:
        GenerateError: a tensor is in neither layout (the message names both names and the files).
    """
    from kq_host.expert_store import ExpertStoreError, read_safetensors_headers

    files = model_files(model_dir)
    try:
        present = set(read_safetensors_headers(files))
    except ExpertStoreError as error:
        raise _fail("--model", str(error)) from None
    names = {}
    for layer, block in enumerate(blocks):
        parent = block.module_path.rpartition(".")[0]
        names[layer] = {}
        for key, stacked in block.tensor_names().items():
            per_expert = f"{parent}.experts.{{expert}}.{key}" + ("" if "." in key else ".weight")
            if stacked in present:
                names[layer][key] = stacked
            elif per_expert.replace("{expert}", "0") in present:
                names[layer][key] = per_expert
            else:
                raise _fail("--model", f"{model_dir}: neither {stacked} nor {per_expert.replace('{expert}', '0')} is "
                                       f"in {', '.join(f.name for f in files[:3])}{' ...' if len(files) > 3 else ''} "
                                       f"(mlx_lm.convert writes the stacked layout kq reads)")
    return names


def _tier_source(model_dir: Path, blocks, names, quantization, stack):
    """A store handing :func:`kq_host.tier.build_tier` each MoE layer's float projections."""
    from kq_host.checkpoint import DequantizedExperts
    from kq_host.expert_store import ExpertStore

    if quantization is None:
        weights = {layer: {p: keys[p] for p in blocks[layer].projections} for layer, keys in names.items()}
    else:
        weights = {layer: {f"{p}.{a}": keys[f"{p}.{a}"] for p in blocks[layer].projections
                           for a in ("weight", "scales", "biases")} for layer, keys in names.items()}
    store = stack(ExpertStore.for_tensors(model_files(model_dir), weights))
    if quantization is None:
        return store
    return DequantizedExperts(store, quantization, blocks[0].projections,
                              module=lambda layer, projection: f"{blocks[layer].module_path}.{projection}")


def _attach_tier(config: GenerateConfig, model_dir: Path, blocks, names, quantization, stack):
    """Builds or reads the tier and gives it to the blocks; returns it and its bytes on the device."""
    from mlx.utils import tree_flatten

    from kq_host.checkpoint import tier_from_checkpoint
    from kq_host.expert_store import ExpertReadError
    from kq_host.tier import TierOptionError, build_tier
    from kq_mlx.mlx_lm_adapter import attach_tier

    source = _tier_source(model_dir, blocks, names, quantization, stack)
    layers, experts = len(blocks), blocks[0].num_experts
    if config.tier_model is not None:
        try:
            tier = tier_from_checkpoint(config.tier_model, source, layers, experts)
        except ExpertReadError as error:  # the disk, not an argument
            raise _read_failed("the tier's read from --tier-model", error) from None
        except (TierOptionError, ExpertStoreError) as error:
            raise _fail("--tier-model", str(error)) from None
    else:
        options = {name: value for name, value in (("bits", config.tier_bits), ("group_size", config.tier_group_size))
                   if value is not None}
        try:
            tier = build_tier(source, layers, experts, **options)
        except TierOptionError as error:
            raise _fail("--tier-bits/--tier-group-size", str(error)) from None
        except ExpertReadError as error:
            raise _read_failed("the tier's build", error) from None
        except ExpertStoreError as error:  # the stored experts are not what config.json's "quantization" says
            raise _fail("--model", f"the experts' tensors: {error}") from None
    try:
        attach_tier(blocks, tier)
    except ValueError as error:  # a tier whose widths are not the model's as loaded
        raise _fail("--tier-model" if config.tier_model is not None else "--model",
                    f"the tier does not fit the model as mlx-lm loads it ({error})") from None
    # What the tier takes on the device (attach_tier may widen its scales and biases to the arena's float dtype).
    return tier, sum(_nbytes(a for _, a in tree_flatten(block.tier.parameters())) for block in blocks)


def _warn_tier_size(tier, tier_bytes: int, experts_bytes: int, widened: bool) -> None:
    """A warning where the tier takes no less memory than every expert it stands in for, as stored: it saves
    nothing over holding the experts themselves."""
    if tier_bytes < experts_bytes:
        return
    scales = ", its scales and biases in float32 on the device" if widened else ""
    warnings.warn(f"--rule tier: the tier takes {tier_bytes / 2**20:.1f} MiB ({tier.bits} bits in groups of "
                  f"{tier.group_size}{scales}), no less than the {experts_bytes / 2**20:.1f} MiB of the experts it "
                  f"stands in for as stored: it saves no memory; a smaller --tier-bits, or --rule exact or shed, "
                  f"holds less", stacklevel=3)


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
    """:func:`generate`'s run."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from kq_host.expert_store import ExpertStore, ExpertStoreError
    from kq_host.checkpoint import Quantization
    from kq_host.residency import ResidencyManager
    from kq_mlx.mlx_lm_adapter import SwitchGLUArena, attach_arena, generate_greedy, prefill

    model_dir, settings = _checked(config)
    mx.reset_peak_memory()  # MLX's peak from here: the load, the tier's build, the prompt and the tokens
    started = time.perf_counter()
    stages = {}
    quantization = None
    if "quantization" in settings and config.rule == "tier":  # the tier is built from the experts dequantized
        try:
            quantization = Quantization.of(model_dir)
        except ExpertStoreError as error:
            raise _fail("--model", str(error)) from None
    model, tokenizer = _load(model_dir)
    # quantized as loaded: mlx-lm quantizes some "quantization_config" models (gpt-oss's mxfp4) on loading
    # and dequantizes others (fp8) to float
    quantized = any(isinstance(module, (nn.QuantizedLinear, QuantizedSwitchLinear)) for module in model.modules())
    num_experts = _expert_count(model, model_dir)
    top_k = settings.get("num_experts_per_tok")  # an int >= 1 or absent (_checked)
    if top_k is not None and top_k > num_experts:
        raise _fail("--model", f"{model_dir / 'config.json'}: num_experts_per_tok must be an int in [1, {num_experts}] "
                               f"(the experts of a layer), got {top_k!r}")
    slots = min(num_experts, max(1, round(config.residency * num_experts)))
    blocks = attach_arena(model, slots, keep_experts=False)
    if config.float32 or (mx.default_device() == mx.cpu and not quantized):
        model.set_dtype(mx.float32)  # MLX's CPU gather_mm takes float32 only
    with contextlib.ExitStack() as stack:
        names = expert_tensor_names(model_dir, blocks)
        try:
            store = stack.enter_context(ExpertStore.for_tensors(model_files(model_dir), names,
                                                                queue_depth=max(config.queue_depth, 1)))
        except ExpertStoreError as error:
            raise _fail("--model", f"the experts' tensors: {error}") from None
        tier, tier_bytes = None, 0
        if config.rule == "tier":
            tier_start = time.perf_counter()
            tier, tier_bytes = _attach_tier(config, model_dir, blocks, names, quantization, stack.enter_context)
            stages["tier_s"] = time.perf_counter() - tier_start
            widened = any(a.dtype == mx.float32 for block in blocks for _, a in tree_flatten(block.tier.parameters()))
            _warn_tier_size(tier, tier_bytes, len(blocks) * num_experts * store.expert_nbytes(0), widened)
        for block in blocks:  # exact: a token that misses runs again (generate_greedy), so no miss is ever shed
            block.rule = "shed" if config.rule == "exact" else config.rule
        manager = ResidencyManager(len(blocks), num_experts, slots, arena=SwitchGLUArena(blocks),
                                   loader=lambda layer, expert, slot: store.read_expert(layer, expert),
                                   bytes_per_expert=store.expert_nbytes(0), queue_depth=config.queue_depth,
                                   impl="numpy")
        stack.callback(manager.close)
        mx.eval(model.parameters())  # the other weights, the arenas and the tier: nothing of the dropped experts
        stages["load_s"] = time.perf_counter() - started

        prompt = _encode(tokenizer, config.prompt)
        _warn_past_positions(settings, len(prompt), config.max_tokens)
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        eos = set(tokenizer.eos_token_ids)
        first_token_at = None
        texts = []

        def emit(token: int) -> None:
            nonlocal first_token_at
            if lossy:  # a miss whose read failed is shed and read again later: the text would change unsaid
                manager.raise_failures("generation")
            if first_token_at is None:
                first_token_at = time.perf_counter()
                marks["first"] = manager.stats()[1]
            if token in eos:
                return
            detokenizer.add_token(token)
            segment = detokenizer.last_segment
            if segment:
                texts.append(segment)
                if on_text is not None:
                    on_text(segment)

        marks = {}
        lossy = config.rule != "exact"  # exact reads every miss before its layer runs, and retries a failed read
        cache = make_prompt_cache(model)
        clock = time.perf_counter()
        routed = [set() for _ in blocks]  # the experts each layer's prefill routed
        for start in range(0, len(prompt) - 1, PREFILL_STEP):  # mlx-lm's prefill_step_size passes
            prefill(model, blocks, manager, prompt[start:min(start + PREFILL_STEP, len(prompt) - 1)], cache,
                    timeout=config.timeout)
            for experts, block in zip(routed, blocks):
                experts.update(np.unique(np.array(block.last[0])).tolist())
        if lossy:
            manager.raise_failures("prefill")
        routed_pairs = sum(len(experts) for experts in routed)
        prefill_reads = manager.stats()[1].reads_landed
        stages["prefill_s"] = time.perf_counter() - clock
        tokens = generate_greedy(model, blocks, manager, prompt[-1:], config.max_tokens,
                                 exact=config.rule == "exact", timeout=config.timeout, on_token=emit,
                                 overlap=config.overlap, prefill_prompt=False, cache=cache, stop_tokens=eos)
        ended = time.perf_counter()
        detokenizer.finalize()
        if detokenizer.last_segment:
            texts.append(detokenizer.last_segment)
            if on_text is not None:
                on_text(detokenizer.last_segment)
        total = manager.stats()[1]
        first = marks["first"]
        generated = total.since(first)
        expert_bytes = store.expert_nbytes(0)
        arena_bytes = sum(_nbytes(a for _, a in tree_flatten(block.arena.parameters())) for block in blocks)
        all_bytes = _nbytes(a for _, a in tree_flatten(model.parameters()))
        result = GenerateResult(
            text="".join(texts), prompt_tokens=len(prompt), tokens=tokens, num_layers=len(blocks),
            num_experts=num_experts, slots=slots, quantized=quantized,
            time_to_first_token_s=first_token_at - clock, generation_s=ended - first_token_at,
            prompt_tps=len(prompt) / (first_token_at - clock),
            generation_tps=(len(tokens) - 1) / (ended - first_token_at) if len(tokens) > 1 else float("nan"),
            hit_rate=generated.hit_rate if generated.lookups else math.nan,  # one token: none generated after it
            prompt_reads=first.reads_landed, prompt_routed_pairs=routed_pairs,
            prefill_reads=prefill_reads,
            prompt_read_mib=first.reads_landed * expert_bytes / 2**20,
            generation_reads=generated.reads_landed,
            mib_read_per_token=(generated.reads_landed * expert_bytes / 2**20 / (len(tokens) - 1) if len(tokens) > 1
                                else math.nan),
            expert_mib=expert_bytes / 2**20, experts_mib=len(blocks) * num_experts * expert_bytes / 2**20,
            arena_mib=arena_bytes / 2**20, tier_mib=tier_bytes / 2**20,
            other_weights_mib=(all_bytes - arena_bytes - tier_bytes) / 2**20, peak_rss_mib=_peak_rss_mib(),
            mlx_peak_mib=mx.get_peak_memory() / 2**20, device=str(mx.default_device()), stages=stages,
            tier_bits=None if tier is None else tier.bits, tier_group_size=None if tier is None else tier.group_size)
        if config.floor:
            try:
                result.read_bandwidth_gbs = _read_bandwidth(store, routed)
            except ExpertStoreError as error:  # the disk failed, or the file changed since the run read it
                raise _read_failed("--floor: the prompt's experts read again", error) from None
    if config.floor:
        result.resident_prefill_s = _resident_prefill_seconds(model_dir, prompt,
                                                              config.float32 or not quantized)
        reads_s = (0.0 if result.read_bandwidth_gbs is None
                   else result.prompt_routed_pairs * expert_bytes / (result.read_bandwidth_gbs * 1e9))
        result.floor_s = reads_s + result.resident_prefill_s
    return result


def _expert_count(model, model_dir: Path) -> int:
    """The experts of the model's first SwitchGLU / SwitchMLP (from its lazy arrays' shapes: nothing read)."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    import mlx.core as mx

    for _, module in model.named_modules():
        if isinstance(module, (SwitchGLU, SwitchMLP)):
            for child in module.children().values():
                weight = child.get("weight") if hasattr(child, "get") else None
                if isinstance(weight, mx.array) and weight.ndim == 3:
                    return int(weight.shape[0])
    raise _fail("--model", f"{model_dir} is not an MoE model: {type(model).__module__} has no SwitchGLU or "
                           f"SwitchMLP (mlx_lm.models.switch_layers) to put an arena in")


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
