"""``kq generate`` on damaged model directories and failing disks: each ends in one line naming the argument, the
file or the tensor (a usage error, or exit 1 for the disk), never a traceback or a hang."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from kq.cli import main  # noqa: E402
from kq.generate import GenerateConfig, GenerateError, generate  # noqa: E402
from tiny_models import with_header  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STDLIB, WHEELS = ROOT / "models" / "stdlib-moe", ROOT / "models" / "wheels-moe"
WEIGHTS = "model.safetensors"
PROMPT = "def read_config(path):"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test builds its tier afresh, in a cache of its own."""
    monkeypatch.setenv("KQ_CACHE_DIR", str(tmp_path / "cache"))


def with_config(source, directory, **changes):
    """A copy of ``source`` whose config.json has ``changes``."""
    shutil.copytree(source, directory)
    settings = json.loads((directory / "config.json").read_text())
    settings.update(changes)
    (directory / "config.json").write_text(json.dumps(settings))
    return directory


def ended(capsys, argv):
    """``kq ARGV``'s exit code and the last line it wrote to stderr, checked to hold no traceback."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err.strip().splitlines()[-1]


# ---- packed words stored as another dtype ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["I32", "F32"])
@pytest.mark.parametrize("which", ["switch_mlp.up_proj", "embed_tokens"])
def test_packed_words_of_another_dtype_are_refused_by_one_header_check_under_every_rule(tmp_path, dtype, which):
    """A PyTorch-based exporter writes the packed words as int32 (or float32, the same 4 bytes): every rule
    refuses the directory before loading it, naming the file and the tensor (exact and shed had ended in a
    traceback from MLX's quantized matmul, tier in a message of its own)."""
    def relabel(header):
        for name, entry in header.items():
            if name.endswith(f"{which}.weight"):
                entry["dtype"] = dtype

    directory = with_header(WHEELS, tmp_path / "model", relabel)
    tensor = f"model.layers.0.mlp.{which}.weight" if "switch" in which else "model.embed_tokens.weight"
    want = {"I32": "int32", "F32": "float32"}[dtype]
    messages = set()
    for rule in ("exact", "shed", "tier"):
        with pytest.raises(GenerateError) as caught:
            generate(GenerateConfig(directory, PROMPT, max_tokens=2, rule=rule))
        message = str(caught.value)
        assert message.startswith("--model: ") and tensor in message and want in message, message
        assert "uint32" in message and str(directory / WEIGHTS) in message, message
        messages.add(message)
    assert len(messages) == 1, messages


# ---- a disk that fails -------------------------------------------------------------------------------------------


def _pread_failing(monkeypatch):
    """Every ``os.pread`` from now on fails as a failing disk's read does."""
    def failing(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "pread", failing)


def test_a_read_error_building_the_tier_ends_kq_generate_in_one_line(monkeypatch, capsys):
    _pread_failing(monkeypatch)  # the tier's build is the run's first read of an expert
    code, line = ended(capsys, ["generate", "--model", str(STDLIB), "--prompt", PROMPT, "--max-tokens", "2",
                                "--rule", "tier"])
    assert code == 1 and line.startswith("kq generate: reading experts failed: "), line
    for part in (str(STDLIB / WEIGHTS), "mlp.experts.0.gate_proj.weight", "expert 0 of layer 0", "Input/output error"):
        assert part in line, line


@pytest.mark.parametrize("failure", ["os-error", "changed-file"])
def test_a_failed_read_of_the_floor_ends_kq_generate_in_one_line(tmp_path, monkeypatch, capsys, failure):
    """--floor reads the prompt's experts again once the tokens are out: a read that fails there (the disk, or the
    file changed since) ends the run in one line, exit 1 (an OSError and an ExpertStoreError had escaped)."""
    import kq.generate

    directory = shutil.copytree(STDLIB, tmp_path / "model")
    measure = kq.generate._read_bandwidth

    def failing_floor(store, routed):
        if failure == "os-error":
            _pread_failing(monkeypatch)
        else:
            os.truncate(directory / WEIGHTS, 5_000_000)
        return measure(store, routed)

    monkeypatch.setattr(kq.generate, "_read_bandwidth", failing_floor)
    code, line = ended(capsys, ["generate", "--model", str(directory), "--prompt", PROMPT, "--max-tokens", "2",
                                "--floor"])
    assert code == 1 and line.startswith("kq generate: reading experts failed: --floor: "), line
    assert str(directory / WEIGHTS) in line, line
    assert ("Input/output error" if failure == "os-error" else "changed after its header was read") in line, line


# ---- a FIFO among the model's files ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json"])
def test_a_fifo_among_the_files_mlx_lm_opens_is_refused_at_once(tmp_path, name):
    """mlx-lm opens tokenizer.json and generation_config.json (and the tokenizer's other files) with a blocking
    open: a FIFO there had hung kq generate forever. kq study refuses the same directory by the same check."""
    from kq.generate import check_config
    from kq.study import StudyConfig

    directory = shutil.copytree(STDLIB, tmp_path / "model")
    (directory / name).unlink(missing_ok=True)
    os.mkfifo(directory / name)
    message = rf"{directory / name} is not a regular file \(a FIFO"
    with pytest.raises(GenerateError, match=rf"--model: {message}"):
        check_config(GenerateConfig(directory, PROMPT, max_tokens=2))
    with pytest.raises(GenerateError, match=rf"--model: {message}"):
        generate(GenerateConfig(directory, PROMPT, max_tokens=2))
    with pytest.raises(GenerateError, match=rf"--tier-model: {message}"):
        check_config(GenerateConfig(WHEELS, PROMPT, max_tokens=2, rule="tier", tier_model=directory))
    for framework in ("jax", "mlx"):
        with pytest.raises(ValueError, match=rf"--checkpoint: {message}"):
            StudyConfig(checkpoint=directory, framework=framework)


# ---- an expert holding NaN under the tier ------------------------------------------------------------------------


def test_a_nan_in_an_expert_under_the_tier_names_the_layer_expert_and_projection(tmp_path):
    """The tier quantizes every expert: one holding a NaN is the model's fault, named by layer, expert and
    projection (it had been blamed on --tier-bits/--tier-group-size, naming no tensor)."""
    directory = shutil.copytree(STDLIB, tmp_path / "model")
    raw = (directory / WEIGHTS).read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    entry = json.loads(raw[8:8 + size])["model.layers.2.mlp.experts.5.up_proj.weight"]
    assert entry["dtype"] == "BF16"
    with open(directory / WEIGHTS, "r+b") as handle:
        handle.seek(8 + size + entry["data_offsets"][0] + 2 * 7)
        handle.write(struct.pack("<H", 0x7FC0))  # bfloat16 NaN, the expert's eighth value
    with pytest.raises(GenerateError) as caught:
        generate(GenerateConfig(directory, PROMPT, max_tokens=2, rule="tier"))
    message = str(caught.value)
    assert message.startswith("--model: ") and "layer 2 expert 5 up_proj" in message, message
    assert "NaN" in message and "--tier" not in message, message


def test_a_tier_model_of_an_unsupported_mode_is_said_to_be_unsupported(tmp_path):
    """--tier-model's config.json readable, its "quantization" mode one kq does not read: said so (it had been
    called unreadable)."""
    from kq_host.checkpoint import open_experts, tier_from_checkpoint
    from kq_host.tier import TierOptionError

    settings = json.loads((WHEELS / "config.json").read_text())
    lower = with_config(WHEELS, tmp_path / "mxfp4", quantization={**settings["quantization"], "mode": "mxfp4"})
    with open_experts(WHEELS) as store, pytest.raises(TierOptionError) as caught:
        tier_from_checkpoint(lower, store, 16, 64)
    message = str(caught.value)
    assert "mode 'mxfp4' is not supported" in message and "unreadable" not in message, message
    with pytest.raises(GenerateError, match=r"--tier-model: .*mode 'mxfp4' is not supported .*affine"):
        generate(GenerateConfig(WHEELS, PROMPT, max_tokens=2, rule="tier", tier_model=lower))


# ---- config.json and the weights disagreeing ---------------------------------------------------------------------


def test_a_config_the_weights_disagree_with_is_refused_in_one_short_line(tmp_path, capsys):
    """mlx-lm lists every parameter it misses, one a line (18 KB for the 16-layer model given 4 layers more): kq
    generate names the first few and counts the rest, in one line."""
    directory = with_config(WHEELS, tmp_path / "model", num_hidden_layers=20)
    with pytest.raises(GenerateError) as caught:
        generate(GenerateConfig(directory, PROMPT, max_tokens=2))
    message = str(caught.value)
    assert "\n" not in message and len(message) < 600, message
    assert message.startswith(f"--model: mlx-lm cannot load {directory}") and "Missing" in message, message
    assert "model.layers.16." in message and " more" in message, message
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(directory), "--prompt", PROMPT])
    err = capsys.readouterr().err
    assert len(err) < 1500 and err.strip().splitlines()[-1].startswith("kq generate: error: --model: mlx-lm "), err


