"""``kq_mlx.load``: an mlx-lm MoE model whose experts stream through a bounded arena, as ``mlx_lm.load`` gives it.

The returned model is the family's own mlx-lm model: its MoE layers run on arenas
(:func:`~kq_mlx.mlx_lm_adapter.attach_arena`, the layers' own experts never read), and the residency
manager's token boundary runs inside its forward pass, so ``mlx_lm.generate``, ``stream_generate`` with any
sampler and logits processors, prompt caches, ``mlx_lm.chat`` and ``mlx_lm.server`` run it unchanged.

Where the boundary and the reads live (``docs/generate.md``, "How a loaded model runs"):

* A forward pass begins at the first decoder layer, which is wrapped (:class:`_PassBoundary`): there the
  previous pass is ended for the manager (``next_token`` after a pass run layer by layer, ``step`` on the
  previous pass's reports after a pass run under a lossy rule) and this pass's rule chosen.
* Rule ``"exact"``: each MoE layer evaluates its routing and ``manager.acquire`` makes every routed expert
  resident before the experts run (:func:`~kq_mlx.mlx_lm_adapter.attach_exact`): the logits are the model's
  with every expert in memory, bit for bit, for any cache, sampler or batch; a pass never runs twice.
  While every layer's table holds every expert, a pass runs the resident graph (nothing to read).
* Rules ``"tier"`` and ``"shed"``: a prompt (a pass of more than one position) runs exactly, as above;
  each generated token runs the rule's graph, and its reports go to ``manager.step`` when the next pass
  begins.
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kq_core.validate import is_int, is_real
from kq_host.checkpoint import MODEL_FILES, model_files
from kq_host.memory_plan import MemoryPlan, MemoryPlanError, plan_memory
from kq_host.residency import MAX_QUEUE_DEPTH, LayerReport
from kq_mlx import mlx_lm_adapter as adapter

from kq_core.rules import LOADER_RULES as RULES  # noqa: E402 - the rules a loaded model runs
# Tokens of context the KV cache is planned for when none is given.
DEFAULT_CONTEXT = 4096
# The fraction of each layer's experts kept where neither a budget nor a residency is given.
DEFAULT_RESIDENCY = 0.25


class LoadError(ValueError):
    """A bad argument or a model directory kq cannot run; the message begins with the argument's name."""


def _fail(argument: str, message: str) -> LoadError:
    return LoadError(f"{argument}: {message}")


