"""``kq generate``: the shipped models and a tiny DeepSeek-V3 directory through an arena, exact against mlx-lm's own
greedy generation; the figures it reports; bad arguments refused by name."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from kq.cli import main  # noqa: E402
from kq.generate import GenerateConfig, GenerateError, generate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STDLIB, WHEELS = ROOT / "models" / "stdlib-moe", ROOT / "models" / "wheels-moe"
PROMPT = "def read_config(path):\n    with open(path) as handle:"


def mlx_lm_tokens(directory, prompt, max_tokens):
    """The unmodified model's greedy tokens from mlx_lm.stream_generate (float models in float32 on MLX's CPU
    backend, whose gather_mm takes float32 only, as kq generate runs them)."""
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    model, tokenizer = load(str(directory))
    quantized = "quantization" in json.loads((Path(directory) / "config.json").read_text())
    if mx.default_device() == mx.cpu and not quantized:
        model.set_dtype(mx.float32)
    return [response.token for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]


def test_the_shipped_models_are_qwen3_moe_mlx_lm_directories():
    for directory, quantized in ((STDLIB, False), (WHEELS, True)):
        config = json.loads((directory / "config.json").read_text())
        assert config["model_type"] == "qwen3_moe" and ("quantization" in config) == quantized
        assert (directory / "tokenizer.json").is_file() and list(directory.glob("*.safetensors"))


@pytest.mark.parametrize("residency", [1 / 64, 0.25, 1.0], ids=["one-slot", "quarter", "full"])
def test_cli_exact_on_the_shipped_model_gives_mlx_lms_greedy_tokens(residency, capsys, tmp_path):
    want = mlx_lm_tokens(STDLIB, PROMPT, 20)
    report = tmp_path / "run.json"
    assert main(["generate", "--model", str(STDLIB), "--prompt", PROMPT, "--max-tokens", "20", "--residency",
                 str(residency), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    result = json.loads(report.read_text())
    assert result["tokens"] == want
    from mlx_lm import load

    _, tokenizer = load(str(STDLIB))
    # the prompt echoed, then the streamed text
    assert out.startswith(PROMPT + tokenizer.decode([t for t in want if t not in tokenizer.eos_token_ids]))
    for line in ("prompt: ", "generation: ", "tokens/s", "hit rate", "MiB read a token", "peak memory: "):
        assert line in out
    assert result["slots"] == max(1, round(64 * residency)) and result["num_layers"] == 4
    assert result["prompt_reads"] >= result["prompt_routed_pairs"] > 0
    assert result["peak_rss_mib"] > 0 and result["memory_bound_mib"] > 0  # the bound is checked by the huge_model job: a test worker's RSS holds other tests' models
    if residency == 1.0:  # every expert fits: each read at most once
        assert result["prompt_reads"] + result["generation_reads"] <= 4 * 64
    else:
        assert result["hit_rate"] < 1.0 and result["mib_read_per_token"] > 0


def test_exact_on_the_quantized_shipped_model_reads_its_packed_experts_and_gives_mlx_lms_tokens():
    want = mlx_lm_tokens(WHEELS, PROMPT, 12)
    result = generate(GenerateConfig(WHEELS, PROMPT, max_tokens=12, residency=0.25))
    assert result.tokens == want and result.quantized
    # one expert as stored: three 4-bit projections of 128 x 64, with their 16-bit scales and biases (groups of 64)
    assert result.expert_mib * 2**20 == 3 * (128 * 64 // 2 + 2 * 2 * 128 * 64 // 64)
    # the prompt's one prefill pass from a cold arena: each routed (layer, expert) read once
    assert result.prefill_reads == result.prompt_routed_pairs > 16 * 16
    assert result.prompt_reads >= result.prefill_reads
    assert result.time_to_first_token_s > 0 and result.prompt_tps > 0


def write_deepseek_v3(directory: Path, *, quantized: bool = False, bits: int = 4, bfloat16: bool = False) -> Path:
    """A random DeepSeek-V3 model directory (its first layer dense, routers random), saved by mlx-lm with the
    shipped model's tokenizer; the same weights for every option (``bits``: the quantization's)."""
    import dataclasses

    from mlx_lm.models import deepseek_v3
    from mlx_lm.utils import save_config, save_model

    mx.random.seed(5)
    args = deepseek_v3.ModelArgs(
        model_type="deepseek_v3", vocab_size=4096, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=2,
        topk_group=1, num_experts_per_tok=4, moe_layer_freq=1, first_k_dense_replace=1,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, attention_bias=False)
    model = deepseek_v3.Model(args)
    for layer in model.model.layers[1:]:  # mlx-lm starts the routers at zero: every token would route alike
        layer.mlp.gate.weight = mx.random.normal(layer.mlp.gate.weight.shape)
    config = dataclasses.asdict(args)
    if bfloat16:
        model.set_dtype(mx.bfloat16)
    if quantized:
        import mlx.nn as nn

        nn.quantize(model, group_size=32, bits=bits,
                    class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)
        config["quantization"] = {"group_size": 32, "bits": bits, "mode": "affine"}
    mx.eval(model.parameters())
    directory.mkdir(parents=True, exist_ok=True)
    save_model(directory, model)
    save_config(config, directory / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STDLIB / name, directory / name)
    return directory


def test_a_deepseek_v3_directory_runs_exact_at_a_quarter_and_its_first_layer_is_dense(tmp_path):
    directory = write_deepseek_v3(tmp_path / "deepseek")
    want = mlx_lm_tokens(directory, PROMPT, 10)
    result = generate(GenerateConfig(directory, PROMPT, max_tokens=10, residency=0.25))
    assert result.tokens == want
    assert (result.num_layers, result.num_experts, result.slots) == (2, 16, 4)
    assert result.prompt_reads > 0 and result.arena_mib < result.experts_mib / 3


def test_a_quantization_config_that_mlx_lm_loads_as_float_runs_as_float(tmp_path):
    """Whether a model is quantized is read from the model mlx-lm loads: fp8 checkpoints' quantization_config
    is dequantized on loading (a bfloat16 model, nothing to dequantize, stands in), so the model runs in
    float32 on MLX's CPU backend as a float model does (MLX's CPU gather_mm takes float32 only)."""
    directory = write_deepseek_v3(tmp_path / "bf16", bfloat16=True)
    want = generate(GenerateConfig(directory, PROMPT, max_tokens=3, residency=0.5))
    settings = json.loads((directory / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    (directory / "config.json").write_text(json.dumps(settings))
    got = generate(GenerateConfig(directory, PROMPT, max_tokens=3, residency=0.5))
    assert not got.quantized and got.tokens == want.tokens


def test_the_tier_and_shed_rules_run_on_a_quantized_deepseek_v3_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("KQ_CACHE_DIR", str(tmp_path / "cache"))
    directory = write_deepseek_v3(tmp_path / "deepseek-q4", quantized=True)
    tier = generate(GenerateConfig(directory, PROMPT, max_tokens=8, residency=0.25, rule="tier", tier_bits=2))
    # 2 MoE layers x 16 experts x 3 projections of 32 x 64: 2-bit words and a scale and bias a group of 32, of 16
    # bits or widened to the arena's float32 on the device
    assert tier.tier_mib * 2**20 in [2 * 16 * 3 * (32 * 64 * 2 // 8 + 2 * size * 32 * 64 // 32) for size in (2, 4)]
    shed = generate(GenerateConfig(directory, PROMPT, max_tokens=8, residency=0.25, rule="shed"))
    for run in (tier, shed):
        assert len(run.tokens) == 8 and run.hit_rate < 1.0 and all(0 <= t < 4096 for t in run.tokens)
    assert shed.tier_mib == 0 and list((tmp_path / "cache").rglob("*.npz"))


def test_the_tier_read_from_a_lower_bit_conversion_of_the_model(tmp_path):
    """--tier-model: a 2-bit conversion of the same weights serves the misses of the 4-bit model."""
    from safetensors.numpy import load_file, save_file

    directory = write_deepseek_v3(tmp_path / "q4", quantized=True, bfloat16=True)
    lower = write_deepseek_v3(tmp_path / "q2", quantized=True, bits=2, bfloat16=True)
    # a file mlx-lm does not load, holding another layer's stacked experts: not read for the tier either
    stray = load_file(str(lower / "model.safetensors"))
    save_file({name.replace("layers.1.", "layers.7."): array for name, array in stray.items() if "switch_mlp" in name},
              str(lower / "zz_stray.safetensors"))
    run = generate(GenerateConfig(directory, PROMPT, max_tokens=6, residency=0.25, rule="tier", tier_model=lower))
    assert len(run.tokens) == 6 and run.hit_rate < 1.0 and all(0 <= t < 4096 for t in run.tokens)
    # the conversion's 2-bit experts: 2 MoE layers x 16 experts x 3 projections of 32 x 64 (scales and biases of
    # 16 bits, or widened to float32 on the device)
    assert run.tier_mib * 2**20 in [2 * 16 * 3 * (32 * 64 * 2 // 8 + 2 * size * 32 * 64 // 32) for size in (2, 4)]
    with pytest.raises(GenerateError, match="--tier-model: "):
        generate(GenerateConfig(directory, PROMPT, max_tokens=2, rule="tier", tier_model=WHEELS))


def write_dense_llama(directory: Path) -> Path:
    import dataclasses

    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                           num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=4096, num_key_value_heads=2,
                           max_position_embeddings=512)
    model = llama.Model(args)
    mx.eval(model.parameters())
    directory.mkdir()
    save_model(directory, model)
    save_config(dataclasses.asdict(args), directory / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STDLIB / name, directory / name)
    return directory


def test_bad_arguments_are_refused_by_name(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text("{}")
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    shutil.copy(STDLIB / "model.safetensors", unknown / "model.safetensors")
    dense = write_dense_llama(tmp_path / "dense")
    not_an_object = tmp_path / "not-an-object"
    shutil.copytree(STDLIB, not_an_object)
    (not_an_object / "config.json").write_text("null")
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(STDLIB / name, no_tokenizer / name)
    too_wide = tmp_path / "too-wide"
    shutil.copytree(STDLIB, too_wide)
    settings = json.loads((STDLIB / "config.json").read_text())
    (too_wide / "config.json").write_text(json.dumps({**settings, "num_experts_per_tok": 80}))
    fifo = tmp_path / "fifo"
    shutil.copytree(STDLIB, fifo)
    os.mkfifo(fifo / "model-extra.safetensors")
    no_routing = {}
    for top_k in (0, -1, "2", 2.0):
        no_routing[top_k] = tmp_path / f"top-k-{top_k}"
        shutil.copytree(STDLIB, no_routing[top_k])
        (no_routing[top_k] / "config.json").write_text(json.dumps({**settings, "num_experts_per_tok": top_k}))
    mxfp4 = tmp_path / "mxfp4"
    shutil.copytree(STDLIB, mxfp4)
    settings = json.loads((STDLIB / "config.json").read_text())
    (mxfp4 / "config.json").write_text(json.dumps({**settings, "quantization_config": {"quant_method": "mxfp4"}}))
    cases = [
        (dict(model=tmp_path / "missing"), r"--model: .*missing is not a directory"),
        (dict(model=empty), r"--model: .*empty has no config.json: not an mlx-lm model directory"),
        (dict(model=tmp_path / "no-weights"), r"--model: .*no-weights holds no model\*.safetensors file"),
        (dict(model=not_an_object), r"--model: .*config.json holds NoneType, not a JSON object"),
        (dict(model=no_tokenizer), r"--model: its tokenizer has no vocabulary"),
        (dict(model=mxfp4, rule="tier"), r"--rule: tier: .*quantization_config \('mxfp4'\)"),
        (dict(model=too_wide), r"--model: .*config.json: num_experts_per_tok must be an int in \[1, 64\] \(the "
                               r"experts of a layer\), got 80"),
        *((dict(model=directory), rf"--model: .*num_experts_per_tok must be an int >= 1 .*got {top_k!r}")
          for top_k, directory in no_routing.items()),
        (dict(model=fifo), r"--model: .*model-extra.safetensors is not a regular file"),
        (dict(model=None), r"--model: must be a directory path, got None"),
        (dict(rule="tier", tier_model=123), r"--tier-model: must be a directory path, got 123"),
        (dict(prompt="abc\udcff"), r"--prompt: is not valid text \(a character UTF-8 cannot encode"),
        (dict(queue_depth=1_000_000), r"--queue-depth: must be an int in \[0, 256\]"),
        (dict(model=unknown), r"--model: mlx-lm cannot load .*unknown"),
        (dict(model=dense), r"--model: .*dense is not an MoE model"),
        (dict(residency=0.0), r"--residency: must be a fraction in \(0, 1\]"),
        (dict(residency=1.5), r"--residency: must be a fraction in \(0, 1\]"),
        (dict(max_tokens=0), "--max-tokens: must be an int >= 1"),
        (dict(prompt=""), "--prompt: must be a non-empty text"),
        (dict(rule="stall"), "--rule: must be one of exact, tier, shed"),
        (dict(tier_bits=2), "--tier-bits/--tier-group-size/--tier-model: serve the misses of --rule tier"),
        (dict(rule="tier", tier_bits=2, tier_model=WHEELS), "--tier-model: .* not both"),
        (dict(rule="tier", tier_model=tmp_path / "missing"), "--tier-model: .*missing is not a directory"),
        (dict(rule="tier", tier_model=STDLIB), r"--tier-model: .*config.json.* has no \"quantization\""),
    ]
    for change, message in cases:
        options = dict(model=STDLIB, prompt=PROMPT, max_tokens=2, residency=0.25)
        options.update(change)
        with pytest.raises(GenerateError, match=message):
            generate(GenerateConfig(**options))
    with pytest.raises(SystemExit) as exit_code:
        main(["generate", "--model", str(empty), "--prompt", "x"])
    assert exit_code.value.code == 2 and "--model: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(STDLIB), "--prompt", "x", "--max-tokens", "0"])
    assert "--max-tokens: must be at least 1" in capsys.readouterr().err
    for where in (tmp_path, tmp_path / "missing" / "figures.json", "/proc/figures.json"):  # refused before anything runs
        with pytest.raises(SystemExit) as exit_code:
            main(["generate", "--model", str(STDLIB), "--prompt", "x", "--json", str(where)])
        assert exit_code.value.code == 2 and "--json" in capsys.readouterr().err


def test_a_directory_that_cannot_be_read_is_refused_by_name(monkeypatch):
    """A directory this process may not read (``Path.is_file`` raises PermissionError there; a test run as
    root reads every directory, so the refusal is stood in for) is named, not a traceback."""
    def refused(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "is_file", refused)
    with pytest.raises(GenerateError, match=r"--model: .*stdlib-moe: unreadable \(PermissionError"):
        generate(GenerateConfig(STDLIB, PROMPT, max_tokens=2))


def test_numpy_numbers_are_options_as_python_numbers_are():
    from kq.generate import check_config

    for options in (dict(residency=np.float32(0.25)), dict(timeout=np.float32(5.0)), dict(residency=np.float64(1.0)),
                    dict(rule="tier", tier_bits=np.int64(2), tier_group_size=np.int32(32))):
        assert check_config(GenerateConfig(STDLIB, PROMPT, max_tokens=2, **options)) == STDLIB
    for options, argument in ((dict(residency=np.float32("nan")), "--residency"), (dict(timeout=np.bool_(True)), "--timeout"),
                              (dict(residency=np.array([0.5])), "--residency")):
        with pytest.raises(GenerateError, match=argument):
            check_config(GenerateConfig(STDLIB, PROMPT, max_tokens=2, **options))


@pytest.mark.parametrize("options, message", [
    ({"bits": 3}, r"--model: the experts' tensors: layer 0 expert \d+ gate_proj, read with config.json's "
                  r"\"quantization\" options: tier: a weight of 3 bits"),
    ({"bits": 8, "group_size": 32}, r"--model: the tier does not fit the model as mlx-lm loads it \(attach_tier: the "
                                    r"tier's gate_proj experts are \[64, 64\] \(out, in\), layer 0's \[64, 128\]")])
def test_a_quantization_config_the_stored_experts_disagree_with_names_the_model_under_the_tier(
        tmp_path, monkeypatch, options, message):
    monkeypatch.setenv("KQ_CACHE_DIR", str(tmp_path / "cache"))
    directory = tmp_path / "wheels"
    shutil.copytree(WHEELS, directory)
    settings = json.loads((directory / "config.json").read_text())
    settings["quantization"].update(options)
    (directory / "config.json").write_text(json.dumps(settings))
    with pytest.raises(GenerateError, match=message):
        generate(GenerateConfig(directory, PROMPT, max_tokens=2, rule="tier"))


def test_an_output_path_through_a_dangling_link_is_written_where_it_points(tmp_path):
    from kq.cli import _output_path

    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    assert _output_path(str(tmp_path / "link.json")) == tmp_path / "link.json"
    assert not (tmp_path / "target.json").exists()  # the check leaves nothing behind
    (tmp_path / "broken.json").symlink_to(tmp_path / "missing" / "target.json")
    with pytest.raises(Exception, match="cannot be written"):
        _output_path(str(tmp_path / "broken.json"))


def test_a_json_file_that_cannot_be_written_ends_the_run_with_its_name(capsys):
    assert main(["generate", "--model", str(STDLIB), "--prompt", PROMPT, "--max-tokens", "2", "--json",
                 "/dev/full"]) == 1
    captured = capsys.readouterr()
    assert "tokens/s" in captured.out  # the run's summary was printed first
    assert "kq generate: --json: cannot write /dev/full" in captured.err and "Traceback" not in captured.err


def test_max_tokens_may_be_a_numpy_int():
    from kq.generate import check_config

    assert check_config(GenerateConfig(STDLIB, PROMPT, max_tokens=np.int64(2))) == STDLIB
    with pytest.raises(GenerateError, match="--max-tokens"):
        check_config(GenerateConfig(STDLIB, PROMPT, max_tokens=np.float32(2)))


def test_a_reader_that_goes_ends_kq_generate_quietly():
    """``kq generate ... | head -c 5``: the pipe closes under the streamed text; no traceback follows."""
    run = subprocess.run(f"{sys.executable} -m kq generate --model {STDLIB} --prompt 'def f' --max-tokens 16 "
                         f"| head -c 5", shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert len(run.stdout) == 5 and "Traceback" not in run.stderr and "BrokenPipeError" not in run.stderr


def test_a_failed_read_ends_kq_generate_with_its_message_and_no_traceback(monkeypatch, capsys):
    import kq.generate
    from kq_host.residency import PreloadError

    def failing(config, on_text=None):
        raise PreloadError("acquire: layer 0: the reads of experts [3] still out after 0.5 s", [], [])

    monkeypatch.setattr(kq.generate, "generate", failing)
    assert main(["generate", "--model", str(STDLIB), "--prompt", "x", "--timeout", "0.5"]) == 1
    assert "kq generate: reading experts failed (--timeout 0.5 s): acquire: layer 0" in capsys.readouterr().err


def test_figures_of_one_token_and_a_one_token_prompt_are_json(tmp_path, capsys):
    """One token has no generation rate, and a prompt of one token reads no expert for its floor: null in the
    JSON (NaN is no JSON), said in words in the summary."""
    figures = tmp_path / "figures.json"
    assert main(["generate", "--model", str(STDLIB), "--prompt", "def", "--max-tokens", "1", "--floor",
                 "--json", str(figures)]) == 0
    result = json.loads(figures.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert result["prompt_tokens"] == 1 and result["generation_tps"] is None
    assert result["hit_rate"] is None and result["mib_read_per_token"] is None  # nothing generated after it
    assert result["read_bandwidth_gbs"] is None and result["floor_s"] == result["resident_prefill_s"] > 0
    out = capsys.readouterr().out
    assert "the first alone (no rate" in out and "nothing to read" in out and "nan" not in out


def test_only_the_files_mlx_lm_loads_hold_the_experts(tmp_path):
    """A stray safetensors file beside the model's (zeroed stacked experts of the model's names) is not read:
    mlx-lm loads model*.safetensors alone, and kq the same files."""
    from safetensors.numpy import save_file

    shutil.copytree(STDLIB, tmp_path / "model")
    settings = json.loads((STDLIB / "config.json").read_text())
    experts, hidden, ffn = settings["num_experts"], settings["hidden_size"], settings["moe_intermediate_size"]
    save_file({f"model.layers.{layer}.mlp.switch_mlp.{name}.weight": np.zeros(shape, np.float32)
               for layer in range(settings["num_hidden_layers"])
               for name, shape in (("gate_proj", (experts, ffn, hidden)), ("up_proj", (experts, ffn, hidden)),
                                   ("down_proj", (experts, hidden, ffn)))},
              str(tmp_path / "model" / "zz_stacked_experts.safetensors"))
    result = generate(GenerateConfig(tmp_path / "model", PROMPT, max_tokens=6, residency=1.0))
    assert result.tokens == mlx_lm_tokens(tmp_path / "model", PROMPT, 6)


def test_expert_tensor_names_take_the_stacked_or_the_per_expert_layout():
    from mlx_lm import load

    from kq_mlx.load import expert_tensor_names
    from kq_mlx.mlx_lm_adapter import attach_arena

    for directory, name in ((STDLIB, "model.layers.2.mlp.experts.{expert}.up_proj.weight"),
                            (WHEELS, "model.layers.2.mlp.switch_mlp.up_proj.scales")):
        model, _ = load(str(directory), lazy=True)
        names = expert_tensor_names(directory, attach_arena(model, 4, keep_experts=False))
        assert name in names[2].values()
        assert np.unique([len(keys) for keys in names.values()]).size == 1


def test_the_experts_are_never_in_memory_beyond_the_arena(tmp_path):
    """A float Qwen3-MoE of 192 MiB of experts at 25%: MLX's peak holds the other weights, the arena and the
    step's working set, never the experts."""
    import dataclasses

    from mlx_lm.models import qwen3_moe
    from mlx_lm.utils import save_config, save_model

    mx.random.seed(3)
    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=256, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
        num_experts=64, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=512,
        rms_norm_eps=1e-6, vocab_size=4096, num_key_value_heads=2, head_dim=64, rope_theta=10000.0,
        tie_word_embeddings=False, max_position_embeddings=512, norm_topk_prob=True)
    model = qwen3_moe.Model(args)
    mx.eval(model.parameters())
    save_model(tmp_path, model)
    save_config(dataclasses.asdict(args), tmp_path / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STDLIB / name, tmp_path / name)
    del model
    # In a fresh process, as a user runs it: MLX's peak counts every array the process holds, and a test
    # worker holds arrays earlier tests left (a peak 1.7 MiB over the bound in one suite run).
    figures = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, "-m", "kq", "generate", "--model", str(tmp_path), "--prompt", PROMPT,
                          "--max-tokens", "8", "--residency", "0.25", "--json", str(figures)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    result = json.loads(figures.read_text())
    assert result["experts_mib"] == 192 and result["arena_mib"] == 48
    assert result["prefill_reads"] == result["prompt_routed_pairs"] > 16
    # 64 MiB for the rest: the prompt's activations, a chunk's gathered rows, the allocator's slack
    assert result["mlx_peak_mib"] < result["arena_mib"] + result["other_weights_mib"] + 64 < result["experts_mib"]


