"""A model whose experts exceed this machine's memory, written to disk and run by ``kq generate``.

    python -m kq.bench.jobs huge_model --json docs/huge_model.json

Writes a random-weight model of a real family, DeepSeek-V3's layout (its first layer dense, 256 routed
experts of top-8 and a shared expert in every other layer, multi-head latent attention) or Qwen3-MoE's,
as an mlx-lm model directory: ``config.json`` from mlx-lm's own ``ModelArgs`` (``mlx_lm.utils.save_config``),
every weight 4-bit in mlx-community's layout (packed ``uint32`` weights, bfloat16 scales and biases,
groups of 64; the routers and norms bfloat16), one safetensors file a decoder layer written by
``mx.save_safetensors``, so writing never holds more than one layer. The tensor names and shapes are
those of the family's model built lazily and ``nn.quantize``d (nothing of it is evaluated); the values are
random words (speed does not depend on them), each file's pages dropped from the page cache once written
so the reads come from the disk. The number of MoE layers makes the experts ``--expert-gib``; the
tokenizer is the shipped model's.

Then ``kq generate`` runs on it in a process of its own, at ``--residency``, and the job records its
figures beside the bound it aims at: peak resident set at most arena + tier + other weights + 1 GiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kq.bench.common import run_header, write_json
from kq_host.checkpoint import model_files

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / "models" / "stdlib-moe"
GROUP_SIZE, BITS = 64, 4
FAMILIES = {
    # DeepSeek-V3's layout and routing (256 experts + 1 shared, top-8 of 4 of 8 groups, a dense first layer,
    # multi-head latent attention) at about half its width.
    "deepseek_v3": dict(
        model_type="deepseek_v3", vocab_size=4096, hidden_size=4096, intermediate_size=8192,
        moe_intermediate_size=1024, num_attention_heads=32, num_key_value_heads=32, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=1,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        attention_bias=False),
    # Qwen3-MoE's layout (Qwen3-30B-A3B's widths): 128 experts, top-8.
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=4096, hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
        mlp_only_layers=[], moe_intermediate_size=768, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, max_position_embeddings=4096, norm_topk_prob=True),
}


def _module(family: str):
    import importlib

    return importlib.import_module(f"mlx_lm.models.{family}")


def _dense_layers(config: dict) -> int:
    return config.get("first_k_dense_replace", 0)


def expert_bytes_per_layer(family: str) -> int:
    """Bytes of one MoE layer's routed experts, 4-bit with 16-bit scales and biases."""
    config = FAMILIES[family]
    experts = config.get("n_routed_experts") or config["num_experts"]
    weights = 3 * config["hidden_size"] * config["moe_intermediate_size"]
    return experts * weights * (BITS + 2 * 16 / GROUP_SIZE) // 8


def _lazy_model(family: str, layers: int):
    """The family's model at full size, built lazily and quantized as mlx-community ships it (nothing evaluated)."""
    import mlx.nn as nn

    module = _module(family)
    args = module.ModelArgs.from_dict({**FAMILIES[family], "num_hidden_layers": layers})
    model = module.Model(args)
    nn.quantize(model, group_size=GROUP_SIZE, bits=BITS,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % GROUP_SIZE == 0)
    return args, model


def _random_tensor(name: str, shape: tuple[int, ...], dtype, rng: np.random.Generator, group_in: dict):
    """Random values of a tensor's shape and dtype: packed words uniform, scales and biases spanning
    ``[-1/sqrt(in), 1/sqrt(in)]``, norms one, the rest normal of scale ``1/sqrt(in)``."""
    import mlx.core as mx

    count = math.prod(shape)
    if dtype == mx.uint32:
        return mx.array(np.frombuffer(rng.bytes(4 * count), np.uint32).reshape(shape))
    span = 1 / math.sqrt(group_in.get(name.rsplit(".", 1)[0], shape[-1]))
    if name.endswith(".scales"):
        values = np.full(shape, 2 * span / (2**BITS - 1), np.float32)
    elif name.endswith(".biases"):
        values = np.full(shape, -span, np.float32)
    elif "norm" in name:
        values = np.ones(shape, np.float32)
    elif "correction_bias" in name:
        values = np.zeros(shape, np.float32)
    else:
        values = rng.standard_normal(shape, np.float32) * span
    return mx.array(values).astype(mx.bfloat16)


