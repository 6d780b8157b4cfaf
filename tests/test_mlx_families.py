"""The arena at the SwitchGLU seam over every model type of the installed mlx-lm that reaches one.

The model types are found by importing: every module of ``mlx_lm.models`` whose imports (the objects of its
namespace, followed through the other modules of ``mlx_lm.models`` they come from) reach ``SwitchGLU`` or
``SwitchMLP``; a tiny model of each is built and holds one (a model that wraps another family's model counts).
Each is a tiny random model from its own ``ModelArgs`` (2 MoE layers, hidden 32, 8 experts, top-2), float
and 4-bit ``nn.quantize``d. With every expert resident its logits are the unmodified model's bits (rules
shed and tier too); with a quarter of the experts resident ``generate_greedy(exact=True)`` gives the
unmodified model's greedy tokens. A model type that cannot run here is in ``EXCEPTIONS`` with the error it
raises, which is checked; a model type mlx-lm adds fails
``test_every_model_type_reaching_a_switch_is_tested_or_listed_with_its_reason`` until it is built or listed.
"""

import importlib
import pkgutil
import types

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
import mlx.nn as nn  # noqa: E402
import mlx_lm.models  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear, SwitchMLP  # noqa: E402

from kq_host.residency import ResidencyManager  # noqa: E402
from kq_host.tier import Tier, quantize  # noqa: E402
from kq_mlx.mlx_lm_adapter import (ROUTERS, ArenaMoeBlock, ArenaSwitch, SwitchGLUArena, attach_arena,  # noqa: E402
                                   attach_exact, attach_tier, generate_greedy, set_tables)

EXPERTS, LAYERS = 8, 2
SMALL = dict(
    hidden_size=32, num_hidden_layers=LAYERS, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, vocab_size=64, rms_norm_eps=1e-6, norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
    model_max_length=128, tie_word_embeddings=False,
    # the expert count and width under every family's own name
    num_experts=EXPERTS, num_local_experts=EXPERTS, n_routed_experts=EXPERTS, moe_num_experts=EXPERTS,
    num_experts_per_tok=2, moe_k=2, moe_topk=2, moe_top_k=2, top_k=2, share_expert_dim=32, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, shared_intermediate_size=32, n_shared_experts=1, num_shared_experts=1,
    num_shared_expert=1, moe_layer_freq=1, first_k_dense_replace=0, num_dense_layers=0, decoder_sparse_step=1,
    mlp_only_layers=[], norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    use_expert_bias=False, use_mixed_mlp_moe=False,
    # multi-head latent attention (DeepSeek, GLM-4-MoE-Lite, Kimi)
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    # attention options the families require
    attention_bias=False, use_bias=False, use_qk_norm=False, partial_rotary_factor=1.0, rotary_dim=8,
    rope_scaling=None, num_attention_groups=2, sliding_window=64, layer_types=["full_attention"] * LAYERS,
    is_moe_layer=[True] * LAYERS, use_cla=False, cla_share_factor=1, layer_group_size=1, group_norm_size=1,
    logits_scaling=1.0, attention_multiplier=1.0, embedding_multiplier=1.0, residual_multiplier=1.0,
    # linear attention (Qwen3-Next, Bailing linear)
    linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, full_attention_interval=2, conv_bias=False, conv_L_cache=3)
YARN = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.0}
# Kimi Delta Attention in the first layer, multi-head latent attention in the second (Kimi Linear, Kimi K3)
KDA = dict(linear_attn_config={"kda_layers": [1], "num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4},
           num_experts_per_token=2)
GEMMA4 = dict(enable_moe_block=True, top_k_experts=2, num_kv_shared_layers=0, global_head_dim=8,
              vocab_size_per_layer_input=64, hidden_size_per_layer_input=8,
              layer_types=["sliding_attention", "full_attention"])
LONGCAT = dict(attention_method="MLA", zero_expert_type="identity", ffn_hidden_size=64, expert_ffn_hidden_size=32,
               zero_expert_num=2, num_layers=LAYERS, mla_scale_q_lora=True, mla_scale_kv_lora=True)
MISTRAL4 = dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
                                 "original_max_position_embeddings": 128, "llama_4_scaling_beta": 0.1,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0})


