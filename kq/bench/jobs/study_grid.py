"""The shedding study's full grid on one checkpoint, with intervals, and perplexity against the experts' memory.

    python -m kq.bench.jobs study_grid --checkpoint models/wheels-moe --json docs/study_grid_wheels.json \
        --plot docs/study_grid_wheels.png

Every run decodes ``--streams`` windows of the held-out text side by side (``kq study --streams``),
LFU, and is compared with the resident run on the same tokens (a paired bootstrap over windows).
The rules at each residency; the tier at each of ``--tier-bits``; and the uniform baselines, every
expert resident at each of ``--uniform-bits`` and no arena. Memory is the experts' bytes: the
arena's slots in the checkpoint's format plus the tier.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kq.bench.common import run_header, write_json
from kq import study
from kq.study_runner import make_study

RULES = ("shed", "route_shed", "reroute", "prior", "stall")


def label(run: study.RunResult, bits: int) -> str:
    return f"{run.rule} {bits}-bit" if run.rule in ("tier", "uniform") else run.rule


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=study.SHIPPED_MODEL)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512, help="scored tokens per stream")
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--residency", type=float, nargs="+", default=[1.0, 0.75, 0.5, 0.25])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=[r for r in study.RULES
                                                                           if r not in ("tier", "uniform")])
    parser.add_argument("--tier-bits", type=int, nargs="+", default=[3])
    parser.add_argument("--uniform-bits", type=int, nargs="+", default=[4, 3, 2])
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    def config(bits: int) -> study.StudyConfig:
        return study.StudyConfig(checkpoint=args.checkpoint, tokens=args.tokens, warmup=args.warmup,
                                 streams=args.streams, residencies=tuple(args.residency), policies=("lfu",),
                                 tier_bits=bits, tier_group_size=args.group_size)

    started = time.perf_counter()
    runner = make_study(config(args.tier_bits[0]))
    resident = runner.resident()
    rows = []
    payload = {**run_header(), "checkpoint": str(args.checkpoint), "streams": args.streams, "tokens_per_stream": args.tokens,
               "warmup": args.warmup, "group_size": args.group_size, "resident": resident.summary(), "runs": rows}

    def record(run: study.RunResult, bits: int) -> None:
        low, high = study.paired_interval(run, resident)
        rows.append(dict(run.summary(), label=label(run, bits), tier_bits=bits if run.rule in ("tier", "uniform")
                         else None, vs_resident=run.perplexity / resident.perplexity - 1, interval_95=[low, high]))
        print(f"{run.residency:6.1%} {rows[-1]['label']:14s} ppl {run.perplexity:8.3f} "
              f"{rows[-1]['vs_resident']:+7.2%} [{low:+.2%}, {high:+.2%}] hit {rows[-1]['hit_rate']:.3f} "
              f"{rows[-1]['memory_mib']:7.2f} MiB  {run.seconds:5.1f} s", flush=True)
        payload["seconds"] = round(time.perf_counter() - started, 1)
        write_json(args.json, payload)  # after every run: a cut job keeps its rows

    for residency in args.residency:
        for rule in args.rules:
            record(runner.run(residency, "lfu", rule), 0)
    for bits in args.tier_bits:
        tiered = runner if bits == args.tier_bits[0] else make_study(config(bits))
        for residency in (r for r in args.residency if r < 1.0):
            record(tiered.run(residency, "lfu", "tier"), bits)
    for bits in args.uniform_bits:
        record(make_study(config(bits)).run(0.0, "-", "uniform"), bits)

    if args.plot:
        write_memory_plot(payload, args.plot)
    return 0


def write_memory_plot(payload: dict, path) -> None:
    """Perplexity against the experts' memory: a line per rule over the residencies, the uniform baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    resident = payload["resident"]
    runs = payload["runs"]
    for name in dict.fromkeys(r["label"] for r in runs):
        points = sorted((r["memory_mib"], r["perplexity"]) for r in runs if r["label"] == name)
        style = dict(marker="s", linestyle="none", markersize=7) if name.startswith("uniform") else dict(marker="o")
        ax.plot([m for m, _ in points], [p for _, p in points], label=name, **style)
    ax.plot([resident["memory_mib"]], [resident["perplexity"]], "k*", markersize=11, label="resident")
    ax.set(xlabel="experts' memory (MiB: arena slots + tier)", ylabel="held-out perplexity", yscale="log",
           title=f"{Path(payload['checkpoint']).name}: {payload['streams']} windows x {payload['tokens_per_stream']} "
                 f"tokens, LFU ({payload['device']}, {payload['date']})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
