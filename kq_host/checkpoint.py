"""Checkpoint directories (``config.json`` and ``*.safetensors``): where a checkpoint keeps its experts,
how wide they are, how long the model was trained, and its experts read one at a time, float or quantized.

Families by ``config.json``'s ``model_type``: each expert's projections' tensor names (Hugging Face
names, in the arena's projection order gate, up, down), the config key of the expert count and of the
experts' hidden width; :func:`trained_length` reads the sequence length the checkpoint was trained on.

Quantized checkpoints are mlx-community's layout: ``mlx_lm.convert -q`` writes a quantized ``Linear`` or
``Embedding`` as three tensors, ``X.weight`` (uint32, packed), ``X.scales`` and ``X.biases``, in
:mod:`kq_host.tier`'s affine format, with the options in ``config.json``'s ``"quantization"`` (the default
``bits`` and ``group_size``, and a module's own where it differs, e.g. the router at 8 bits). A Qwen3-MoE's
experts are stacked per layer and projection, ``model.layers.{layer}.mlp.switch_mlp.{projection}.weight``
``[E, out, ...]``. :func:`dense_tensors` gives every tensor in float32 (the JAX model loads it);
:func:`open_experts` reads one expert at a time, a quantized one's packed bytes from the file, dequantized
on the reader's thread, so an arena of float slots can run a quantized checkpoint and the bytes read are
the file's. :func:`tier_from_checkpoint` reads a lower-bit conversion's experts as the low-precision tier.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from kq_core.contract import EXPERT_PROJECTIONS
from kq_core.validate import is_int
from kq_host.expert_store import (PER_EXPERT_TEMPLATE, ExpertReadError, ExpertStore, ExpertStoreError,
                                  file_identity, read_safetensors_headers)
from kq_host.tier import (SCALE_DTYPES, WORD_BITS, QuantizedWeight, Tier, TierOptionError, check_options, check_tier,
                          checked_expert_shapes, dequantize)


# A model directory's weights files as mlx-lm's loader finds them: a file of another name is not the model's.
MODEL_FILES = "model*.safetensors"


def model_files(directory: str | os.PathLike) -> list[Path]:
    """The directory's weights files (:data:`MODEL_FILES`), sorted."""
    return sorted(Path(directory).glob(MODEL_FILES))


class CheckpointError(ValueError):
    """A checkpoint kq cannot run: a ``config.json`` that cannot be read or holds a value no model has, a
    weights file that cannot be read, or tensors that disagree with the model ``config.json`` describes.
    The message names the file, and the key or tensor."""


