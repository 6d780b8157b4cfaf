"""The speed-quality frontier: ``kq bench --sets decode-e2e``'s recorded-routing rows beside the perplexity
``kq study`` measured for the same checkpoint, rule and residency.

The decode benchmark's ``lossy`` mode sheds with ``route_shed`` (the study's ``route_shed`` rule); its
``tier`` mode serves misses from the low tier (the study's ``tier`` at the same bits); its ``exact`` mode
serves every routed expert (the study's ``stall``: no perplexity cost, by construction). All at LFU, the
manager's default; each row's cost is the study's of the checkpoint whose routing the row replayed.
Prints a Markdown table and, with ``--plot``, draws tokens/s over the resident model's against the
perplexity cost, one line per mode and model.

    python -m kq.bench.jobs frontier --decode docs/h200/decode_e2e.json \
        --study docs/h200/study_grid_stdlib.json docs/h200/study_grid_wheels.json --plot docs/decode_frontier.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RULE_OF_MODE = {"lossy": "route_shed", "tier": "tier", "exact": "stall"}
MARKERS = {"lossy": "s--", "tier": "^-.", "exact": "o-"}


def study_costs(study: dict, policy: str = "lfu") -> dict[tuple[str, float, int | None], float]:
    """``{(rule, residency, tier bits): perplexity over the resident model's - 1}`` of a ``kq study --json``
    file (the rule as run at each residency, 100% included)."""
    resident = study["resident"]["perplexity"]
    return {(run["rule"], run["residency"], run.get("tier_bits")): run["perplexity"] / resident - 1.0
            for run in study["runs"] if run["policy"] == policy}


def _layers(checkpoint: str) -> int:
    with open(Path(__file__).resolve().parents[1] / "models" / checkpoint / "config.json") as f:
        return json.load(f)["num_hidden_layers"]


def frontier(decode: dict, studies: list[dict]) -> list[dict]:
    """The recorded-routing rows of a decode-e2e JSON, each with its speed over resident and its cost
    (None where no study of the row's checkpoint has its rule at its residency, or where the row replays
    only some of the checkpoint's layers)."""
    costs = {Path(study["checkpoint"]).name: study_costs(study) for study in studies}
    rows = [r for r in decode["results"] if r["routing"] == "recorded"]
    resident = {r["model"]: r["tokens_per_s"] for r in rows if r["mode"] == "resident"}
    out = []
    for r in rows:
        if r["mode"] == "resident":
            continue
        if r["mode"] == "exact" or (r["mode"] == "tier" and r["residency"] == 1.0):
            cost = 0.0  # every routed expert served at full precision: the resident model's bits (tests)
        elif r["layers"] != _layers(r["checkpoint"]):
            cost = None  # some of the checkpoint's layers only: not the study's model
        else:
            cost = costs.get(r["checkpoint"], {}).get((RULE_OF_MODE[r["mode"]], r["residency"], r.get("tier_bits")))
        out.append(dict(r, x_resident=r["tokens_per_s"] / resident[r["model"]], perplexity_cost=cost))
    return out


def markdown(rows: list[dict]) -> str:
    lines = [("| model | mode | residency | tok/s | x resident | floor x resident | hit rate | critical reads/token | "
             "runs again/token | boundary ms | MiB read/token | memory GiB | perplexity cost |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cost = "-" if r["perplexity_cost"] is None else f"{r['perplexity_cost']:+.1%}"
        floor = r["floor_tokens_per_s"] / (r["tokens_per_s"] / r["x_resident"])
        lines.append(f"| {r['model']} | {r['mode']} | {r['residency']:.0%} | {r['tokens_per_s']:.1f} | "
                     f"{r['x_resident']:.2f} | {floor:.2f} | {r['hit_rate']:.3f} | {r['critical_reads_per_token']:.2f} | "
                     f"{r['reruns_per_token']:.2f} | {r['boundary_ms']:.2f} | {r['mib_read_per_token']:.1f} | "
                     f"{r['memory_gib']:.2f} | {cost} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (model, mode) in sorted({(r["model"], r["mode"]) for r in rows}):
        points = sorted((r["perplexity_cost"] * 100, r["x_resident"], r["residency"]) for r in rows
                        if r["model"] == model and r["mode"] == mode and r["perplexity_cost"] is not None)
        if not points:
            continue
        [line] = ax.plot([p[0] for p in points], [p[1] for p in points], MARKERS[mode],
                         label=f"{model} {mode}")
        for cost, speed, residency in points:
            ax.annotate(f"{residency:.0%}", (cost, speed), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=line.get_color())
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("perplexity over the resident model's (%)")
    ax.set_ylabel("tokens/s over the resident model's")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", required=True, help="kq bench --sets decode-e2e --json output")
    parser.add_argument("--study", required=True, nargs="+", help="kq study --json outputs (LFU rows), one per checkpoint")
    parser.add_argument("--plot", help="write the frontier here (PNG)")
    args = parser.parse_args()
    with open(args.decode) as f:
        decode = json.load(f)
    studies = []
    for path in args.study:
        with open(path) as f:
            studies.append(json.load(f))
    rows = frontier(decode, studies)
    print(markdown(rows))
    if args.plot:
        device = rows[0]["device"] if rows else ""
        plot(rows, args.plot, f"decode through an arena, {device}, {decode['date']}")
    return 0
