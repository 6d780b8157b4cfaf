"""The JAX model path refuses checkpoints and inputs it cannot run, by name: a config.json that disagrees
with the weights, broken or missing safetensors files, out-of-range tokens and positions; the exact
loop's reads wait at most its timeout; ``kq study`` ends each of these in a one-line error."""

import json
import threading

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from kq.study import SHIPPED_MODEL  # noqa: E402

WEIGHTS = "model.safetensors"


def _checkpoint(directory, weights=None, **changes):
    """The shipped model in ``directory`` with ``changes`` to its config.json; its weights linked, or
    ``weights`` (bytes) written in their place, or none where ``weights`` is ``b""``."""
    directory.mkdir()
    for path in SHIPPED_MODEL.iterdir():
        if path.name not in ("config.json", WEIGHTS):
            (directory / path.name).symlink_to(path)
    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    if weights is None:
        (directory / WEIGHTS).symlink_to(SHIPPED_MODEL / WEIGHTS)
    elif weights:
        (directory / WEIGHTS).write_bytes(weights)
    return directory


# ---- load_params checks every tensor against config.json ---------------------------------------------

CONFIG_MISMATCHES = [
    ({"num_experts": 32}, r"model\.safetensors.*not in the model.*model\.layers\.0\.mlp\.experts\.32\."),
    ({"num_experts": 128}, r"lacks .*model\.layers\.0\.mlp\.experts\.64\."),
    ({"num_hidden_layers": 2}, r"not in the model.*model\.layers\.2\."),
    ({"num_hidden_layers": 8}, r"lacks .*model\.layers\.4\."),
    ({"hidden_size": 64}, r"model\.embed_tokens\.weight has shape \(4096, 128\).*\(4096, 64\)"),
    ({"vocab_size": 2048}, r"model\.embed_tokens\.weight has shape \(4096, 128\).*\(2048, 128\)"),
    ({"num_attention_heads": 8}, r"model\.layers\.0\.self_attn\.q_proj\.weight has shape"),
    ({"num_key_value_heads": 4}, r"model\.layers\.0\.self_attn\.k_proj\.weight has shape"),
    ({"head_dim": 16}, r"model\.layers\.0\.self_attn\.q_norm\.weight has shape \(32,\).*\(16,\)"),
    ({"moe_intermediate_size": 32}, r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight has shape"),
]


@pytest.mark.parametrize("changes, message", CONFIG_MISMATCHES, ids=[next(iter(c)) + str(next(iter(c.values())))
                                                                      for c, _ in CONFIG_MISMATCHES])
@pytest.mark.parametrize("experts", [True, False], ids=["experts", "no-experts"])
def test_load_params_refuses_a_config_the_weights_do_not_match_naming_file_and_tensor(tmp_path, changes, message,
                                                                                       experts):
    from kq_jax import qwen3_moe

    directory = _checkpoint(tmp_path / "model", **changes)
    cfg = qwen3_moe.Qwen3MoeConfig.load(directory)
    with pytest.raises(qwen3_moe.CheckpointError, match=message) as caught:
        qwen3_moe.load_params(directory, cfg, experts=experts)
    assert isinstance(caught.value, ValueError) and str(directory) in str(caught.value)


@pytest.mark.parametrize("changes, message", [
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"), ({"num_experts_per_tok": 100}, "num_experts_per_tok"),
    ({"num_attention_heads": 3}, "num_key_value_heads"), ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"head_dim": 31}, "head_dim"), ({"vocab_size": "4096"}, "vocab_size"),
    ({"norm_topk_prob": "false"}, "norm_topk_prob"), ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"rope_theta": None}, "rope_theta"), ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
])
def test_the_config_refuses_values_no_model_has_naming_the_key_and_file(tmp_path, changes, message):
    from kq_jax import qwen3_moe

    directory = _checkpoint(tmp_path / "model", **changes)
    with pytest.raises(qwen3_moe.CheckpointError, match=message) as caught:
        qwen3_moe.Qwen3MoeConfig.load(directory)
    assert "config.json" in str(caught.value)