def small(model_type: str, **extra) -> dict:
    """The small config as the language model's ``text_config`` of a family that nests one."""
    return {**SMALL, "model_type": model_type, **extra}


# Families that need more than the shared small config.
SPECIAL = {
    "gpt_oss": dict(layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v2": dict(rope_scaling=YARN),
    "deepseek_v41": dict(hc_mult=1),  # one residual stream: a token's routed experts fit a quarter arena
    "hunyuan": dict(rope_scaling={"type": "dynamic", "alpha": 1.0, "factor": 1.0}),
    # a linear-attention layer, then the global one (groups of 2, as released)
    "bailing_moe_linear": dict(layer_group_size=2),
    "gemma4_text": GEMMA4,
    "gemma4": dict(text_config=small("gemma4_text", **GEMMA4)),
    "glm_moe_dsa": dict(index_head_dim=8, index_n_heads=2, index_topk=2, topk_method="noaux_tc",
                        scoring_func="sigmoid", rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
    # a Mamba layer, then an attention layer; both MoE
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=8,
                             mamba_proj_bias=False, mamba_d_state=8, mamba_d_conv=4, mamba_n_groups=1,
                             mamba_conv_bias=True),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=0, expert_layer_period=1,
                  mamba_d_conv=4, mamba_d_state=8, mamba_expand=2),
    "kimi_k25": dict(text_config=small("deepseek_v3")),
    "kimi_k3": KDA,
    "kimi_linear": KDA,
    "kimi_vl": dict(text_config=small("kimi_vl")),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # four layers (its global attention is the fourth), MoE in every second one
    "llama4": dict(text_config=small("llama4_text", num_hidden_layers=4, interleave_moe_layer_step=2,
                                     num_experts_per_tok=1, attention_chunk_size=64, intermediate_size_mlp=64,
                                     use_qk_norm=True)),
    "longcat_flash": LONGCAT,
    "longcat_flash_ngram": dict(LONGCAT, ngram_vocab_size_ratio=4),
    "mellum": dict(layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"full_attention": {"rope_theta": 10000.0},
                                    "sliding_attention": {"rope_theta": 10000.0}}),
    "mimo_v2_flash": dict(hybrid_layer_pattern=[1, 0], moe_layer_freq=[1, 1], add_swa_attention_sink_bias=True,
                          add_full_attention_sink_bias=False, sliding_window_size=64, topk_method="noaux_tc",
                          scoring_func="sigmoid", layernorm_epsilon=1e-6, swa_rope_theta=10000.0,
                          swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, swa_v_head_dim=8),
    # a block-sparse attention layer (its indexer keeps 1 block of 2 keys), then a full one
    "minimax_m3_vl": dict(text_config=small("minimax_m3_vl", moe_layer_freq=[1, 1], dense_intermediate_size=64,
                                            rotary_dim=4, use_qk_norm=True, index_n_heads=2, index_head_dim=8,
                                            index_block_size=2, index_topk_blocks=1,
                                            layer_types=["sparse_attention", "full_attention"])),
    "mistral4": MISTRAL4,
    "mistral3": dict(text_config=small("mistral4", **MISTRAL4)),
    "muse_spark": dict(text_config=small("muse_spark", post_norm_eps=1e-6, rope_parameters={"rope_theta": 10000.0},
                                         layer_rope_theta=[10000.0, 0], final_logit_softcapping=30.0,
                                         layer_types=["sliding_attention", "full_attention"],
                                         output_multiplier=1.0, moe_hidden_size=32, num_shared_experts=0)),
    # Mamba-2, MoE, attention, MoE: one layer a block
    "nemotron_h": dict(hybrid_override_pattern=["M", "E", "*", "E"], mamba_num_heads=4, mamba_head_dim=8,
                       mamba_proj_bias=False, ssm_state_size=8, conv_kernel=4, n_groups=1, mlp_bias=False,
                       layer_norm_epsilon=1e-6, use_conv_bias=True, moe_shared_expert_intermediate_size=32),
    "phixtral": dict(num_vocab=64, model_dim=32, num_heads=4, num_layers=LAYERS, rotary_dim=8),
    # one 2-bit Hadamard-rotated projection (a shared expert's, 512 wide: the smallest rotation block)
    "prism_hadamard_qwen35": dict(
        schema_version=1, tensor_namespace="mlx-lm-text", quantization={"bits": 2, "group_size": 128, "mode": "affine"},
        modules=[{"path": "model.layers.0.mlp.shared_expert.down_proj", "embedding": False, "dtype": "float16",
                  "block": 512}],
        text_config=small("qwen3_5", shared_expert_intermediate_size=512)),
    "qwen3_vl_moe": dict(text_config=small("qwen3_moe")),
}