class ExpertStream:
    """What streams a loaded model's experts: the store, the residency manager, the arenas and the plan.

    Reached by :func:`stream_of`. Attributes:
        rule: ``"exact"``, ``"tier"`` or ``"shed"``.
        plan: the :class:`~kq_host.memory_plan.MemoryPlan` the arenas were sized by.
        blocks: the arena layers, one per MoE layer.
        manager: the :class:`~kq_host.residency.ResidencyManager` filling them.
        store: the :class:`~kq_host.expert_store.ExpertStore` reading the experts from the model's files.
        tier_bytes: what the tier takes on the device (0 without one).
        tier_format: the tier's ``(bits, group_size)`` (None without one).
    """

    def __init__(self, *, rule, plan, blocks, manager, store, tier_bytes, tier_format, closer: contextlib.ExitStack):
        self.rule, self.plan, self.blocks, self.manager = rule, plan, blocks, manager
        self.store, self.tier_bytes, self.tier_format = store, tier_bytes, tier_format
        # Closed at the latest when the interpreter exits: reads in flight then would outlive MLX's teardown.
        self._close = weakref.finalize(self, closer.close)
        self._pending = None  # how the last pass ends: "step" (its reports) or "next" (it ran layer by layer)
        self._prompt_pass = False  # the last pass read a prompt (more than one position)
        self.passes = 0
        # The look-ahead's prefetchers (attach_exact): on for passes of one position under exact alone (a prompt
        # pass reads every expert it routes on its critical path, and a prediction for many positions reads more).
        self._prefetchers: list = []
        self.reset_prompt()

    def reset_prompt(self) -> None:
        """Starts counting a new prompt: :attr:`prompt_routed` (each layer's experts its passes routed) and
        :attr:`prompt_reads` (the manager's landed reads when its last pass ended)."""
        self.prompt_routed = [set() for _ in self.blocks]
        self.prompt_reads = None

    def end_pass(self) -> None:
        """Ends the last pass for the manager: its routing counted, its misses' reads started (``step`` on its
        reports after a graph pass, ``next_token`` after a pass run layer by layer). The next pass does it
        otherwise; a run calls it after its last pass to count it."""
        blocks, manager = self.blocks, self.manager
        if self._prompt_pass:
            for routed, block in zip(self.prompt_routed, blocks):
                routed.update(np.unique(np.array(block.last[0])).tolist())
        if self._pending == "step":
            report = LayerReport.from_packed(np.array(adapter.pack_reports(blocks)))
            adapter.set_tables(blocks, manager.step(report))
        elif self._pending == "next":
            adapter.set_tables(blocks, manager.next_token())
        self._pending = None
        if self._prompt_pass:
            self.prompt_reads = int(manager.stats()[1].reads_landed)
        self._prompt_pass = False

    def begin_pass(self, hidden: mx.array) -> None:
        """Ends the previous pass (:meth:`end_pass`) and sets this pass's rule (``hidden``: ``[B, T, D]``)."""
        blocks, manager = self.blocks, self.manager
        self.end_pass()
        if self.rule != "exact":
            manager.raise_failures("generation")  # a failed read would otherwise be shed unsaid
        prompt = hidden.ndim >= 2 and hidden.shape[-2] > 1
        resident = all(block._resident() is not None for block in blocks)
        if resident:
            rule = "shed"  # every layer's table holds every expert: the resident graph, the model's bits
        elif self.rule == "exact" or prompt:
            rule = "exact"
        else:
            rule = self.rule
        for block in blocks:
            block.rule = rule
        for layer, prefetch in self._prefetchers:
            layer.prefetch = prefetch if rule == "exact" and not prompt else None
        self._pending = "next" if rule == "exact" else "step"
        self._prompt_pass = prompt
        self.passes += 1

    def stats(self) -> dict:
        """The run's figures so far: lookups, hits, hit rate, reads, bytes read, and the plan."""
        _, total = self.manager.stats()
        return {"lookups": int(total.lookups), "hits": int(total.hits),
                "hit_rate": float(total.hit_rate) if total.lookups else float("nan"),
                "reads": int(total.reads_landed), "bytes_read": int(total.reads_landed * self.plan.expert),
                "passes": self.passes, "rule": self.rule, "slots": self.plan.slots,
                "residency": self.plan.residency}

    def close(self) -> None:
        """Stops the manager's reads and closes the store's files (the model cannot run afterwards)."""
        self._close()


class _PassBoundary(adapter.LayerWrapper):
    """The model's first decoder layer: a pass begins here (:meth:`ExpertStream.begin_pass`)."""

    def __init__(self, layer: nn.Module, stream: ExpertStream):
        super().__init__(layer)
        object.__setattr__(self, "_stream", stream)  # outside the module's tree

    def __call__(self, x, *args, **kwargs):
        self._stream.begin_pass(x)
        return self.layer(x, *args, **kwargs)


def stream_of(model: nn.Module) -> ExpertStream:
    """The :class:`ExpertStream` of a model :func:`load` returned.

    Raises:
        ValueError: ``model`` did not come from :func:`load`.
    """
    stream = getattr(model, "_kq_stream", None) if isinstance(model, nn.Module) else None
    if stream is None:
        raise ValueError(f"stream_of: model must be a model kq_mlx.load returned, got {type(model).__name__}")
    return stream


def checked_directory(path) -> tuple[Path, dict]:
    """The model directory and its ``config.json``, checked before anything opens a weights file (what :func:`load`
    checks first; a command checks its options with it before it loads).

    Raises:
        LoadError: naming ``path``: not a directory, a FIFO, device or socket in it (a reader would wait forever),
            no config.json or weights file, a shard its index names but lacks, a ``num_experts_per_tok`` no model
            has, or a quantized module whose packed words are not uint32.
    """
    from kq_host.checkpoint import CheckpointError, check_packed_words, check_regular_files, check_shards
    from kq_host.expert_store import ExpertStoreError, read_safetensors_headers

    if not isinstance(path, (str, os.PathLike)):
        raise _fail("path", f"must be a model directory, got {path!r}")
    model_dir = Path(path)
    config = model_dir / "config.json"
    try:
        if not model_dir.is_dir():
            raise _fail("path", f"{model_dir} is not a directory (an mlx-lm model directory: config.json, "
                                f"{MODEL_FILES})")
        check_regular_files(model_dir)
        if not config.is_file():
            raise _fail("path", f"{model_dir} has no config.json: not an mlx-lm model directory")
        if not model_files(model_dir):
            raise _fail("path", f"{model_dir} holds no {MODEL_FILES} file (the weights files mlx-lm loads)")
        check_shards(model_dir)
        settings = json.loads(config.read_text())
        if not isinstance(settings, dict):
            raise _fail("path", f"{config} holds {type(settings).__name__}, not a JSON object")
        top_k = settings.get("num_experts_per_tok")  # the key of every family mlx-lm names a routing width for
        if top_k is not None and (not is_int(top_k) or top_k < 1):
            raise _fail("path", f"{config}: num_experts_per_tok must be an int >= 1 (the experts a token routes "
                                f"to), got {top_k!r}")
        if "quantization" in settings:  # mlx-community's layout: each quantized module's words as mlx-lm takes them
            check_packed_words(read_safetensors_headers(model_files(model_dir)))
    except (CheckpointError, ExpertStoreError) as error:
        raise _fail("path", str(error)) from None
    except LoadError:
        raise
    except (OSError, ValueError) as error:  # unreadable, or config.json no JSON
        raise _fail("path", f"{model_dir}: unreadable ({type(error).__name__}: {error})") from None
    return model_dir, settings


