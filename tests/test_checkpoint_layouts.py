"""Each checkpoint family's expert count, and ``kq demo --rule exact`` on a Mixtral-layout checkpoint."""


import pytest

from kq_host.checkpoint import CheckpointError, expert_count
from tiny_models import write_mixtral


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
    return write_mixtral(tmp_path_factory.mktemp("mixtral"), seed=5)


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