# Modules of mlx_lm.models that do not import here, and the error each raises.
NOT_IMPORTED = {"olmo": (SystemExit, "1", "it exits at import without the hf_olmo package (ai2-olmo)")}
# Model types that reach a SwitchGLU but cannot run here: the error each raises (checked), and why.
EXCEPTIONS = {
    "muse_spark": (RuntimeError, r"\[metal_kernel\] No Metal back-end",
                   ("its forward runs Metal kernels of mlx_lm.kernels (qk_norm_rope, expert_routing, ...) with no "
                    "other path: on MLX's CPU backend the first call raises RuntimeError: [metal_kernel] No Metal "
                    "back-end. Its tiny model builds and holds a SwitchGLU per layer")),
}
# Model types whose caches can be neither trimmed nor put back: generate_greedy(exact=True) refuses them by name.
EXACT_REFUSED = {"deepseek_v41": "its LayerCache (a compressed sliding-window KV cache of its own) has no trim"}


def model_modules() -> dict[str, types.ModuleType]:
    """Every module of the installed mlx_lm.models that imports, by name (``NOT_IMPORTED`` left out)."""
    modules = {}
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        if info.name not in NOT_IMPORTED:
            modules[info.name] = importlib.import_module(f"mlx_lm.models.{info.name}")
    return modules


def _models_modules_used(module: types.ModuleType) -> set[str]:
    """The other modules of mlx_lm.models whose objects ``module``'s namespace holds (or that it holds)."""
    used = set()
    for value in vars(module).values():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and name.startswith("mlx_lm.models.") and name != module.__name__:
            used.add(name.removeprefix("mlx_lm.models."))
    return used


def reaches_a_switch(name: str, modules: dict[str, types.ModuleType]) -> bool:
    """Whether module ``name``, or a module of mlx_lm.models it draws objects from (followed on), holds
    ``SwitchGLU`` or ``SwitchMLP``."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in modules:
            continue
        seen.add(current)
        if current != "switch_layers" and any(value is SwitchGLU or value is SwitchMLP
                                              for value in vars(modules[current]).values()):
            return True
        todo.extend(_models_modules_used(modules[current]))
    return False


MODULES = model_modules()
MODEL_TYPES = sorted(name for name, module in MODULES.items() if hasattr(module, "Model"))
MOE_TYPES = sorted(name for name in MODEL_TYPES if reaches_a_switch(name, MODULES))
FAMILIES = [name for name in MOE_TYPES if name not in EXCEPTIONS]


def config(family: str) -> dict:
    """The family's small config, as its config.json would give it."""
    return {"model_type": family, **SMALL, **SPECIAL.get(family, {})}


def construct(family: str):
    """The family's tiny model, its parameters not evaluated (MLX builds them lazily)."""
    module = MODULES[family]
    return module.Model(module.ModelArgs.from_dict(config(family)))


def build(family: str, *, quantized: bool, seed: int = 0):
    """The family's tiny model of random weights drawn from ``seed``, evaluated."""
    mx.random.seed(seed)
    model = construct(family)
    if quantized:
        # every layer whose input splits into groups of 32 (the experts always do); others stay float
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)
    mx.eval(model.parameters())
    return model