def _check_options(rule, tier_bits, tier_group_size, tier_model, queue_depth, timeout, context) -> None:
    if rule not in RULES:  # check_rule's wording, the argument first as this module's errors have it
        raise _fail("rule", f"must be one of {', '.join(RULES)}, got {rule!r}")
    if rule != "tier" and (tier_bits is not None or tier_group_size is not None or tier_model is not None):
        raise _fail("tier_bits/tier_group_size/tier_model", f"the tier serves the misses of rule 'tier'; the rule "
                                                            f"is {rule!r}")
    if tier_model is not None:
        if tier_bits is not None or tier_group_size is not None:
            raise _fail("tier_model", "reads the tier's format from its checkpoint: give it or tier_bits, not both")
        try:
            checked_directory(tier_model)
        except LoadError as error:
            raise _fail("tier_model", str(error).partition(": ")[2]) from None
    if not is_int(queue_depth) or not 0 <= queue_depth <= MAX_QUEUE_DEPTH:
        raise _fail("queue_depth", f"must be an int in [0, {MAX_QUEUE_DEPTH}], got {queue_depth!r}")
    if timeout is not None and (not is_real(timeout) or not timeout > 0):
        raise _fail("timeout", f"must be a number of seconds > 0, got {timeout!r}")
    if not is_int(context) or context < 1:
        raise _fail("context", f"must be an int >= 1 (tokens the KV cache is planned for), got {context!r}")


def _switches(model: nn.Module) -> list[nn.Module]:
    switch_types = adapter._switch_types()
    return [module for _, module in model.named_modules() if isinstance(module, switch_types)]


def _per_expert_nbytes(switch: nn.Module) -> tuple[int, int]:
    """``(one expert's bytes, every expert's bytes)`` of a SwitchGLU / SwitchMLP as it will run."""
    arrays = adapter._slot_arrays(switch)
    total = sum(array.nbytes for _, array in arrays)
    return total // int(arrays[0][1].shape[0]), total


def _kv_cache_nbytes(model: nn.Module, context: int, itemsize: int) -> int:
    """An estimate of the KV cache of ``context`` tokens: keys and values of every attention layer (0 where the
    model's args do not say its attention's shape)."""
    args = getattr(model, "args", None)
    layers = getattr(args, "num_hidden_layers", None)
    heads = getattr(args, "num_key_value_heads", None) or getattr(args, "num_attention_heads", None)
    head_dim = getattr(args, "head_dim", None)
    if head_dim is None and getattr(args, "hidden_size", None) and getattr(args, "num_attention_heads", None):
        head_dim = args.hidden_size // args.num_attention_heads
    if not all(is_int(value) and value > 0 for value in (layers, heads, head_dim)):
        return 0
    return 2 * layers * heads * head_dim * context * itemsize


def _float_itemsize(model: nn.Module) -> int:
    from mlx.utils import tree_flatten

    for _, array in tree_flatten(model.parameters()):
        if mx.issubdtype(array.dtype, mx.floating):
            return array.dtype.size
    return 4