def test_load_params_still_reads_the_shipped_model_and_its_4bit_copy():
    from kq_jax import qwen3_moe

    for directory in (SHIPPED_MODEL, SHIPPED_MODEL.parent / "wheels-moe"):
        cfg = qwen3_moe.Qwen3MoeConfig.load(directory)
        params = qwen3_moe.load_params(directory, cfg)
        assert len(params["layers"]) == cfg.num_hidden_layers
        assert params["layers"][-1]["gate_proj"].shape == (cfg.num_experts, cfg.moe_intermediate_size,
                                                           cfg.hidden_size)


@pytest.mark.parametrize("weights, message", [
    (b"", r"holds no model\*\.safetensors"),
    ("half", r"model\.safetensors: tensor .* run past the end of the file"),
    ("header", r"model\.safetensors: header length .* does not fit the file"),
])
def test_load_params_refuses_missing_truncated_and_corrupt_weights_naming_the_file(tmp_path, weights, message):
    from kq_jax import qwen3_moe

    data = (SHIPPED_MODEL / WEIGHTS).read_bytes()
    weights = {"half": data[:len(data) // 2], "header": b"\xff" * 8 + data[8:]}.get(weights, weights)
    directory = _checkpoint(tmp_path / "model", weights=weights)
    with pytest.raises(qwen3_moe.CheckpointError, match=message):
        qwen3_moe.load_params(directory, qwen3_moe.Qwen3MoeConfig.load(directory))


def test_load_params_refuses_a_tensor_in_two_shards_naming_both(tmp_path):
    from safetensors.numpy import load_file, save_file

    from kq_jax import qwen3_moe

    directory = _checkpoint(tmp_path / "model", weights=b"")
    tensors = load_file(str(SHIPPED_MODEL / WEIGHTS))
    names = sorted(tensors)
    twice = "model.layers.0.self_attn.q_proj.weight"
    first = {name: tensors[name] for name in names[: len(names) // 2]} | {twice: tensors[twice]}
    second = {name: tensors[name] for name in names[len(names) // 2:]} | {twice: tensors[twice] * 100}
    save_file(first, str(directory / "model-00001-of-00002.safetensors"))
    save_file(second, str(directory / "model-00002-of-00002.safetensors"))
    with pytest.raises(qwen3_moe.CheckpointError, match=rf"{twice} is in .*00001.* and in .*00002"):
        qwen3_moe.load_params(directory, qwen3_moe.Qwen3MoeConfig.load(directory))


# ---- kq study ends each broken input in one line -----------------------------------------------------


def _study(capsys, *args):
    from kq.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["study", "--tokens", "4", "--warmup", "1", "--residency", "0.5", "--policies", "lfu", "--no-progress",
              *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return caught.value.code, err.strip().splitlines()[-1]


STUDY_FAULTS = [
    ({"num_experts": 128}, None, r"config\.json.*model\.layers\.0\.mlp\.experts\.64\."),
    ({"num_experts": 32}, None, r"not in the model.*experts\.32\."),
    ({"num_hidden_layers": 8}, None, r"lacks .*model\.layers\.4\."),
    ({"num_hidden_layers": 2}, None, r"not in the model.*model\.layers\.2\."),
    ({"num_experts_per_tok": 0}, None, r"config\.json.*num_experts_per_tok"),
    ({"num_experts_per_tok": 100}, None, r"config\.json.*num_experts_per_tok"),
    ({}, b"", r"holds no model\*\.safetensors"),
    ({}, "half", r"model\.safetensors.*cannot be read"),
    ({}, "header", r"model\.safetensors.*cannot be read"),
]


# mlx-lm's loader words the mismatches its own way
MLX_MESSAGES = {"num_experts": r"mlx-lm refuses its weights.*(parameters not in model|lacks).*experts\.\d+\.",
                "num_hidden_layers": r"mlx-lm refuses its weights.*(Missing|not in model).*model\.layers\.\d+\."}


@pytest.mark.parametrize("framework", ["jax", "mlx"])
@pytest.mark.parametrize("changes, weights, message", STUDY_FAULTS,
                         ids=["experts128", "experts32", "layers8", "layers2", "topk0", "topk100", "no-weights",
                              "truncated", "corrupt"])
def test_kq_study_ends_a_broken_checkpoint_in_one_line_naming_it(tmp_path, capsys, framework, changes, weights,
                                                                 message):
    if framework == "mlx":
        pytest.importorskip("mlx_lm")
        message = MLX_MESSAGES.get(next(iter(changes), None), message)
    data = (SHIPPED_MODEL / WEIGHTS).read_bytes()
    weights = {"half": data[:len(data) // 2], "header": b"\xff" * 8 + data[8:]}.get(weights, weights)
    directory = _checkpoint(tmp_path / "model", weights=weights, **changes)
    code, line = _study(capsys, "--framework", framework, "--checkpoint", str(directory), "--rules", "route_shed")
    assert code == 2 and line.startswith("kq study: error: ")
    assert str(directory) in line
    assert __import__("re").search(message, line), line


@pytest.mark.parametrize("framework", ["jax", "mlx"])
def test_kq_study_refuses_a_tier_group_size_the_experts_widths_do_not_divide(capsys, framework):
    if framework == "mlx":
        pytest.importorskip("mlx_lm")
    code, line = _study(capsys, "--framework", framework, "--rules", "tier", "--tier-group-size", "128")
    assert code == 2 and "--tier-group-size 128" in line and "moe_intermediate_size 64" in line


# ---- the exact loop: tokens and positions in range, reads waited for at most its timeout -----------------


@pytest.fixture(scope="module")
def exact_model():
    from kq_jax import qwen3_moe

    cfg = qwen3_moe.Qwen3MoeConfig.load(SHIPPED_MODEL)
    return cfg, qwen3_moe.load_params(SHIPPED_MODEL, cfg, experts=False)


def _loop(exact_model, store, loader=None, *, queue_depth=0, **options):
    from kq_host.residency import ResidencyManager
    from kq_jax.arena import JaxArena
    from kq_jax.exact_loop import ExactLoop

    cfg, params = exact_model
    shapes = {name: (shape, np.float32) for name, (shape, _) in store.expert_shapes(0).items()}
    arena = JaxArena(cfg.num_hidden_layers, 16, shapes)
    manager = ResidencyManager(cfg.num_hidden_layers, cfg.num_experts, 16, arena=arena, queue_depth=queue_depth,
                               loader=loader or (lambda layer, expert, slot: store.read_expert(layer, expert)))
    return ExactLoop(params, cfg, manager, arena, length=8, lookahead=False, **options), manager


@pytest.fixture
def store():
    from kq_host.checkpoint import open_experts
    from kq_jax import qwen3_moe

    with open_experts(SHIPPED_MODEL, qwen3_moe.PROJECTIONS) as store:
        yield store


@pytest.mark.parametrize("token", [4096, 5096, 10**9, -1, np.int64(4096), np.array([4096], np.int32), True, 2.0,
                                   np.array([1.0], np.float32), np.array([1, 2], np.int32)],
                         ids=["vocab", "vocab+1000", "1e9", "-1", "np-int64", "array", "bool", "float",
                              "float-array", "two-tokens"])
def test_the_exact_loop_refuses_a_token_outside_the_vocabulary_by_name(exact_model, store, token):
    import jax.numpy as jnp

    loop, manager = _loop(exact_model, store)
    try:
        for given in (token, jnp.asarray(token)) if isinstance(token, np.ndarray) else (token,):
            with pytest.raises(ValueError, match=r"ExactLoop\.step: token"):
                loop.step(given, 0)
        assert manager.token == 0  # nothing ran
        logits = loop.step(jnp.asarray([4095], jnp.int32), 0)  # the last token of the vocabulary runs
        assert np.asarray(logits).shape == (1, 4096) and np.isfinite(np.asarray(logits)).all()
    finally:
        manager.close()


@pytest.mark.parametrize("position", [8, -1, 2.0, True, 10**9])
def test_the_exact_loop_refuses_a_position_outside_its_length_by_name(exact_model, store, position):
    loop, manager = _loop(exact_model, store)
    try:
        with pytest.raises(ValueError, match=r"ExactLoop\.step: position"):
            loop.step(7, position)
    finally:
        manager.close()


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "1", True, np.True_])
def test_the_exact_loop_refuses_a_timeout_it_cannot_wait_by_name(exact_model, store, timeout):
    with pytest.raises(ValueError, match="timeout"):
        _loop(exact_model, store, timeout=timeout)


@pytest.mark.parametrize("budget", [-1, 1.5, "2", True])
def test_the_exact_loop_refuses_a_prefetch_budget_it_cannot_keep_by_name(exact_model, store, budget):
    with pytest.raises(ValueError, match="prefetch_budget"):
        _loop(exact_model, store, prefetch_budget=budget)


@pytest.mark.parametrize("which", ["another-arena", "no-arena", "fewer-slots"])
def test_the_exact_loop_refuses_an_arena_that_is_not_the_managers(exact_model, store, which):
    """The manager writes its own arena: a loop over another one would run experts nobody wrote."""
    from kq_host.residency import ResidencyManager
    from kq_jax.arena import JaxArena
    from kq_jax.exact_loop import ExactLoop

    cfg, params = exact_model
    shapes = {name: (shape, np.float32) for name, (shape, _) in store.expert_shapes(0).items()}
    layers = cfg.num_hidden_layers
    owned = JaxArena(layers, 16, shapes)
    manager = ResidencyManager(layers, cfg.num_experts, 16, arena=owned if which != "fewer-slots" else None,
                               queue_depth=0, loader=lambda layer, expert, slot: store.read_expert(layer, expert))
    given = {"another-arena": JaxArena(layers, 16, shapes), "no-arena": None,
             "fewer-slots": JaxArena(layers, 8, shapes)}[which]
    with pytest.raises(ValueError, match="arena"):
        ExactLoop(params, cfg, manager, given, length=4)
    manager.close()


@pytest.mark.parametrize("timeout", [None, 2.5])
def test_the_exact_loop_passes_its_timeout_to_every_acquire(exact_model, store, timeout):
    from kq_jax.exact_loop import DEFAULT_TIMEOUT_S

    loop, manager = _loop(exact_model, store, **({} if timeout is None else {"timeout": timeout}))
    seen = []
    acquire = manager.acquire

    def spy(layer, indices, scores, **options):
        seen.append(options.get("timeout", "absent"))
        return acquire(layer, indices, scores, **options)

    manager.acquire = spy
    try:
        loop.step(7, 0)
    finally:
        manager.close()
    want = DEFAULT_TIMEOUT_S if timeout is None else timeout
    assert seen == [want] * exact_model[0].num_hidden_layers and 0 < DEFAULT_TIMEOUT_S < float("inf")


def test_a_read_stuck_past_the_timeout_raises_instead_of_hanging(exact_model, store):
    from kq_host.residency import PreloadError

    release = threading.Event()

    def stuck(layer, expert, slot):
        release.wait()
        return store.read_expert(layer, expert)

    loop, manager = _loop(exact_model, store, stuck, queue_depth=2, timeout=0.2)
    try:
        with pytest.raises(PreloadError):
            loop.step(7, 0)
    finally:
        release.set()
        manager.close()