def switches(model) -> list:
    """The model's SwitchGLU / SwitchMLP modules."""
    return [module for module in model.modules() if isinstance(module, (SwitchGLU, SwitchMLP))]


VARIANTS = [pytest.param(False, id="float"), pytest.param(True, id="q4")]


def test_every_model_type_reaching_a_switch_is_tested_or_listed_with_its_reason():
    """The model types come from importing mlx_lm.models (the families that reach the seam only through
    another family's module among them); each one's tiny model builds and holds a switch of EXPERTS experts,
    so the tests below run it, or it is in EXCEPTIONS (and reaches one: no stale entry)."""
    assert set(EXCEPTIONS) <= set(MOE_TYPES)
    for name in FAMILIES:
        try:
            model = construct(name)
        except Exception as error:  # noqa: BLE001 - any error is the failure reported
            pytest.fail(f"mlx_lm.models.{name} reaches SwitchGLU/SwitchMLP but its tiny model does not build: "
                        f"{type(error).__name__}: {error}; give it the fields it needs in SPECIAL or list it in "
                        f"EXCEPTIONS with the error it raises")
        assert {linear.num_experts for switch in switches(model) for linear in switch.modules()
                if isinstance(linear, SwitchLinear)} == {EXPERTS}, name
    for wrapper, inner in (("kimi_k25", "deepseek_v3"), ("qwen3_vl_moe", "qwen3_moe"), ("solar_open", "glm4_moe"),
                           ("gemma4", "gemma4_text"), ("qwen3_5_moe", "qwen3_5"), ("mistral3", "mistral4")):
        assert wrapper in MOE_TYPES and "SwitchGLU" not in vars(MODULES[wrapper]), wrapper
        assert inner in _models_modules_used(MODULES[wrapper]), wrapper
    assert not any(reaches_a_switch(name, MODULES) for name in ("llama", "qwen3", "gemma3_text", "mamba2"))
    # every module of mlx_lm.models imports, but those listed, which fail as listed
    for name, (error, message, _) in NOT_IMPORTED.items():
        with pytest.raises(error, match=message):
            importlib.import_module(f"mlx_lm.models.{name}")


def test_a_tiny_model_holds_a_switch_exactly_when_its_model_type_reaches_one():
    """By building: every model type of mlx_lm.models whose tiny model builds from the small config holds a
    SwitchGLU / SwitchMLP if and only if its imports reach one (those that do not build reach none)."""
    built = {}
    for name in MODEL_TYPES:
        try:
            built[name] = bool(switches(construct(name)))
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as error:
            assert name not in MOE_TYPES, f"{name}: {type(error).__name__}: {error}"
    assert {name for name, held in built.items() if held} == set(MOE_TYPES)


@pytest.mark.skipif(mx.metal.is_available(), reason="the exceptions are measured on MLX's CPU backend")
@pytest.mark.parametrize("family", sorted(EXCEPTIONS))
def test_a_listed_exception_fails_as_listed(family):
    error, message, _ = EXCEPTIONS[family]
    model = build(family, quantized=False)
    assert switches(model)
    with pytest.raises(error, match=message):
        mx.eval(model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(model)))


def logits_of(model, prompt, steps):
    """Greedy decoding of ``steps`` tokens after ``prompt``: each step's last-position logits as uint32 bits."""
    cache, x, seen = make_prompt_cache(model), mx.array([prompt]), []
    for _ in range(steps):
        logits = model(x, cache=cache)[0, -1]
        mx.eval(logits)
        seen.append(np.array(logits).view(np.uint32))
        x = mx.argmax(logits).reshape(1, 1)
    return seen


def fill_every_expert(blocks, source=None):
    """Every expert resident, in slots that are not the expert ids (read from ``source``'s blocks: default
    ``blocks``)."""
    arena, tables = SwitchGLUArena(blocks), np.empty((len(blocks), EXPERTS), np.int32)
    for layer, block in enumerate(blocks):
        slots = np.roll(np.arange(EXPERTS), 3 + layer)
        tables[layer] = slots
        for expert in range(EXPERTS):
            arena.write_slot(layer, int(slots[expert]), (source or blocks)[layer].expert_weights(expert))
    set_tables(blocks, tables)


