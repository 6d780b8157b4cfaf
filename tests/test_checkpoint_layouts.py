"""Each checkpoint family's expert count, and ``kq demo --rule exact`` on a Mixtral-layout checkpoint."""

import json

import numpy as np
import pytest

from kq.study import SHIPPED_MODEL
from kq_host.checkpoint import CheckpointError, expert_count


def test_expert_count_reads_each_family_s_own_key():
    assert expert_count({"model_type": "qwen3_moe", "num_experts": 128}) == 128
    assert expert_count({"model_type": "mixtral", "num_local_experts": 8, "num_experts": 3}) == 8


@pytest.mark.parametrize("config, named", [
    ({"model_type": "llama", "num_experts": 8}, "model_type 'llama'"),
    ({"num_experts": 8}, "model_type None"),
    ({"model_type": "mixtral", "num_experts": 8}, "num_local_experts"),
    ({"model_type": "qwen3_moe", "num_experts": 0}, "num_experts"),
    ({"model_type": "qwen3_moe", "num_experts": True}, "num_experts"),
    ({"model_type": "qwen3_moe", "num_experts": "8"}, "num_experts"),
])
def test_expert_count_refuses_a_config_without_a_count(config, named):
    with pytest.raises(CheckpointError, match=named):
        expert_count(config)


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory):
    """A tiny random float Mixtral in the Hugging Face layout (one tensor per expert: w1, w2, w3)."""
    pytest.importorskip("mlx_lm")
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import mixtral
    from safetensors.numpy import save_file

    args = dict(model_type="mixtral", vocab_size=4096, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    mx.random.seed(5)
    model = mixtral.Model(mixtral.ModelArgs(**args))
    tensors = {}
    for name, value in tree_flatten(model.parameters()):
        value = np.array(value)
        if ".switch_mlp." in name:
            prefix, projection = name.split(".switch_mlp.")
            hf = {"gate_proj.weight": "w1", "down_proj.weight": "w2", "up_proj.weight": "w3"}[projection]
            for expert in range(value.shape[0]):
                tensors[f"{prefix}.experts.{expert}.{hf}.weight"] = np.ascontiguousarray(value[expert])
        else:
            tensors[name] = value
    directory = tmp_path_factory.mktemp("mixtral")
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(args))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_MODEL / name, directory / name)
    return directory


def test_exact_generation_runs_a_mixtral_checkpoint(mixtral_checkpoint):
    """Its experts are counted by num_local_experts and read under w1/w3/w2: at a quarter of them resident
    the text is the one with every expert resident."""
    from kq.demo import generate_exact

    prompt, tokens = [478, 852, 63, 2217], 5
    everything = generate_exact("mlx", mixtral_checkpoint, prompt, tokens, 1.0, queue_depth=0)
    quarter = generate_exact("mlx", mixtral_checkpoint, prompt, tokens, 0.25, queue_depth=0)
    assert everything.slots == 8 and quarter.slots == 2
    assert len(quarter.tokens) == len(prompt) + tokens and quarter.tokens == everything.tokens
    assert quarter.lookups == tokens * 2 * 2 and quarter.hits < quarter.lookups and quarter.bytes_read > 0