def test_a_shard_the_index_names_but_the_directory_lacks_is_named(tmp_path):
    """A sharded model missing a shard: model.safetensors.index.json names the shard, which kq names (mlx-lm loads
    the shards it finds and names only the parameters it then misses)."""
    from kq.study import StudyConfig

    def without_layer_3(header):
        for name in [n for n in header if n.startswith("model.layers.3.")]:
            del header[name]

    directory = with_header(STDLIB, tmp_path / "model", without_layer_3)
    raw = (STDLIB / WEIGHTS).read_bytes()
    names = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    (directory / WEIGHTS).rename(directory / first)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        name: second if name.startswith("model.layers.3.") else first for name in names if name != "__metadata__"}}))
    message = rf"--model: {directory / 'model.safetensors.index.json'} names {second}, which is not in {directory}"
    with pytest.raises(GenerateError, match=message):
        generate(GenerateConfig(directory, PROMPT, max_tokens=2))
    with pytest.raises(ValueError, match=rf"--checkpoint: .*names {second}, which is not in"):
        StudyConfig(checkpoint=directory)


# ---- lengths past the model's -------------------------------------------------------------------------------------


def test_max_tokens_past_what_an_mlx_array_can_hold_is_refused_by_name():
    from kq.generate import check_config

    for tokens in (10**23, 2**31):
        with pytest.raises(GenerateError, match=r"--max-tokens: must be an int in \[1, 2147483647\]"):
            check_config(GenerateConfig(STDLIB, PROMPT, max_tokens=tokens))
    assert check_config(GenerateConfig(STDLIB, PROMPT, max_tokens=2**31 - 1)) == STDLIB


