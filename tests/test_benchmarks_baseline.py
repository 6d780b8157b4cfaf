"""The slot-bank baseline of benchmarks/load_decode.py (benchmarks/slot_bank.py) runs the shipped models as
mlx-lm does: the same logits, bit for bit, and the same greedy tokens, with its banks smaller than a layer's
experts (a prompt then runs in chunks)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("slot_bank", ROOT / "benchmarks" / "slot_bank.py")
slot_bank = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slot_bank)


def _mlx_lm_model(path):
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    from mlx_lm.utils import load

    model, tokenizer = load(str(path), lazy=True)
    if not any(isinstance(m, (nn.QuantizedLinear, QuantizedSwitchLinear)) for m in model.modules()):
        model.set_dtype(mx.float32)  # as the baseline and kq run a float model on MLX's CPU backend
    mx.eval(model.parameters())
    return model, tokenizer


def _bits(array):
    """The array's bits (a bfloat16 array as uint16: NumPy has no bfloat16)."""
    return np.array(array.view({2: mx.uint16, 4: mx.uint32}[array.dtype.size]))


def _prompt(tokenizer, path, count):
    return tokenizer.encode((path / "heldout.txt").read_text()[: count * 16])[:count]


@pytest.mark.parametrize("name, prompt_tokens, residency", [("stdlib-moe", 96, 0.25), ("stdlib-moe", 96, 1.0),
                                                            ("wheels-moe", 48, 0.25)])
def test_slot_bank_logits_and_tokens_equal_mlx_lm(name, prompt_tokens, residency):
    path = ROOT / "models" / name
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"{path} is not shipped here")
    reference, tokenizer = _mlx_lm_model(path)
    ids = _prompt(tokenizer, path, prompt_tokens)
    model, _, bank = slot_bank.load_slot_bank(path, residency=residency)
    try:
        expected = reference(mx.array(ids)[None])
        got = model(mx.array(ids)[None])
        mx.eval(expected, got)
        slots = bank.switches[0].num_slots
        routed = bank.routed[0]
        if residency < 1:  # the prompt routes more experts than a bank holds: it ran in chunks
            assert max(len(experts) for experts in routed) > slots
        else:  # from empty banks, each routed expert read once
            assert bank.reads == sum(len(experts) for experts in routed)
        assert got.dtype == expected.dtype
        assert np.array_equal(_bits(got), _bits(expected))
        want = [r.token for r in mlx_lm.stream_generate(reference, tokenizer, ids, max_tokens=8)]
        tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=8)]
        assert tokens == want
    finally:
        bank.close()


@pytest.mark.parametrize("residency", [0, 1.5, "0.5", True])
def test_slot_bank_refuses_a_residency_outside_0_1(residency):
    with pytest.raises(ValueError, match="residency"):
        slot_bank.load_slot_bank(ROOT / "models" / "stdlib-moe", residency=residency)