# The kinds of file a reader's blocking open or read would wait on (a FIFO for a writer) or misread.
_SPECIAL_FILES = ((stat.S_ISFIFO, "a FIFO: reading it waits for a writer"), (stat.S_ISCHR, "a character device"),
                  (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_regular_files(directory: str | os.PathLike) -> None:
    """Checks that no file of a checkpoint directory is a FIFO, a device or a socket: mlx-lm's loader and the
    tokenizer open the directory's files (``config.json``, ``generation_config.json``, ``tokenizer.json``, the
    tokenizer's others) with a blocking open, which waits forever on a FIFO. Directories and links that lead
    nowhere are passed over (no reader opens them as files).

    Raises:
        CheckpointError: naming the first such file and its kind.
    """
    directory = Path(directory)
    for path in sorted(directory.iterdir()):
        try:
            mode = path.stat().st_mode
        except OSError:  # a link that leads nowhere: absent to every reader
            continue
        for kind, described in _SPECIAL_FILES:
            if kind(mode):
                raise CheckpointError(f"{path} is not a regular file ({described}); a checkpoint's files are "
                                      f"regular files")


# The index of a sharded checkpoint: {"weight_map": {tensor name: shard file name}}.
SHARD_INDEX = "model.safetensors.index.json"


def check_shards(directory: str | os.PathLike) -> None:
    """Checks that every shard the directory's :data:`SHARD_INDEX` names is in the directory (a download that
    lost one; mlx-lm's loader reads the shards it finds and would name only the tensors it then lacks). An
    index that is no JSON object with a ``weight_map`` object is passed over, as mlx-lm's loader passes it.

    Raises:
        CheckpointError: naming the index and the first shard missing, and how many more are.
    """
    index = Path(directory) / SHARD_INDEX
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map")
    except (OSError, ValueError, AttributeError):  # absent, unreadable, not JSON, not an object
        return
    if not isinstance(weight_map, dict):
        return
    shards = sorted({shard for shard in weight_map.values() if isinstance(shard, str)})
    missing = [shard for shard in shards if not (Path(directory) / shard).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more of its {len(shards)} shards)" if len(missing) > 1 else ""
        raise CheckpointError(f"{index} names {missing[0]}, which is not in {directory}{more}: the checkpoint is "
                              f"incomplete (download the missing shards)")


def refusal_summary(error: BaseException, most: int = 3) -> str:
    """One line of a loader's refusal (mlx-lm's lists every parameter it misses or does not expect, one a line):
    its first line, then the first ``most`` names it lists and how many more, at most 400 characters."""
    lines = [f"lacks {error.args[0]}"] if isinstance(error, KeyError) and error.args else str(error).splitlines()
    lines = [line.strip(" ,.:") for line in lines if line.strip(" ,.:")]
    if not lines:
        return type(error).__name__
    head, *names = lines
    listed = ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
    line = f"{head}{': ' + listed if listed else ''}"
    return line if len(line) <= 400 else line[:397] + "..."


def read_config(directory) -> dict:
    """The directory's ``config.json`` as a dict.

    Raises:
        CheckpointError: the file is missing, is not JSON, or does not hold a JSON object (naming it).
    """
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: cannot be read as JSON ({error})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: holds {type(raw).__name__}, not a JSON object")
    return raw


# The config key of each family's expert hidden width (the down projection's input).
EXPERT_WIDTH_KEYS = {"qwen3_moe": "moe_intermediate_size", "mixtral": "intermediate_size"}

# Where each family keeps one expert's projections (Hugging Face names), in the arena's projection order
# (gate, up, down), and the config key of its expert count.
CHECKPOINT_LAYOUTS = {
    "qwen3_moe": ("model.layers.{layer}.mlp.experts.{expert}.{projection}.weight",
                  EXPERT_PROJECTIONS, "num_experts"),
    "mixtral": ("model.layers.{layer}.block_sparse_moe.experts.{expert}.{projection}.weight",
                ("w1", "w3", "w2"), "num_local_experts"),
}


def expert_count(config: Mapping) -> int:
    """The experts of each MoE layer, read from ``config.json`` under its family's key
    (``CHECKPOINT_LAYOUTS[model_type][2]``: ``num_experts``, Mixtral's ``num_local_experts``).

    Args:
        config: ``config.json`` as a dict (:func:`read_config`).

    Raises:
        CheckpointError: a ``model_type`` with no known layout, or the family's key missing or not an
            int >= 1 (naming the model type or the key).
    """
    model_type = config.get("model_type")
    if model_type not in CHECKPOINT_LAYOUTS:
        raise CheckpointError(f"config.json: model_type {model_type!r} has no known expert layout; known: "
                              f"{', '.join(sorted(CHECKPOINT_LAYOUTS))}")
    key = CHECKPOINT_LAYOUTS[model_type][2]
    count = config.get(key)
    if not is_int(count) or count < 1:
        raise CheckpointError(f"config.json: {key} (the {model_type} expert count) must be an int >= 1, "
                              f"got {count!r}")
    return count


def trained_length(checkpoint) -> int | None:
    """The length of the sequences the checkpoint was trained on: ``training.json``'s ``args.seq``
    (``models/train.py`` writes it), else ``config.json``'s ``max_position_embeddings``; None where
    neither says."""
    directory = Path(checkpoint)
    for name, keys in (("training.json", ("args", "seq")), ("config.json", ("max_position_embeddings",))):
        try:
            value = json.loads((directory / name).read_bytes())
            for key in keys:
                value = value[key]
        except (OSError, ValueError, KeyError, TypeError):  # absent, not JSON, or without the key
            continue
        if is_int(value) and value >= 1:
            return value
    return None


def expert_nbytes(checkpoint, projections=EXPERT_PROJECTIONS, template=None) -> int:
    """One expert's bytes in the checkpoint (every projection, the file's dtype)."""
    with open_experts(checkpoint, projections, template=template) as store:
        return store.expert_nbytes(0)


STACKED_QUANTIZED_TEMPLATE = "model.layers.{layer}.mlp.switch_mlp.{projection}"
QUANTIZED_FIELDS = ("weight", "scales", "biases")


@dataclass(frozen=True)
class Quantization:
    """``config.json``'s ``"quantization"``: the default options and each module's own."""

    bits: int
    group_size: int
    modules: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, checkpoint: str | os.PathLike) -> "Quantization | None":
        """The checkpoint's quantization, or ``None`` for a float checkpoint.

        Raises:
            ExpertStoreError: a mode other than ``affine``, or options that are no ints in range (naming them).
            CheckpointError: ``config.json`` is not a JSON object.
        """
        path = Path(checkpoint) / "config.json"
        raw = read_config(checkpoint).get("quantization") if path.is_file() else None
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ExpertStoreError(f"{path}: quantization must be a JSON object, got {raw!r}")
        if raw.get("mode", "affine") != "affine":
            raise ExpertStoreError(f"{path}: quantization mode {raw['mode']!r} is not supported (kq reads the affine "
                                   f"mode only)")

        def options(where: str, value: dict) -> tuple[int, int]:
            numbers = [value.get("bits"), value.get("group_size")]
            numbers = [int(n) if isinstance(n, float) and n.is_integer() else n for n in numbers]  # 4.0 is 4
            bits, group_size = numbers
            for name, number, low, high in (("bits", bits, 1, 8), ("group_size", group_size, 1, None)):
                if (not is_int(number) or number < low
                        or (high is not None and number > high)):
                    bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                    raise ExpertStoreError(f"{path}: quantization{where}'s {name} must be an int {bound}, got {number!r}")
            return bits, group_size

        modules = {name: options(f"[{name!r}]", v) for name, v in raw.items() if isinstance(v, dict)}
        return cls(*options("", raw), modules)

    def options(self, module: str) -> tuple[int, int]:
        """``(bits, group_size)`` of one module (its name without ``.weight``)."""
        return self.modules.get(module, (self.bits, self.group_size))


def dense_tensors(checkpoint: str | os.PathLike, quantization: Quantization | None) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint: a quantized module's as one float32 ``X.weight`` (``[..., out, in]``), the
    rest as stored (a float checkpoint, ``quantization`` None: every tensor as stored).

    Returns:
        ``{name: array}``; with ``quantization``, no ``.scales`` or ``.biases`` names remain.

    Raises:
        ExpertStoreError: a file that cannot be read, or a tensor in two files (naming both).
        TierOptionError: a quantized module's arrays do not dequantize with its options (shapes, or packed
            values that are no uint32 words).
    """
    tensors = {name: _read_tensor(entry, name)
               for name, entry in read_safetensors_headers(model_files(checkpoint)).items()}
    for name in [n for n in tensors if n.endswith(".scales")] if quantization is not None else []:
        module = name[: -len(".scales")]
        bits, group_size = quantization.options(module)
        weight = QuantizedWeight(tensors.pop(f"{module}.weight"), tensors.pop(name), tensors.pop(f"{module}.biases"))
        tensors[f"{module}.weight"] = dequantize(weight, bits=bits, group_size=group_size)
    return tensors


def packed_experts(checkpoint, quantization: Quantization, projections: Sequence[str], **store_options) -> ExpertStore:
    """A stacked :class:`~kq_host.expert_store.ExpertStore` of a quantized checkpoint's experts, its reads
    ``{"proj.weight", "proj.scales", "proj.biases"}``, checked from the headers against ``config.json``.

    Every layer's stacked ``weight`` must be uint32 words holding ``[E, out, in]`` at the module's bits,
    beside ``scales`` and ``biases`` ``[E, out, in / group_size]``; where ``config.json`` gives
    ``hidden_size`` and the family's expert width, ``[out, in]`` must be the model's (``projections`` in the
    order gate, up, down).

    Raises:
        ExpertStoreError: a weight of another dtype, shapes no stack of weights at the module's options has,
            or a width other than the model's (naming the file and the tensor).
    """
    store = ExpertStore(checkpoint, layout="stacked", projections=[f"{p}.{f}" for p in projections
                                                                   for f in QUANTIZED_FIELDS],
                        template=STACKED_QUANTIZED_TEMPLATE, **store_options)
    try:
        _check_packed(store, quantization, tuple(projections), read_config(checkpoint))
    except ExpertStoreError:
        store.close()
        raise
    return store


def _check_packed(store: ExpertStore, quantization: Quantization, projections: tuple[str, ...],
                  config: Mapping) -> None:
    """:func:`packed_experts`'s checks of each layer's stacked tensors (one absent is named by the read)."""
    hidden, width = config.get("hidden_size"), config.get(EXPERT_WIDTH_KEYS.get(config.get("model_type")))
    model = (dict(zip(projections, ((width, hidden), (width, hidden), (hidden, width))))
             if is_int(hidden) and is_int(width) else {})
    pattern = re.compile(re.escape(STACKED_QUANTIZED_TEMPLATE).replace(r"\{layer\}", r"(\d+)")
                         .replace(r"\{projection\}", ".+") + r"\.weight")
    layers = sorted({int(match.group(1)) for name in store.tensors if (match := pattern.fullmatch(name))})
    for layer in layers:
        for projection in projections:
            module = STACKED_QUANTIZED_TEMPLATE.format(layer=layer, projection=projection)
            weight, scales, biases = (store.tensors.get(f"{module}.{f}") for f in QUANTIZED_FIELDS)
            if weight is None or scales is None or biases is None:
                continue
            if weight.dtype != np.uint32:
                raise ExpertStoreError(_packed_dtype_message(module, weight))
            bits, group_size = quantization.options(module)
            words = weight.shape[-1] if weight.shape else 0
            columns = words * WORD_BITS // bits
            if (len(weight.shape) != 3 or words * WORD_BITS % bits or columns % group_size
                    or scales.shape != biases.shape or scales.shape != (*weight.shape[:-1], columns // group_size)):
                raise ExpertStoreError(
                    f"{weight.path}: {module}.weight {list(weight.shape)} beside scales {list(scales.shape)} and "
                    f"biases {list(biases.shape)} is no stack of weights at config.json's bits={bits}, "
                    f"group_size={group_size} ([E, out, in * {bits} / {WORD_BITS}] words, [E, out, in / "
                    f"{group_size}] scales and biases)")
            if projection in model and (weight.shape[1], columns) != model[projection]:
                raise ExpertStoreError(
                    f"{weight.path}: {module}.weight unpacks to [{weight.shape[1]}, {columns}] at config.json's "
                    f"bits={bits}, group_size={group_size}; config.json's hidden_size {hidden} and "
                    f"{EXPERT_WIDTH_KEYS[config['model_type']]} {width} make the model's {projection} "
                    f"[{model[projection][0]}, {model[projection][1]}]")


def check_packed_words(entries: Mapping) -> None:
    """Checks every quantized module of a checkpoint's headers (a ``X.weight`` beside a ``X.scales``) holds its
    packed values as uint32 words, as mlx-lm's quantized layers take them: the one check of a quantized
    directory's packed dtypes, from the headers alone.

    Args:
        entries: ``{tensor name: TensorEntry}`` (:func:`~kq_host.expert_store.read_safetensors_headers`).

    Raises:
        ExpertStoreError: naming the file, the tensor and its dtype (PyTorch-based exporters write the words
            as int32, or float32 of the same bytes).
    """
    for name in sorted(entries):
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            weight = entries.get(f"{module}.weight")
            if weight is not None and weight.dtype != np.uint32:
                raise ExpertStoreError(_packed_dtype_message(module, weight))


def _packed_dtype_message(module: str, weight) -> str:
    return (f"{weight.path}: {module}.weight is {weight.dtype.name}, not packed uint32 words (a quantized module's "
            f"values as mlx_lm.convert writes them; an exporter that stored them as {weight.dtype.name} needs its "
            f"output converted again)")


class DequantizedExperts:
    """A store of a quantized checkpoint's experts that hands out float32 projections: the same
    ``read_expert``, ``submit``, ``expert_shapes``, ``expert_nbytes`` (the stored, packed bytes) and
    ``bytes_read`` as the :class:`~kq_host.expert_store.ExpertStore` of packed arrays it reads.

    Args:
        packed: a store whose reads hold ``{"proj.weight", "proj.scales", "proj.biases"}`` of each projection
            (:func:`packed_experts`, or ``ExpertStore.for_tensors`` over a model's own names).
        quantization: ``config.json``'s options.
        projections: the projections handed out.
        module: ``(layer, projection) -> the module's path`` whose options ``config.json`` gives (default:
            :data:`STACKED_QUANTIZED_TEMPLATE`, mlx-community's stacked names).
    """

    def __init__(self, packed, quantization: Quantization, projections: Sequence[str], *,
                 module: Callable[[int, str], str] | None = None):
        self.quantization = quantization
        self.projections = tuple(projections)
        self.packed = packed
        self.template, self.layout, self.tensors = packed.template, "dequantized", packed.tensors
        self._module = module or (lambda layer, p: STACKED_QUANTIZED_TEMPLATE.format(layer=layer, projection=p))

    @property
    def bytes_read(self) -> int:
        return self.packed.bytes_read

    @property
    def layer_tensor_names(self) -> dict[int, dict[str, str]] | None:
        """The packed store's (:attr:`kq_host.expert_store.ExpertStore.layer_tensor_names`)."""
        return self.packed.layer_tensor_names

    def _options(self, layer: int, projection: str) -> tuple[int, int]:
        return self.quantization.options(self._module(layer, projection))

    def read_expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """``{projection: float32 [out, in]}`` of one expert.

        Raises:
            ExpertStoreError: the packed arrays do not dequantize with ``config.json``'s options (naming the
                layer, expert and projection), or as the packed store's ``read_expert``.
        """
        read = self.packed.read_expert(layer, expert)
        out = {}
        for p in self.projections:
            bits, group_size = self._options(layer, p)
            try:
                out[p] = dequantize(QuantizedWeight(*(read[f"{p}.{f}"] for f in QUANTIZED_FIELDS)), bits=bits,
                                    group_size=group_size)
            except TierOptionError as error:
                raise ExpertStoreError(f"layer {layer} expert {expert} {p}, read with config.json's "
                                       f"\"quantization\" options: {error}") from None
        return out

    def submit(self, layer: int, expert: int):
        return self.packed.submit_read(self.read_expert, layer, expert)

    def expert_shapes(self, layer: int, expert: int = 0) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        shapes = self.packed.expert_shapes(layer, expert)
        out = {}
        for p in self.projections:
            bits, _ = self._options(layer, p)
            (rows, words), _ = shapes[f"{p}.weight"]
            out[p] = ((rows, words * 32 // bits), np.dtype(np.float32))
        return out

    def expert_nbytes(self, layer: int, expert: int = 0) -> int:
        return self.packed.expert_nbytes(layer, expert)

    def close(self) -> None:
        self.packed.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_experts(checkpoint: str | os.PathLike, projections: Sequence[str] = EXPERT_PROJECTIONS,
                 *, template: str | None = None, dequantized: bool = True, **store_options):
    """A store of a checkpoint directory's experts, float or quantized.

    Args:
        checkpoint: the directory (``config.json`` and ``*.safetensors``).
        projections: the experts' projection names in the checkpoint.
        template: a float checkpoint's per-expert tensor names (default: the Hugging Face ones).
        dequantized: for a quantized checkpoint, hand out float32 projections (``True``) or the stored
            ``{"proj.weight", "proj.scales", "proj.biases"}`` arrays (``False``, what a quantized MLX arena takes).
        store_options: passed to :class:`~kq_host.expert_store.ExpertStore` (``queue_depth``, ``host_allocator``).

    Returns:
        An :class:`~kq_host.expert_store.ExpertStore` or :class:`DequantizedExperts`.

    Raises:
        ExpertStoreError: a quantized checkpoint's experts that are not what ``config.json`` describes
            (:func:`packed_experts`), or as :class:`~kq_host.expert_store.ExpertStore`.
    """
    quantization = Quantization.of(checkpoint)
    if quantization is None:
        return ExpertStore(checkpoint, layout="per_expert", projections=projections,
                           template=template or PER_EXPERT_TEMPLATE, **store_options)
    if dequantized:
        return DequantizedExperts(packed_experts(checkpoint, quantization, projections, **store_options), quantization,
                                  projections)
    return packed_experts(checkpoint, quantization, projections, **store_options)


def tier_from_checkpoint(directory: str | os.PathLike, store, num_layers: int, num_experts: int) -> Tier:
    """The tier read from a lower-bit mlx-lm conversion of the model ``store`` serves (``mlx_lm.convert -q
    --q-bits 2`` of the same weights, say), instead of quantized by :func:`build_tier`.

    Each MoE layer's experts are the checkpoint's stacked quantized tensors ``{...}.layers.{i}.{module}.
    {projection}.{weight,scales,biases}`` (``weight`` uint32 ``[E, out, words]``), for every projection of
    ``store``; the layers with such tensors, in order, are the tier's layers. Every layer and projection
    must be quantized alike (the tier has one ``bits`` and ``group_size``).

    Args:
        directory: the conversion's directory (``config.json`` with ``"quantization"``, ``*.safetensors``).
        store: the served model's store, as for :func:`build_tier` (its ``projections`` name the tier's
            projections, its ``expert_shapes`` give each projection's ``[out, in]``).
        num_layers, num_experts: L and E of the served model, as the store holds them.

    Returns:
        :class:`Tier` ``[num_layers, num_experts, ...]`` per projection, named as :func:`build_tier` names it.

    Raises:
        TierOptionError: the conversion's layers, experts, a projection's shape, its options (bits, group
            size, mode) or its scales' dtype disagree with the served model or the format, or a scale or bias
            is not finite (the message names the tensor or ``config.json``).
        ExpertStoreError: ``directory`` is no path, or holds no readable ``config.json`` or safetensors file,
            or a tensor in two of its files (naming both); an ExpertReadError where reading a tensor's bytes
            failed.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise ExpertStoreError(f"tier_from_checkpoint: directory must be a path, got {directory!r}")
    directory = Path(directory)
    for name, value in (("num_layers", num_layers), ("num_experts", num_experts)):
        if not (is_int(value) and value >= 1):
            raise TierOptionError(f"tier_from_checkpoint: {name} must be an int >= 1, got {value!r}")
    shapes = {name: shape for name, (shape, _) in checked_expert_shapes(store, int(num_layers), int(num_experts)).items()}
    config = directory / "config.json"
    if not config.is_file():
        raise ExpertStoreError(f"tier_from_checkpoint: {config} does not exist; give an mlx-lm model directory")
    try:
        quantization = Quantization.of(directory)
    except CheckpointError as error:  # not JSON, or not an object
        raise ExpertStoreError(f"tier_from_checkpoint: {config} is unreadable ({error})") from None
    except ExpertStoreError as error:  # read, its "quantization" a mode or options kq does not take
        raise TierOptionError(f"tier_from_checkpoint: {error}") from None
    except OSError as error:
        raise ExpertStoreError(f"tier_from_checkpoint: {config} is unreadable ({error})") from None
    if quantization is None:
        raise TierOptionError(f"tier_from_checkpoint: {config} has no \"quantization\": {directory} is not a "
                              f"quantized conversion")
    files = model_files(directory)
    if not files:
        raise ExpertStoreError(f"tier_from_checkpoint: {directory} holds no {MODEL_FILES} file")
    entries = read_safetensors_headers(files)
    layers = _stacked_modules(entries, tuple(shapes), directory)
    if len(layers) != num_layers:
        raise TierOptionError(f"tier_from_checkpoint: {directory} holds stacked experts in {len(layers)} layers "
                              f"({sorted(layers)}); the served model has num_layers={num_layers}")
    options = {module: quantization.options(module) for modules in layers.values() for module in modules.values()}
    if len(set(options.values())) != 1:
        raise TierOptionError(f"tier_from_checkpoint: {config} quantizes the experts with several (bits, group_size): "
                              f"{sorted(set(options.values()))} ({', '.join(sorted(options)[:4])}...); a tier has one")
    bits, group_size = next(iter(options.values()))
    try:
        check_options(bits, group_size)
    except TierOptionError as error:
        raise TierOptionError(f"tier_from_checkpoint: {config}: the experts' {error}") from None
    stacks = {projection: [] for projection in shapes}
    for layer in sorted(layers):
        for projection, module in layers[layer].items():
            out, width = shapes[projection]
            groups = width // group_size
            want = {"weight": (num_experts, out, width * bits // WORD_BITS), "scales": (num_experts, out, groups),
                    "biases": (num_experts, out, groups)}
            arrays = []
            for part, want_shape in want.items():
                entry = entries.get(f"{module}.{part}")
                if entry is None:
                    raise TierOptionError(f"tier_from_checkpoint: {directory} has {module}.weight but no "
                                          f"{module}.{part}")
                if entry.shape[:2] != want_shape[:2]:
                    raise TierOptionError(f"tier_from_checkpoint: {entry.path}: {module}.{part} is "
                                          f"{list(entry.shape)}; the served model's {projection} has "
                                          f"num_experts={num_experts} experts of {out} rows")
                if entry.shape != want_shape:
                    raise TierOptionError(f"tier_from_checkpoint: {entry.path}: {module}.{part} is "
                                          f"{list(entry.shape)}, not the served model's {projection} [{out}, {width}] "
                                          f"at bits={bits}, group_size={group_size} ({list(want_shape)})")
                if part == "weight" and entry.dtype != np.uint32:
                    raise TierOptionError(f"tier_from_checkpoint: {entry.path}: {module}.weight is {entry.dtype}, "
                                          f"not packed uint32 words")
                if part != "weight" and entry.dtype not in SCALE_DTYPES.values():
                    raise TierOptionError(f"tier_from_checkpoint: {entry.path}: {module}.{part} is {entry.dtype}; the "
                                          f"tier stores 16-bit scales and biases (convert with --dtype bfloat16)")
                array = _read_tensor(entry, f"{module}.{part}")
                if part != "weight" and not np.isfinite(array.astype(np.float32)).all():
                    raise TierOptionError(f"tier_from_checkpoint: {entry.path}: {module}.{part} holds a value that is "
                                          f"not finite (NaN or inf): no tier can be served from it")
                arrays.append(array)
            stacks[projection].append(QuantizedWeight(*arrays))
    dtypes = {array.dtype for stack in stacks.values() for weight in stack for array in weight[1:]}
    if len(dtypes) != 1:
        raise TierOptionError(f"tier_from_checkpoint: {directory} stores the experts' scales in several dtypes "
                              f"({sorted(d.name for d in dtypes)}); the tier stores one")
    tier = Tier({projection: QuantizedWeight(*(np.stack(stacked) for stacked in zip(*layer_weights)))
                 for projection, layer_weights in stacks.items()}, bits, group_size)
    check_tier(tier, "tier_from_checkpoint")
    return tier


def _stacked_modules(entries: Mapping, projections: tuple[str, ...], directory: Path) -> dict[int, dict[str, str]]:
    """``{layer: {projection: module}}``: per layer index, the module of each projection's stacked experts
    (a ``{module}.weight`` of 3 axes beside a ``{module}.scales``); a layer must hold every projection once."""
    pattern = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:.+\.)?(" + "|".join(map(re.escape, projections))
                         + r")\.scales$")
    layers: dict[int, dict[str, str]] = {}
    for name in sorted(entries):
        match = pattern.match(name)
        module = name[: -len(".scales")]
        weight = entries.get(f"{module}.weight")
        if match is None or weight is None or len(weight.shape) != 3:
            continue  # not stacked experts (a dense MLP's or a shared expert's projection)
        layer, projection = int(match.group(1)), match.group(2)
        held = layers.setdefault(layer, {})
        if projection in held:
            raise TierOptionError(f"tier_from_checkpoint: {directory}: layer {layer} holds two stacks of "
                                  f"{projection} experts ({held[projection]}, {module})")
        held[projection] = module
    for layer, held in layers.items():
        if set(held) != set(projections):
            raise TierOptionError(f"tier_from_checkpoint: {directory}: layer {layer}'s stacked experts have "
                                  f"{sorted(held)}; the served model's projections are {list(projections)}")
    return layers


def _read_tensor(entry, name: str) -> np.ndarray:
    """One whole tensor of a safetensors file, as its header describes it.

    Raises:
        ExpertReadError: (an ExpertStoreError) the file cannot be read, changed since its header was read, or
            ends early.
    """
    try:
        with open(entry.path, "rb") as handle:
            if file_identity(os.fstat(handle.fileno())) != entry.identity:
                raise ExpertReadError(f"{entry.path} changed after its header was read; read the tier again")
            handle.seek(entry.offset)
            data = bytearray(entry.nbytes)
            count = handle.readinto(data)
    except OSError as error:
        raise ExpertReadError(f"{entry.path}: {name} cannot be read ({error.strerror or error})") from None
    if count != entry.nbytes:
        raise ExpertReadError(f"{entry.path}: {name} ends early ({count} of {entry.nbytes} bytes)")
    return np.frombuffer(data, entry.dtype).reshape(entry.shape)
