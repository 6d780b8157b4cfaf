"""The slot-bank baseline: a per-layer bank of expert slots, each layer's routed experts read before it runs.

The simplest streaming engine for an mlx-lm MoE model, to measure kq against: no residency manager, no
eviction policy beyond least-recently-used, no look-ahead. Each ``SwitchGLU`` / ``SwitchMLP`` of the model is
replaced by a :class:`BankSwitch`, whose call

1. evaluates the routing (``indices``, ``[..., K]`` int) and reads it to the host,
2. reads every distinct routed expert the bank does not hold from the safetensors files (one
   :meth:`kq_host.expert_store.ExpertStore.read_expert` each, in parallel through the store's reader threads),
   writing each into a slot freed in least-recently-used order, and
3. runs the family's own switch code on the bank (the routed ids mapped to slots).

When a pass routes more experts than the bank has slots (a prompt at a small residency), the experts are taken
in chunks of at most that many (the held ones first), each chunk's experts read and run on the entries routed to
them, and the entries' outputs put back in order.

    model, tokenizer, bank = load_slot_bank("models/wheels-moe", residency=0.25)
    for response in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=32): ...
    bank.close()
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# mlx-lm's switch layers sort a call's entries by expert from this many entries on (another gather_mm kernel).
SORT_FROM = 64


def _projections(switch: nn.Module) -> list[str]:
    """The per-expert linear layers of a SwitchGLU / SwitchMLP (those whose weight is ``[E, out, in]``)."""
    return [name for name, child in switch.children().items()
            if isinstance(child, nn.Module) and isinstance(child.get("weight"), mx.array) and child["weight"].ndim == 3]


def _expert_arrays(switch: nn.Module) -> dict[str, tuple[str, str]]:
    """``{payload key: (projection, array name)}`` of every per-expert array: a float weight keyed by its projection
    (``"gate_proj"``), any other array ``"<projection>.<name>"`` (``"gate_proj.scales"``), as
    :func:`kq_mlx.load.expert_tensor_names` names them."""
    out = {}
    for projection in _projections(switch):
        module = switch[projection]
        experts = module["weight"].shape[0]
        quantized = module.get("scales") is not None
        for name, value in module.items():
            if isinstance(value, mx.array) and value.ndim and value.shape[0] == experts:
                key = projection if name == "weight" and not quantized else f"{projection}.{name}"
                out[key] = (projection, name)
    return out


class BankSwitch(nn.Module):
    """A SwitchGLU / SwitchMLP whose experts live in a bank of ``num_slots`` slots filled from the files.

    Args:
        switch: the family's switch module (its expert arrays are never evaluated).
        num_slots: slots of the bank, an int in ``[1, E]``.
        module_path: the switch's path in the model (``model.layers.3.mlp.switch_mlp``).
    """

    def __init__(self, switch: nn.Module, num_slots: int, module_path: str):
        super().__init__()
        arrays = _expert_arrays(switch)
        first = next(iter(arrays.values()))
        self.num_experts = int(switch[first[0]][first[1]].shape[0])
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or not 1 <= num_slots <= self.num_experts:
            raise ValueError(f"BankSwitch: num_slots must be an int in [1, {self.num_experts}], got {num_slots!r}")
        bank = copy.copy(switch)
        for projection in _projections(switch):
            module = copy.copy(switch[projection])
            for name, value in switch[projection].items():
                if isinstance(value, mx.array) and value.ndim and value.shape[0] == self.num_experts:
                    module[name] = mx.zeros((num_slots, *value.shape[1:]), value.dtype)
            bank[projection] = module
        self.bank = bank
        object.__setattr__(self, "_meta", {"arrays": arrays, "num_slots": num_slots, "module_path": module_path,
                                           "engine": None, "layer": None})

    @property
    def module_path(self) -> str:
        return self._meta["module_path"]

    @property
    def num_slots(self) -> int:
        return self._meta["num_slots"]

    def tensor_names(self) -> dict[str, str]:
        """``{payload key: stacked tensor name}`` as mlx-lm's converted checkpoints hold it."""
        return {key: f"{self.module_path}.{key}" + ("" if "." in key else ".weight") for key in self._meta["arrays"]}

    def _write(self, slot: int, payload: dict[str, np.ndarray]) -> list[mx.array]:
        written = []
        for key, (projection, name) in self._meta["arrays"].items():
            target = self.bank[projection][name]
            value = np.asarray(payload[key])
            if value.dtype.kind not in "iu":
                value = value.astype(np.float32)  # bfloat16 and float16 through float32: exact
            target[slot] = mx.array(value).astype(target.dtype)
            written.append(target)
        return written

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """``x``: ``[..., D]``; ``indices``: ``[..., K]`` routed expert ids. Returns ``[..., K, D]``."""
        engine, layer = self._meta["engine"], self._meta["layer"]
        mx.eval(indices)
        k = indices.shape[-1]
        ids = np.array(indices).reshape(-1).astype(np.int64)
        wanted = np.unique(ids)
        engine.record(layer, wanted)
        held = engine.held[layer]
        if wanted.size <= self.num_slots:
            table = engine.acquire(self, layer, wanted)
            return self.bank(x, mx.array(table[ids].astype(np.uint32).reshape(indices.shape)))
        ordered = sorted(wanted.tolist(), key=lambda expert: expert not in held)  # the held ones first
        rank = np.empty(self.num_experts, np.int64)
        rank[np.array(ordered)] = np.arange(len(ordered))
        chunk_of = rank[ids] // self.num_slots
        rows = x.reshape(-1, x.shape[-1])
        outputs, positions = [], []
        for chunk in range(int(chunk_of.max()) + 1):
            entries = np.flatnonzero(chunk_of == chunk)
            table = engine.acquire(self, layer, np.unique(ids[entries]))
            slots = mx.array(table[ids[entries]].astype(np.uint32))[:, None]
            # The kernel the whole pass would take: mlx-lm sorts a call of SORT_FROM entries or more.
            copies = math.ceil(SORT_FROM / entries.size) if ids.size >= SORT_FROM > entries.size else 1
            out = self.bank(rows[mx.array(entries // k)], mx.repeat(slots, copies, axis=1))[:, :1]
            mx.eval(out)  # before the next chunk's reads take its slots
            outputs.append(out.reshape(entries.size, -1))
            positions.append(entries)
        back = np.argsort(np.concatenate(positions), kind="stable")
        return mx.concatenate(outputs)[mx.array(back)].reshape(*indices.shape, -1)


class SlotBank:
    """The engine behind a model's :class:`BankSwitch` layers: the store, what each bank holds, the figures.

    Attributes:
        switches: the banks, one per MoE layer in model order.
        held: per layer, ``OrderedDict`` expert -> slot, least recently used first.
        reads: experts read so far; bytes_read: their bytes.
        routed: per pass (a list), per layer, the distinct experts it routed (``set``).
    """

    def __init__(self, switches: list[BankSwitch], store, parallel: bool = True):
        self.switches, self.store, self.parallel = switches, store, parallel
        self.held = [OrderedDict() for _ in switches]
        self.reads = self.bytes_read = 0
        self.routed: list[list[set]] = []
        for layer, switch in enumerate(switches):
            switch._meta.update(engine=self, layer=layer)

    def record(self, layer: int, wanted: np.ndarray) -> None:
        if layer == 0:
            self.routed.append([set() for _ in self.switches])
        if self.routed:
            self.routed[-1][layer].update(wanted.tolist())

    def acquire(self, switch: BankSwitch, layer: int, wanted: np.ndarray) -> np.ndarray:
        """Makes ``wanted`` (at most the bank's slots) resident in ``layer``'s bank; returns ``int64 [E]``
        expert -> slot (-1 where not held)."""
        held = self.held[layer]
        missing = [int(e) for e in wanted if int(e) not in held]
        for expert in wanted:
            if int(expert) in held:
                held.move_to_end(int(expert))
        keep = set(int(e) for e in wanted)
        free = sorted(set(range(switch.num_slots)) - set(held.values()))
        slots = []
        for _ in missing:
            if free:
                slots.append(free.pop(0))
            else:
                victim = next(e for e in held if e not in keep)
                slots.append(held.pop(victim))
        if missing:
            if self.parallel:
                futures = [self.store.submit(layer, expert) for expert in missing]
                payloads = [future.result() for future in futures]
            else:
                payloads = [self.store.read_expert(layer, expert) for expert in missing]
            written = []
            for expert, slot, payload in zip(missing, slots, payloads):
                written += switch._write(slot, payload)
                held[expert] = slot
                self.reads += 1
                self.bytes_read += sum(array.nbytes for array in payload.values())
            mx.eval(*written)
        table = np.full(switch.num_experts, -1, np.int64)
        for expert, slot in held.items():
            table[expert] = slot
        return table

    def close(self) -> None:
        self.store.close()


def _path_key(path: str) -> tuple:
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.split("."))


def load_slot_bank(path, *, residency: float, parallel: bool = True):
    """Loads an mlx-lm MoE model directory with every SwitchGLU / SwitchMLP on a slot bank.

    Args:
        path: the model directory.
        residency: the fraction of each layer's experts a bank holds, ``(0, 1]``: ``max(1, round(E * residency))``
            slots, as kq's arena at that residency.
        parallel: read a chunk's experts through the store's reader threads (False: one after another).

    Returns:
        ``(model, tokenizer, SlotBank)``; a float model runs in float32 on MLX's CPU backend (its ``gather_mm``
        takes float32 only), as ``kq_mlx.load`` runs it.
    """
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchMLP
    from mlx_lm.utils import load as mlx_lm_load

    from kq_host.checkpoint import model_files
    from kq_host.expert_store import ExpertStore
    from kq_mlx.load import expert_tensor_names

    if isinstance(residency, bool) or not isinstance(residency, (int, float)) or not 0 < residency <= 1:
        raise ValueError(f"load_slot_bank: residency must be a number in (0, 1], got {residency!r}")
    model_dir = Path(path)
    model, tokenizer = mlx_lm_load(str(model_dir), lazy=True)
    named = dict(model.named_modules())
    paths = sorted((p for p, m in named.items() if isinstance(m, (SwitchGLU, SwitchMLP))), key=_path_key)
    if not paths:
        raise ValueError(f"load_slot_bank: path {model_dir} holds no MoE model (no SwitchGLU / SwitchMLP)")
    quantized = any(isinstance(m, (nn.QuantizedLinear, QuantizedSwitchLinear)) for m in model.modules())
    if mx.default_device() == mx.cpu and not quantized:
        model.set_dtype(mx.float32)
    switches = []
    for module_path in paths:
        switch = named[module_path]
        experts = int(switch[_projections(switch)[0]]["weight"].shape[0])
        bank = BankSwitch(switch, max(1, round(experts * residency)), module_path)
        parent_path, _, name = module_path.rpartition(".")
        parent = model
        for part in parent_path.split("."):
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        if isinstance(parent, list):
            parent[int(name)] = bank
        else:
            setattr(parent, name, bank)
        switches.append(bank)
    store = ExpertStore.for_tensors(model_files(model_dir), expert_tensor_names(model_dir, switches), queue_depth=8)
    engine = SlotBank(switches, store, parallel=parallel)
    mx.eval(model.parameters())  # the other weights and the empty banks; the files' experts never
    return model, tokenizer, engine