def write_model(directory: Path, family: str, expert_gib: float, seed: int = 0) -> dict:
    """Writes the model layer by layer; returns what was written (layers, bytes, seconds)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_config

    moe_layers = max(1, math.ceil(expert_gib * 2**30 / expert_bytes_per_layer(family)))
    layers = moe_layers + _dense_layers(FAMILIES[family])
    args, model = _lazy_model(family, layers)
    shapes = {name: (tuple(array.shape), array.dtype) for name, array in tree_flatten(model.parameters())}
    del model
    # A quantized module's input width, for its scales' span: its packed words times 32 / BITS.
    group_in = {name.rsplit(".", 1)[0]: shape[-1] * 32 // BITS for name, (shape, dtype) in shapes.items()
                if name.endswith(".weight") and dtype == mx.uint32}
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        parts = name.split(".")
        key = f"layer{int(parts[2]):05d}" if parts[:2] == ["model", "layers"] else "rest"
        groups.setdefault(key, []).append(name)
    start = time.perf_counter()
    written = 0
    expert_bytes = 0
    index = {}
    for number, (key, names) in enumerate(sorted(groups.items())):
        file_name = f"model-{number + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _random_tensor(name, *shapes[name], rng, group_in) for name in names}
        mx.save_safetensors(str(directory / file_name), tensors, metadata={"format": "mlx"})
        written += sum(t.nbytes for t in tensors.values())
        expert_bytes += sum(t.nbytes for name, t in tensors.items() if ".switch_mlp." in name)
        index.update({name: file_name for name in names})
        del tensors
        descriptor = os.open(directory / file_name, os.O_RDONLY)
        try:  # once on disk, out of the page cache: the run reads the disk, not memory
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)
    config = {**dataclasses.asdict(args), "quantization": {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"}}
    save_config(config, directory / "config.json")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": written},
                                                                       "weight_map": index}, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, directory / name)
    return {"family": family, "layers": layers, "moe_layers": moe_layers, "bytes": written,
            "expert_bytes": expert_bytes, "write_s": time.perf_counter() - start}


def _memory_total_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m kq.bench.jobs huge_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="deepseek_v3")
    parser.add_argument("--expert-gib", type=float, default=24.0,
                        help="GiB of routed experts to write, 4-bit (default 24: more than this machine's memory)")
    parser.add_argument("--residency", type=float, default=0.125, help="kq generate's --residency (default 0.125)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt", default="def read_config(path):")
    parser.add_argument("--directory", type=Path, default=None,
                        help="where the model is written (default: a temporary directory, removed at the end)")
    parser.add_argument("--keep", action="store_true", help="keep the model written in --directory")
    parser.add_argument("--reuse", action="store_true",
                        help="run on the model an earlier --keep run left in --directory instead of writing one")
    parser.add_argument("--float32", action=argparse.BooleanOptionalAction, default=True,
                        help="kq generate --float32 (default on: MLX's CPU quantized matmul on bfloat16 is slow)")
    parser.add_argument("--json", type=Path, default=Path("huge_model.json"))
    args = parser.parse_args()
    if not args.expert_gib > 0:
        parser.error(f"--expert-gib: must be > 0, got {args.expert_gib}")
    if args.reuse and (args.directory is None or not (args.directory / "config.json").is_file()):
        parser.error("--reuse: needs --directory holding a model an earlier run kept (its config.json)")
    parent = args.directory.parent if args.directory is not None else Path(tempfile.gettempdir())
    need = args.expert_gib * 2**30 * 1.1 + 2**30
    free = shutil.disk_usage(parent if parent.exists() else Path.cwd()).free
    if free < need and not args.reuse:
        parser.error(f"--expert-gib {args.expert_gib}: needs about {need / 2**30:.1f} GiB of disk, {parent} has "
                     f"{free / 2**30:.1f} GiB free (give --directory elsewhere or a smaller --expert-gib)")
    directory = args.directory or Path(tempfile.mkdtemp(prefix="kq-huge-"))
    payload = run_header("mlx", **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                         memory_gib=_memory_total_gib())
    try:
        if args.reuse:
            config = json.loads((directory / "config.json").read_text())
            payload["written"] = {"reused": True, "family": config["model_type"],
                                  "layers": config["num_hidden_layers"],
                                  "bytes": sum(f.stat().st_size for f in model_files(directory))}
            for path in model_files(directory):  # out of the page cache, as when written
                descriptor = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(descriptor)
        else:
            print(f"writing a random {args.family} of {args.expert_gib} GiB of experts to {directory} ...",
                  flush=True)
            payload["written"] = write_model(directory, args.family, args.expert_gib)
        print(f"written: {payload['written']}", flush=True)
        result_path = directory / "generate.json"
        command = [sys.executable, "-m", "kq", "generate", "--model", str(directory), "--prompt", args.prompt,
                   "--max-tokens", str(args.max_tokens), "--residency", str(args.residency),
                   "--json", str(result_path)] + (["--float32"] if args.float32 else [])
        start = time.perf_counter()
        run = subprocess.run(command, text=True, capture_output=True)
        print(run.stdout, run.stderr, sep="\n", flush=True)
        if run.returncode != 0:
            payload["error"] = run.stderr[-4000:]
            write_json(args.json, payload)
            return 1
        result = json.loads(result_path.read_text())
        result["wall_s"] = time.perf_counter() - start
        result["bound_met"] = result["peak_rss_mib"] <= result["memory_bound_mib"]
        payload["generate"] = result
        write_json(args.json, payload)
        print(f"peak RSS {result['peak_rss_mib']:.0f} MiB against the bound {result['memory_bound_mib']:.0f} MiB "
              f"(experts {result['experts_mib'] / 1024:.1f} GiB, machine {payload['memory_gib']:.1f} GiB): "
              f"{'met' if result['bound_met'] else 'NOT met'}; {result['generation_tps']:.2f} tokens/s, "
              f"{result['mib_read_per_token']:.0f} MiB read a token")
    finally:
        if not args.keep and args.directory is None:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