def random_tier(blocks) -> Tier:
    """A 4-bit tier of random experts in the layers' projection shapes."""
    rng = np.random.default_rng(0)
    weights = {}
    for projection in blocks[0].projections:
        linear = blocks[0].arena[projection]
        shape = (len(blocks), EXPERTS, linear.output_dims, linear.input_dims)
        weights[projection] = quantize(rng.normal(0, 0.1, shape).astype(np.float32), bits=4, group_size=32)
    return Tier(weights, 4, 32)


@pytest.mark.parametrize("quantized", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_expert_resident_is_the_model_bit_for_bit_under_every_seam_rule(family, quantized):
    prompt = [1, 2, 3]
    plain = build(family, quantized=quantized)
    want = logits_of(plain, prompt, 3)
    routed = any(type(module).__name__ in ROUTERS for module in plain.modules())  # kq routes the whole block
    model = build(family, quantized=quantized)
    blocks = attach_arena(model, EXPERTS)
    assert len(blocks) == len(switches(plain)) and all(block.num_experts == EXPERTS for block in blocks)
    assert all(isinstance(block, ArenaMoeBlock if routed else ArenaSwitch) for block in blocks)
    fill_every_expert(blocks)
    attach_tier(blocks, random_tier(blocks))
    for rule in ("shed", "tier", "stall") + (("route_shed",) if isinstance(blocks[0], ArenaMoeBlock) else ()):
        for block in blocks:
            block.rule = rule
        got = logits_of(model, prompt, 3)
        for step, (a, b) in enumerate(zip(got, want)):
            assert np.array_equal(a, b), f"rule {rule}, step {step}"


@pytest.mark.parametrize("quantized", VARIANTS)
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_the_tier_attaches_to_layers_whose_experts_were_dropped(family, quantized):
    """attach_arena(keep_experts=False) keeps what the tier needs of the layer's own experts (gpt-oss's
    per-expert projection biases): every expert resident under rule tier is the model bit for bit."""
    prompt = [1, 2, 3]
    want = logits_of(build(family, quantized=quantized), prompt, 3)
    source = attach_arena(build(family, quantized=quantized), EXPERTS)
    model = build(family, quantized=quantized)
    blocks = attach_arena(model, EXPERTS, keep_experts=False)
    fill_every_expert(blocks, source)
    attach_tier(blocks, random_tier(blocks))
    for block in blocks:
        block.rule = "tier"
    for step, (a, b) in enumerate(zip(logits_of(model, prompt, 3), want)):
        assert np.array_equal(a, b), f"step {step}"


def test_attach_arena_refusing_a_layer_leaves_every_layer_as_it_was():
    """Layers of other expert counts: the slots fit the first layer and not the second; the model runs as
    before, its experts kept (keep_experts=False drops nothing)."""
    prompt = [1, 2, 3]
    model = build("qwen3_moe", quantized=False)
    smaller = MODULES["qwen3_moe"]
    mx.random.seed(1)
    other = smaller.Model(smaller.ModelArgs.from_dict({"model_type": "qwen3_moe", **SMALL, "num_experts": 4}))
    model.model.layers[1].mlp = other.model.layers[1].mlp
    mx.eval(model.parameters())
    want = logits_of(model, prompt, 2)
    with pytest.raises(ValueError, match=r"attach_arena: num_slots must be an int in \[1, 4\]"):
        attach_arena(model, 6, keep_experts=False)
    assert not any(isinstance(module, (ArenaMoeBlock, ArenaSwitch)) for module in model.modules())
    for step, (a, b) in enumerate(zip(logits_of(model, prompt, 2), want)):
        assert np.array_equal(a, b), f"step {step}"


@pytest.mark.parametrize("quantized", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_exact_decoding_at_a_quarter_of_the_experts_gives_the_models_tokens(family, quantized):
    prompt, steps = [2, 7, 1], 4
    plain = build(family, quantized=quantized, seed=1)
    cache = make_prompt_cache(plain)
    for token in prompt[:-1]:  # the prompt a token a pass, as exact=True feeds it
        mx.eval(plain(mx.array([[token]]), cache=cache))
    want, x = [], mx.array([prompt[-1:]])
    for _ in range(steps):
        want.append(int(mx.argmax(plain(x, cache=cache)[0, -1]).item()))
        x = mx.array([want[-1:]])

    model = build(family, quantized=quantized, seed=1)
    blocks = attach_arena(model, EXPERTS // 4)
    manager = ResidencyManager(len(blocks), EXPERTS, EXPERTS // 4, arena=SwitchGLUArena(blocks), queue_depth=0,
                               loader=lambda layer, expert, slot: blocks[layer].expert_weights(expert))
    if family in EXACT_REFUSED:
        with pytest.raises(ValueError, match="generate_greedy: exact=True .* caches that can be put back"):
            generate_greedy(model, blocks, manager, prompt, steps, exact=True)
        return
    assert generate_greedy(model, blocks, manager, prompt, steps, exact=True) == want
    _, total = manager.stats()
    assert total.misses > 0 and total.reads_landed > 0
    manager.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "qwen3_next"])
def test_attach_exact_at_the_seam_is_the_model_to_the_bit(family):
    """Layer by layer (acquire before the experts run), for families whose routers kq does not know."""
    tokens = [3, 1, 4, 1, 5, 9]
    plain = build(family, quantized=False, seed=2)
    cache, want = make_prompt_cache(plain), []
    for token in tokens:
        want.append(np.array(plain(mx.array([[token]]), cache=cache)[0, -1]).view(np.uint32))
    model = build(family, quantized=False, seed=2)
    blocks = attach_arena(model, EXPERTS // 4)
    manager = ResidencyManager(len(blocks), EXPERTS, EXPERTS // 4, arena=SwitchGLUArena(blocks), queue_depth=0,
                               loader=lambda layer, expert, slot: blocks[layer].expert_weights(expert))
    attach_exact(model, blocks, manager)
    cache = make_prompt_cache(model)
    for position, token in enumerate(tokens):
        got = np.array(model(mx.array([[token]]), cache=cache)[0, -1]).view(np.uint32)
        manager.next_token()
        assert np.array_equal(got, want[position]), f"token {position}"
    assert manager.lookahead_stats()["critical_reads"].sum() > 0
    manager.close()
    with pytest.raises(ValueError, match="attach_exact: lookahead predicts with kq.s own routers"):
        attach_exact(model, blocks, manager, lookahead=True)


def test_rules_that_rescale_gate_weights_are_refused_by_name_at_the_seam():
    blocks = attach_arena(build("deepseek_v3", quantized=False), 4)
    for rule in ("route_shed", "renormalize", "substitute"):
        with pytest.raises(ValueError, match=f"rule '{rule}' rescales the gate weights"):
            blocks[0].rule = rule
    with pytest.raises(ValueError, match="rule must be one of"):
        blocks[0].rule = "drop"


def test_shed_at_the_seam_zeroes_a_misses_output_and_reports_it_by_top_k_position():
    model = build("olmoe", quantized=False)
    blocks = attach_arena(model, 4)
    arena = SwitchGLUArena(blocks)
    tables = np.full((len(blocks), EXPERTS), -1, np.int32)
    for layer, block in enumerate(blocks):
        for slot, expert in enumerate((0, 2, 4, 6)):
            tables[layer, expert] = slot
            arena.write_slot(layer, slot, block.expert_weights(expert))
    set_tables(blocks, tables)
    x = mx.random.normal((1, 5, 32))
    indices = mx.array(np.array([[[0, 1], [3, 2], [5, 7], [6, 4], [2, 0]]], np.uint32))
    got = blocks[0](x, indices)
    want = blocks[0].source(x, indices)
    mx.eval(got, want)
    kept = np.isin(np.array(indices), (0, 2, 4, 6))
    got, want = np.array(got), np.array(want)
    assert np.array_equal(got[kept].view(np.uint32), want[kept].view(np.uint32))
    assert not got[~kept].any() and want[~kept].any()
    report = blocks[0].report()
    assert report.miss_ids.tolist() == [[1, -1], [3, -1], [5, 7], [-1, -1], [-1, -1]]  # top-k position order


def test_each_arena_names_its_checkpoint_tensors():
    """The layer -> tensor prefix is in the model: each arena's module_path and tensor_names, as the
    family's checkpoint (saved from the model) names its stacked experts."""
    from mlx.utils import tree_flatten

    for family, quantized in (("deepseek_v3", False), ("gpt_oss", True), ("dots1", False), ("laguna", False)):
        model = build(family, quantized=quantized)
        names = dict(tree_flatten(model.parameters()))
        blocks = attach_arena(model, 4)
        for block in blocks:
            for key, name in block.tensor_names().items():
                stacked = names[name]
                assert stacked.shape[0] == EXPERTS and tuple(stacked.shape[1:]) == block.slot_layout()[key][0], name
            assert f".{block.model_layer}." in f".{block.module_path}."


def test_the_stacked_experts_are_each_experts_payload():
    """stacked_expert_weights()[key][e] is expert_weights(e)[key], bit for bit and dtype for dtype: float
    (float32 and bfloat16 arenas), 4-bit (packed weights, scales, biases) and a projection bias (gpt-oss)."""
    for family, quantized, dtype in (("deepseek_v3", False, mx.bfloat16), ("gpt_oss", True, None),
                                     ("qwen3_moe", False, None)):
        model = build(family, quantized=quantized)
        if dtype is not None:
            model.set_dtype(dtype)
        block = attach_arena(model, 4)[-1]
        stacked = block.stacked_expert_weights()
        assert set(stacked) == set(block.slot_layout())
        for expert in (0, 3, EXPERTS - 1):
            for key, want in block.expert_weights(expert).items():
                got = stacked[key][expert]
                assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), key


def test_the_lazy_checkpoint_of_a_seam_family_streams_from_its_own_tensor_names(tmp_path):
    """deepseek_v3 saved, loaded lazily, its experts dropped: the arena reads each expert from the file
    under tensor_names(), and exact decoding gives the unmodified model's tokens."""
    import dataclasses

    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, save_config, save_model

    from kq_host.expert_store import read_safetensors_header

    model = build("deepseek_v3", quantized=False, seed=3)
    save_model(tmp_path, model)
    save_config({**dataclasses.asdict(model.args), "model_type": "deepseek_v3"}, tmp_path / "config.json")
    lazy, _ = load_model(tmp_path, lazy=True)
    blocks = attach_arena(lazy, 2, keep_experts=False)
    mx.eval(lazy.parameters())
    kept = dict(tree_flatten(lazy.parameters()))
    assert not any(name in kept for block in blocks for name in block.tensor_names().values())
    [file] = sorted(tmp_path.glob("*.safetensors"))
    header = read_safetensors_header(file)
    tensors = mx.load(str(file))

    def load(layer, expert, slot):
        for name in blocks[layer].tensor_names().values():
            assert name in header
        return {key: np.array(tensors[name][expert]) for key, name in blocks[layer].tensor_names().items()}

    manager = ResidencyManager(len(blocks), EXPERTS, 2, arena=SwitchGLUArena(blocks), queue_depth=0, loader=load)
    plain = build("deepseek_v3", quantized=False, seed=3)
    cache = make_prompt_cache(plain)
    mx.eval(plain(mx.array([[5]]), cache=cache))
    want, x = [], mx.array([[6]])
    for _ in range(3):
        want.append(int(mx.argmax(plain(x, cache=cache)[0, -1]).item()))
        x = mx.array([want[-1:]])
    assert generate_greedy(lazy, blocks, manager, [5, 6], 3, exact=True) == want
    manager.close()