def load(path, *, memory=None, residency=None, rule: str = "exact", tier_bits: int | None = None,
         tier_group_size: int | None = None, tier_model=None, context: int = DEFAULT_CONTEXT, queue_depth: int = 8,
         timeout: float | None = None, float32: bool = False, lookahead: bool | None = None,
         tokenizer_config: dict | None = None):
    """Loads an mlx-lm MoE model directory with its experts streamed through an arena: ``(model, tokenizer)``.

    Args:
        path: an mlx-lm model directory (``config.json``, ``model*.safetensors``, the tokenizer), float or
            quantized (mlx-community's layout).
        memory: the budget in bytes (an int or a text such as ``"8GiB"``): the non-expert weights, the KV
            cache of ``context`` tokens, the tier and the arena (:func:`~kq_host.memory_plan.plan_memory`).
        residency: instead of ``memory``, the fraction of each MoE layer's experts to keep
            (:data:`DEFAULT_RESIDENCY` where neither is given).
        rule: what a generated token's routed expert that is not resident gets: ``"exact"`` (read before its
            layer runs: the model's own logits), ``"tier"`` (its low-precision copy) or ``"shed"`` (dropped).
        tier_bits, tier_group_size: rule ``"tier"``: the copy's format (:func:`kq_host.tier.build_tier`'s
            defaults where not given; the built tier is cached on disk).
        tier_model: rule ``"tier"``: read the tier from this lower-bit mlx-lm conversion of the same model instead.
        context: tokens of KV cache the budget keeps room for.
        queue_depth: expert reads in flight (0: read on the calling thread).
        timeout: seconds a wait for reads may take (None: no limit).
        float32: run every float parameter in float32 (float models do on MLX's CPU backend regardless: its
            ``gather_mm`` takes float32 only).
        lookahead: under ``"exact"``, read the next layer's predicted experts while a layer runs (None: where kq
            knows every layer's router).
        tokenizer_config: passed to mlx-lm's tokenizer loader.

    Returns:
        ``(model, tokenizer)`` as ``mlx_lm.load`` returns them; :func:`stream_of` gives the model's
        :class:`ExpertStream` (its figures, and ``close``).

    Raises:
        LoadError: a bad argument or a directory kq cannot run (the message begins with the argument's name).
    """
    from kq_host.expert_store import ExpertStore, ExpertStoreError
    from kq_host.residency import ResidencyManager

    model_dir, settings = checked_directory(path)
    _check_options(rule, tier_bits, tier_group_size, tier_model, queue_depth, timeout, context)
    model, tokenizer, switches = _lazy_model(model_dir, float32, tokenizer_config)
    plan = _plan_for(model, switches, settings, memory=memory, residency=residency, rule=rule, tier_bits=tier_bits,
                     tier_group_size=tier_group_size, context=context)
    blocks = adapter.attach_arena(model, plan.slots, keep_experts=False)
    closer = contextlib.ExitStack()
    try:
        names = expert_tensor_names(model_dir, blocks)
        try:
            store = closer.enter_context(ExpertStore.for_tensors(model_files(model_dir), names,
                                                                 queue_depth=max(queue_depth, 1)))
        except ExpertStoreError as error:
            raise _fail("path", f"the experts' tensors: {error}") from None
        tier_bytes, tier_format = 0, None
        if rule == "tier":
            tier_bytes, tier_format = _attach_tier(model_dir, settings, blocks, names, tier_bits, tier_group_size,
                                                   tier_model, closer.enter_context)
        manager = ResidencyManager(len(blocks), plan.num_experts, plan.slots, arena=adapter.SwitchGLUArena(blocks),
                                   loader=lambda layer, expert_id, slot: store.read_expert(layer, expert_id),
                                   bytes_per_expert=store.expert_nbytes(0), queue_depth=queue_depth, impl="numpy")
        closer.callback(manager.close)
        if lookahead is None:
            lookahead = rule == "exact" and all(isinstance(block, adapter.ArenaMoeBlock) for block in blocks)
        adapter.attach_exact(model, blocks, manager, lookahead=lookahead, timeout=timeout)
        for block in blocks:
            block.read_retries = 2
        adapter.set_tables(blocks, manager.snapshot())
        stream = ExpertStream(rule=rule, plan=plan, blocks=blocks, manager=manager, store=store,
                              tier_bytes=tier_bytes, tier_format=tier_format, closer=closer)
        layers = adapter._decoder_layers(model, blocks)
        stream._prefetchers = [(layer, layer.prefetch) for layer in model.modules()
                               if isinstance(layer, adapter._LookaheadLayer) and layer.prefetch is not None]
        layers[0] = _PassBoundary(layers[0], stream)
        object.__setattr__(model, "_kq_stream", stream)
        mx.eval(model.parameters())  # the other weights, the arenas and the tier: none of the dropped experts
    except BaseException:
        closer.close()
        raise
    return model, tokenizer


