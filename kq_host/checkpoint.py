"""Where a checkpoint keeps its experts, how wide they are, and how long the model was trained.

Families by ``config.json``'s ``model_type``: each expert's projections' tensor names (Hugging Face
names, in the arena's projection order gate, up, down), the config key of the expert count and of the
experts' hidden width; :func:`trained_length` reads the sequence length the checkpoint was trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

from kq_core.contract import EXPERT_PROJECTIONS

class CheckpointError(ValueError):
    """A checkpoint kq cannot run: a ``config.json`` that cannot be read or holds a value no model has, a
    weights file that cannot be read, or tensors that disagree with the model ``config.json`` describes.
    The message names the file, and the key or tensor."""


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
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def expert_nbytes(checkpoint, projections=EXPERT_PROJECTIONS, template=None) -> int:
    """One expert's bytes in the checkpoint (every projection, the file's dtype)."""
    from kq_host.quantized import open_experts

    with open_experts(checkpoint, projections, template=template) as store:
        return store.expert_nbytes(0)