def test_a_prompt_past_the_models_positions_is_warned_of(tmp_path):
    directory = with_config(STDLIB, tmp_path / "model", max_position_embeddings=12)
    prompt = PROMPT * 3
    with pytest.warns(UserWarning, match=r"--prompt: its \d+ tokens run past the 12 positions"):
        result = generate(GenerateConfig(directory, prompt, max_tokens=2))
    assert result.prompt_tokens > 12 and len(result.tokens) == 2


def test_a_warning_is_one_line_of_kq_generate(tmp_path):
    """In a process of its own, as a user runs it: a warning is one line ``warning: ...`` (it had been Python's
    ``path:line: UserWarning: ...`` with the source line after it)."""
    directory = with_config(STDLIB, tmp_path / "model", max_position_embeddings=12)
    run = subprocess.run([sys.executable, "-m", "kq", "generate", "--model", str(directory), "--prompt", PROMPT * 3,
                          "--max-tokens", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: --prompt: its "), run.stderr
    assert "UserWarning" not in run.stderr and "warnings.warn" not in run.stderr


# ---- the tier's default and its size -----------------------------------------------------------------------------


def test_one_default_tier_bits_for_build_tier_kq_generate_and_kq_study(tmp_path):
    import inspect

    from kq.study import StudyConfig
    from kq_host.tier import DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE, build_tier, bits_per_weight

    parameters = inspect.signature(build_tier).parameters
    assert parameters["bits"].default == DEFAULT_TIER_BITS
    assert parameters["group_size"].default == DEFAULT_TIER_GROUP_SIZE
    study = StudyConfig()
    assert (study.tier_bits, study.tier_group_size) == (DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE)
    result = generate(GenerateConfig(STDLIB, PROMPT, max_tokens=1, rule="tier"))
    assert (result.tier_bits, result.tier_group_size) == (DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE)
    # 4 layers x 64 experts x 3 projections of 64 x 128 weights, the scales and biases 16-bit or widened to float32
    weights = 4 * 64 * 3 * 64 * 128
    assert result.tier_mib * 2**20 in [weights * (DEFAULT_TIER_BITS + 2 * size * 8 / DEFAULT_TIER_GROUP_SIZE) / 8
                                       for size in (2, 4)]
    assert bits_per_weight(DEFAULT_TIER_BITS, DEFAULT_TIER_GROUP_SIZE) < 16  # smaller than the bfloat16 experts


def test_a_tier_no_smaller_than_the_experts_it_stands_in_for_is_warned_of(recwarn):
    """The 4-bit model's experts at the default 3 bits: the tier (its scales widened to the arena's float32) takes
    more memory than every expert as stored; the run goes on, warned."""
    result = generate(GenerateConfig(WHEELS, PROMPT, max_tokens=1, rule="tier"))
    assert result.tier_mib >= result.experts_mib
    (warning,) = [w for w in recwarn if "tier" in str(w.message)]
    message = str(warning.message)
    assert f"{result.tier_mib:.1f} MiB" in message and f"{result.experts_mib:.1f} MiB" in message, message
    assert "--tier-bits" in message, message
    recwarn.clear()
    generate(GenerateConfig(STDLIB, PROMPT, max_tokens=1, rule="tier"))  # bfloat16 experts: a tier far smaller
    assert not [w for w in recwarn if "tier" in str(w.message)]


def test_the_summary_names_a_tier_only_where_there_is_one():
    from kq.generate import format_summary

    exact = generate(GenerateConfig(STDLIB, PROMPT, max_tokens=1))
    assert exact.tier_bits is None and "tier" not in format_summary(exact)
    tier = generate(GenerateConfig(STDLIB, PROMPT, max_tokens=1, rule="tier", tier_bits=2, tier_group_size=64))
    assert f"tier (2-bit, groups of 64) {tier.tier_mib:.1f} MiB" in format_summary(tier)
