"""Time to first token, decode speed and peak RSS: mlx-lm's own model, kq_mlx.load's, and the slot-bank baseline.

Modes, each run in a process of its own (its peak RSS is the process's VmHWM): ``mlx_lm`` (mlx-lm's model with
every expert loaded), ``kq`` (``kq_mlx.load(path, residency=r, rule="exact")``) and ``bank``
(:mod:`benchmarks.slot_bank` at the same residency), all run by ``mlx_lm.stream_generate`` on one prompt of
``--prompt-tokens`` tokens from the model's ``heldout.txt``, greedy. Each round runs every mode of every model once,
the order rotated from round to round (a load on the machine falls on all modes alike); the JSON keeps every
round's figures and each mode's min / median / max.

The floor of a mode's time to first token, per round: the prompt's distinct routed (layer, expert) pairs (those
of the prompt's passes, recorded by an untimed probe of the slot bank) read again through the mode's store after
its run (its measured bandwidth), plus that round's time to first token of mlx-lm's resident model.

    python benchmarks/load_decode.py --rounds 3 --json docs/load_decode_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("models/wheels-moe", "models/stdlib-moe")


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def prompt_ids(tokenizer, model_dir: str, count: int) -> list[int]:
    """The first ``count`` tokens of the model's held-out text (code)."""
    text = (Path(model_dir) / "heldout.txt").read_text()[: count * 16]
    ids = tokenizer.encode(text)[:count]
    if len(ids) < count:
        raise ValueError(f"--prompt-tokens: {model_dir}/heldout.txt gives {len(ids)} tokens, fewer than {count}")
    return ids


def reread_s(store, pairs) -> float:
    """Seconds to read ``pairs`` ((layer, expert)) again through ``store``'s reader threads."""
    started = time.perf_counter()
    for future in [store.submit(layer, expert) for layer, expert in pairs]:
        future.result()
    return time.perf_counter() - started


def run_child(mode: str, model_dir: str, residency: float, tokens: int, count: int, pairs) -> dict:
    """One mode's run in this process: its figures."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm import stream_generate

    started = time.perf_counter()
    figures: dict = {}
    if mode == "mlx_lm":
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear
        from mlx_lm.utils import load as mlx_lm_load

        model, tokenizer = mlx_lm_load(model_dir, lazy=True)
        if mx.default_device() == mx.cpu and not any(isinstance(m, (nn.QuantizedLinear, QuantizedSwitchLinear))
                                                     for m in model.modules()):
            model.set_dtype(mx.float32)  # MLX's CPU gather_mm takes float32 only
        mx.eval(model.parameters())
        figures["weights_bytes"] = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    elif mode == "kq":
        from kq_mlx.load import load, stream_of

        model, tokenizer = load(model_dir, residency=residency, rule="exact")
        plan = stream_of(model).plan
        figures["plan"] = {"slots": plan.slots, "arena": plan.arena, "tier": plan.tier, "other": plan.other,
                           "kv_cache": plan.kv_cache, "expert": plan.expert}
    elif mode == "bank":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from slot_bank import load_slot_bank

        model, tokenizer, bank = load_slot_bank(model_dir, residency=residency)
        banked = sum(a.nbytes for s in bank.switches for _, a in tree_flatten(s.parameters()))
        figures["bank"] = {"slots": bank.switches[0].num_slots, "bank_bytes": banked,
                           "other": sum(a.nbytes for _, a in tree_flatten(model.parameters())) - banked}
    else:
        raise ValueError(f"--child: must be mlx_lm, kq or bank, got {mode!r}")
    ids = prompt_ids(tokenizer, model_dir, count)
    loaded = time.perf_counter()
    first = last = None
    out = []
    for response in stream_generate(model, tokenizer, ids, max_tokens=tokens):
        if first is None:
            first = time.perf_counter()
        last = time.perf_counter()
        out.append(int(response.token))
    figures.update(load_s=loaded - started, ttft_s=first - loaded,
                   decode_tps=(len(out) - 1) / (last - first) if len(out) > 1 else None, tokens=out,
                   prompt_tokens=response.prompt_tokens, mlx_peak_bytes=int(mx.get_peak_memory()))
    if mode == "kq":
        stream = stream_of(model)
        stats = stream.stats()
        figures.update(reads=stats["reads"], hit_rate=stats["hit_rate"])
        store = stream.store
    elif mode == "bank":
        figures["reads"] = bank.reads
        # The prompt's passes: the prefill (many positions) and the prompt's last token's.
        routed = [set().union(*sets) for sets in zip(*bank.routed[:2])]
        figures["prompt_pairs"] = [[layer, e] for layer, experts in enumerate(routed) for e in sorted(experts)]
        store = bank.store
    if mode != "mlx_lm" and pairs:
        figures["reread_s"] = reread_s(store, pairs)
        figures["reread_bytes"] = sum(store.expert_nbytes(layer, e) for layer, e in pairs)
    figures["peak_rss_bytes"] = peak_rss_bytes()
    return figures


def spawn(mode: str, model_dir: str, residency: float, args, pairs_file: Path | None) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--model", model_dir,
               "--residency", repr(residency), "--tokens", str(args.tokens), "--prompt-tokens",
               str(args.prompt_tokens)]
    if pairs_file is not None:
        command += ["--pairs-file", str(pairs_file)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    median = statistics.median(values)
    return {"min": min(values), "median": median, "max": max(values),
            "spread": (max(values) - min(values)) / median if median else None}


def ratio(numerator: dict, denominator: dict) -> dict:
    """Median over median, with both spreads; None where the denominator's spread exceeds 10%."""
    wide = denominator["spread"] is None or denominator["spread"] > 0.10
    return {"ratio": None if wide else numerator["median"] / denominator["median"],
            "ratio_unchecked": numerator["median"] / denominator["median"],
            "numerator_spread": numerator["spread"], "denominator_spread": denominator["spread"],
            "denominator_spread_over_10pct": wide}