def test_the_mlx_decode_jobs_exact_loop_feeds_the_prompt_as_its_reference_does(monkeypatch):
    """The job's exact loop is checked against the unmodified model fed the prompt a token a pass, and counts
    the prompt's misses as read on the critical path: it feeds the prompt that way too, never through prefill."""
    import kq_mlx.mlx_lm_adapter as adapter
    from kq.bench.jobs import mlx_decode

    prefilled, prefill = [], adapter.prefill
    monkeypatch.setattr(adapter, "prefill",
                        lambda *args, **kwargs: prefilled.append(args[3]) or prefill(*args, **kwargs))
    model, tokenizer = mlx_decode.load_model(STDLIB, False)
    prompt = tokenizer.encode(mlx_decode.PROMPT)
    want = mlx_decode.unmodified_fed(model, prompt, 6)
    got, stamps, counts = mlx_decode._arena_run(STDLIB, False, 0.25, "exact", prompt, 6, mlx_decode.Phases())
    assert prefilled == [] and got == want and len(stamps) == 6
    # every prompt token missed from a cold arena: the first graph pass was dropped and run again layer by
    # layer, and the tokens after it ran layer by layer while they read
    assert counts["reruns_per_token"] * 6 >= 1 and counts["layered_per_token"] * 6 >= len(prompt)