def _lazy_model(model_dir: Path, float32: bool, tokenizer_config: dict | None):
    """``(model, tokenizer, its SwitchGLU / SwitchMLP modules)`` from mlx-lm, lazily: no weight read yet; a float
    model in float32 where asked or on MLX's CPU backend (its ``gather_mm`` takes float32 only)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    from mlx_lm.utils import load as mlx_lm_load

    try:
        model, tokenizer = mlx_lm_load(str(model_dir), lazy=True, tokenizer_config=tokenizer_config or {})
    except Exception as error:  # noqa: BLE001 - mlx-lm's errors for a directory it cannot load vary by cause
        from kq_host.checkpoint import refusal_summary

        raise _fail("path", f"mlx-lm cannot load {model_dir} ({type(error).__name__}: "
                            f"{refusal_summary(error)})") from None
    switches = _switches(model)
    if not switches:
        raise _fail("path", f"{model_dir} is not an MoE model: {type(model).__module__} has no SwitchGLU or "
                            f"SwitchMLP (mlx_lm.models.switch_layers) to put an arena in")
    quantized = any(isinstance(module, (nn.QuantizedLinear, QuantizedSwitchLinear)) for module in model.modules())
    if float32 or (mx.default_device() == mx.cpu and not quantized):
        model.set_dtype(mx.float32)
    return model, tokenizer, switches


def _plan_for(model, switches, settings: dict, *, memory, residency, rule, tier_bits, tier_group_size,
              context) -> MemoryPlan:
    """The :class:`MemoryPlan` of the lazy ``model`` as it will run (sizes from its arrays' shapes and dtypes)."""
    from mlx.utils import tree_flatten

    if memory is None and residency is None:
        residency = DEFAULT_RESIDENCY
    experts_bytes = sum(_per_expert_nbytes(switch)[1] for switch in switches)
    num_experts = int(adapter._expert_count(switches[0]))
    top_k = settings.get("num_experts_per_tok") or 1  # an int >= 1 or absent (checked_directory)
    if top_k > num_experts:
        raise _fail("path", f"config.json: num_experts_per_tok must be an int in [1, {num_experts}] (the experts of a "
                            f"layer), got {top_k!r}")
    other = sum(array.nbytes for _, array in tree_flatten(model.parameters())) - experts_bytes
    tier = 0
    if rule == "tier":
        from kq_host.tier import TierOptionError, bits_per_weight

        try:
            bpw = bits_per_weight(*_tier_options(tier_bits, tier_group_size))
        except TierOptionError as error:
            raise _fail("tier_bits", str(error)) from None
        tier = int(len(switches) * num_experts * _weights_per_expert(switches[0]) * bpw / 8)
    try:
        return plan_memory(other=other, expert=_per_expert_nbytes(switches[0])[0], num_layers=len(switches),
                           num_experts=num_experts, top_k=top_k,
                           kv_cache=_kv_cache_nbytes(model, context, _float_itemsize(model)), tier=tier,
                           memory=memory, residency=residency, context=context)
    except MemoryPlanError as error:
        raise LoadError(str(error)) from None


def plan(path, *, memory=None, residency=None, rule: str = "exact", tier_bits: int | None = None,
         tier_group_size: int | None = None, context: int = DEFAULT_CONTEXT, float32: bool = False) -> MemoryPlan:
    """Where :func:`load` would put ``memory`` (or how large ``residency`` makes the arena), reading no weight.

    Args: as :func:`load`'s.

    Returns:
        :class:`~kq_host.memory_plan.MemoryPlan`.

    Raises:
        LoadError: as :func:`load`, a budget too small naming the smallest that works.
    """
    model_dir, settings = checked_directory(path)
    _check_options(rule, tier_bits, tier_group_size, None, 0, None, context)
    model, _, switches = _lazy_model(model_dir, float32, None)
    return _plan_for(model, switches, settings, memory=memory, residency=residency, rule=rule, tier_bits=tier_bits,
                     tier_group_size=tier_group_size, context=context)


def _weights_per_expert(switch: nn.Module) -> int:
    """The weights of one expert (every projection, as logical ``out x in`` matrices)."""
    return sum(int(np.prod(adapter._logical_shape(switch[projection])))
               for projection in adapter._projection_names(switch))


def _tier_options(bits, group_size) -> tuple[int, int]:
    import inspect

    from kq_host.tier import build_tier

    defaults = inspect.signature(build_tier).parameters
    return (defaults["bits"].default if bits is None else bits,
            defaults["group_size"].default if group_size is None else group_size)


def expert_tensor_names(model_dir: Path, blocks) -> dict[int, dict[str, str]]:
    """Each MoE layer's ``{payload key: tensor name}`` in the directory's files: the stacked tensors of the model
    as loaded (mlx-lm's and mlx-community's checkpoints), or where those are absent the Hugging Face layout's
    tensor per expert (``...mlp.experts.{expert}.gate_proj.weight``, stacked by mlx-lm on loading).

    Raises:
        LoadError: a tensor is in neither layout (the message names both names and the files).
    """
    from kq_host.expert_store import ExpertStoreError, read_safetensors_headers

    files = model_files(model_dir)
    try:
        present = set(read_safetensors_headers(files))
    except ExpertStoreError as error:
        raise _fail("path", str(error)) from None
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
                shown = ", ".join(f.name for f in files[:3]) + (" ..." if len(files) > 3 else "")
                raise _fail("path", f"{model_dir}: neither {stacked} nor {per_expert.replace('{expert}', '0')} is "
                                    f"in {shown} (mlx_lm.convert writes the stacked layout kq reads)")
    return names


def _attach_tier(model_dir: Path, settings: dict, blocks, names, bits, group_size, tier_model, enter) -> int:
    """Builds the tier of every expert (or reads it from ``tier_model``, a lower-bit conversion of the model) and
    gives it to the blocks; returns its bytes on the device, with a warning where they are no fewer than the
    experts' it stands in for."""
    import warnings

    from mlx.utils import tree_flatten

    from kq_host.checkpoint import DequantizedExperts, Quantization, tier_from_checkpoint
    from kq_host.expert_store import ExpertReadError, ExpertStore, ExpertStoreError
    from kq_host.residency import PreloadError
    from kq_host.tier import TierOptionError, build_tier

    quantization = None
    if "quantization" in settings:
        try:
            quantization = Quantization.of(model_dir)
        except ExpertStoreError as error:
            raise _fail("path", str(error)) from None
    if quantization is None:
        weights = {layer: {p: keys[p] for p in blocks[layer].projections} for layer, keys in names.items()}
    else:
        weights = {layer: {f"{p}.{a}": keys[f"{p}.{a}"] for p in blocks[layer].projections
                           for a in ("weight", "scales", "biases")} for layer, keys in names.items()}
    argument = "tier_model" if tier_model is not None else "tier_bits"
    try:
        source = enter(ExpertStore.for_tensors(model_files(model_dir), weights))
        if quantization is not None:
            source = DequantizedExperts(source, quantization, blocks[0].projections,
                                        module=lambda layer, projection: f"{blocks[layer].module_path}.{projection}")
        if tier_model is not None:
            tier = tier_from_checkpoint(tier_model, source, len(blocks), blocks[0].num_experts)
        else:
            options = dict(zip(("bits", "group_size"), _tier_options(bits, group_size)))
            tier = build_tier(source, len(blocks), blocks[0].num_experts, **options)
    except ExpertReadError as error:  # the disk, not an argument
        raise PreloadError(f"the tier's {'read' if tier_model is not None else 'build'}: {error}", [], []) from None
    except TierOptionError as error:
        raise _fail(argument, str(error)) from None
    except ExpertStoreError as error:  # the stored experts are not what config.json says, or tier_model's
        raise _fail("tier_model" if tier_model is not None else "path", f"the experts' tensors: {error}") from None
    try:
        adapter.attach_tier(blocks, tier)
    except ValueError as error:
        raise _fail("tier_model" if tier_model is not None else "path",
                    f"the tier does not fit the model as mlx-lm loads it ({error})") from None
    tier_bytes = sum(array.nbytes for block in blocks for _, array in tree_flatten(block.tier.parameters()))
    stream_format = (tier.bits, tier.group_size)
    experts_bytes = sum(array.nbytes for block in blocks for _, array in adapter._slot_arrays(block.arena)) \
        // blocks[0].num_slots * blocks[0].num_experts
    if tier_bytes >= experts_bytes:
        warnings.warn(f"the tier takes {tier_bytes / 2**20:.1f} MiB ({tier.bits} bits in groups of "
                      f"{tier.group_size}), no less than the {experts_bytes / 2**20:.1f} MiB of the experts it stands "
                      f"in for: it saves no memory; a smaller tier_bits (--tier-bits), or rule exact or shed, "
                      f"holds less",
                      stacklevel=3)
    return tier_bytes, stream_format