def summarize(rounds: list[dict], residencies) -> tuple[dict, dict]:
    """Each mode's min / median / max over ``rounds``, and the goals: ``(summary, goals)``.

    The goals, at each residency: kq's first token at most 1.5x its floor and at most the slot bank's (each
    decided only where the spreads of the medians compared stay within 10%, else None and flagged), and kq's
    peak RSS at most its arena + tier + non-expert weights + 1.05x mlx-lm's own overhead (mlx-lm's median
    peak RSS less its weights' bytes).
    """
    summary, goals = {}, {}
    for model in rounds[0]:
        names = list(rounds[0][model])
        summary[model] = {}
        for name in names:
            per = [row[model][name] for row in rounds]
            summary[model][name] = {key: spread([f.get(key) for f in per])
                                    for key in ("ttft_s", "decode_tps", "peak_rss_bytes", "floor_s",
                                                "ttft_over_floor", "reread_s", "load_s")}
            if name != "mlx_lm":
                summary[model][name]["tokens_equal_mlx_lm"] = all(f["tokens_equal_mlx_lm"] for f in per)
        s = summary[model]
        base = s["mlx_lm"]
        overhead = base["peak_rss_bytes"]["median"] - rounds[0][model]["mlx_lm"]["weights_bytes"]
        model_goals = {"mlx_lm_overhead_bytes": overhead}
        for r in residencies:
            kq, bank = s[f"kq {r:g}"], s[f"bank {r:g}"]
            plan = rounds[0][model][f"kq {r:g}"]["plan"]
            bound = plan["arena"] + plan["tier"] + plan["other"] + 1.05 * overhead
            over_floor = ratio(kq["ttft_s"], kq["floor_s"])
            over_bank = ratio(kq["ttft_s"], bank["ttft_s"])
            wide = kq["ttft_s"]["spread"] > 0.10 or over_bank["denominator_spread_over_10pct"]
            model_goals[f"{r:g}"] = {
                "ttft_over_floor": over_floor, "ttft_over_floor_per_round": kq["ttft_over_floor"],
                "ttft_at_most_1_5x_floor": None if over_floor["ratio"] is None else over_floor["ratio"] <= 1.5,
                "ttft_vs_bank": over_bank,
                "ttft_at_most_bank": None if wide else kq["ttft_s"]["median"] <= bank["ttft_s"]["median"],
                "ttft_at_most_bank_medians": kq["ttft_s"]["median"] <= bank["ttft_s"]["median"],
                "rss_bound_bytes": bound, "rss_median_bytes": kq["peak_rss_bytes"]["median"],
                "rss_max_bytes": kq["peak_rss_bytes"]["max"], "rss_within_bound": kq["peak_rss_bytes"]["max"] <= bound,
                "bank_rss_max_bytes": bank["peak_rss_bytes"]["max"],
                "decode_vs_mlx_lm": ratio(kq["decode_tps"], base["decode_tps"]),
                "decode_vs_bank": ratio(kq["decode_tps"], bank["decode_tps"]),
                "ttft_vs_mlx_lm": ratio(kq["ttft_s"], base["ttft_s"])}
        goals[model] = model_goals
    return summary, goals


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--residencies", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--merge", type=Path, nargs="*", default=[],
                        help="earlier runs' JSON (same models, modes and options): their rounds are counted first")
    parser.add_argument("--resummarize", type=Path, help="recompute the summary and goals of this JSON, run nothing")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--residency", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--pairs-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.resummarize:  # the summary and goals of a JSON written before, again (its rounds as they are)
        result = json.loads(args.resummarize.read_text())
        result["summary"], result["goals"] = summarize(result["rounds"], args.residencies)
        args.resummarize.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if args.child:
        pairs = json.loads(args.pairs_file.read_text()) if args.pairs_file else None
        figures = run_child(args.child, args.model, args.residency, args.tokens, args.prompt_tokens, pairs)
        print(json.dumps(figures))
        return 0
    if args.rounds < 1:
        parser.error("--rounds: must be at least 1")
    load_before = os.getloadavg()
    modes = [("mlx_lm", 1.0)] + [(kind, r) for kind in ("kq", "bank") for r in args.residencies]
    names = [f"{kind} {r:g}" if kind != "mlx_lm" else "mlx_lm" for kind, r in modes]
    probes, pairs_files = {}, {}
    for model in args.models:  # untimed: the prompt's routed pairs, and the files in the page cache
        probes[model] = spawn("bank", model, 1.0, args, None)
        pairs_files[model] = Path(f"/tmp/load_decode_pairs_{os.getpid()}_{Path(model).name}.json")
        pairs_files[model].write_text(json.dumps(probes[model]["prompt_pairs"]))
    rounds = []
    for index in range(args.rounds):
        row = {model: {} for model in args.models}
        order = [(model, m) for model in args.models for m in range(len(modes))]
        shift = index * 3 % len(order)
        for model, m in order[shift:] + order[:shift]:
            kind, residency = modes[m]
            figures = spawn(kind, model, residency, args, None if kind == "mlx_lm" else pairs_files[model])
            row[model][names[m]] = figures
            print(f"round {index} {Path(model).name} {names[m]}: ttft {figures['ttft_s']:.3f} s, "
                  f"decode {figures['decode_tps'] or float('nan'):.1f} tok/s, "
                  f"rss {figures['peak_rss_bytes'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        for model in args.models:
            reference = row[model]["mlx_lm"]
            for name in names[1:]:
                figures = row[model][name]
                figures["tokens_equal_mlx_lm"] = figures["tokens"] == reference["tokens"]
                figures["floor_s"] = figures["reread_s"] + reference["ttft_s"]
                figures["ttft_over_floor"] = figures["ttft_s"] / figures["floor_s"]
        rounds.append(row)
    load_after = os.getloadavg()
    earlier = [json.loads(path.read_text()) for path in args.merge]
    for prior in earlier:
        if (prior["tokens"], prior["prompt_tokens"]) != (args.tokens, args.prompt_tokens):
            parser.error(f"--merge: {prior['command']} ran other --tokens / --prompt-tokens")
    rounds = [r for prior in earlier for r in prior["rounds"]] + rounds
    args.rounds = len(rounds)
    summary, goals = summarize(rounds, args.residencies)
    import mlx.core as mx
    from importlib.metadata import version

    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": str(mx.default_device()),
              "cpu": cpu_model(), "cores": os.cpu_count(), "machine": platform.machine(),
              "python": platform.python_version(),
              "versions": {name: version(name) for name in ("mlx", "mlx-lm", "numpy")},
              "load_average_before": load_before, "load_average_after": load_after,
              "earlier_runs": [{key: prior[key] for key in ("date", "command", "load_average_before",
                                                            "load_average_after", "probe_pairs")} for prior in earlier],
              "command": "python benchmarks/load_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "tokens": args.tokens, "prompt_tokens": args.prompt_tokens, "rule": "exact",
              "probe_pairs": {m: len(p["prompt_pairs"]) for m, p in probes.items()},
              "rounds": rounds, "summary": summary, "goals": goals}
    for path in pairs_files.values():
        path.unlink()
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(json.dumps(goals, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
