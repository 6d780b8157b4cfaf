"""``kq plan``: where a memory budget goes for a model, and the speed its reads allow, before loading it.

The split (:func:`kq_mlx.load.plan`: the non-expert weights, the KV cache, the tier, the arena per layer) is
read from the model's shapes without reading a weight; the read bandwidth is measured now, reading a sample
of the experts as the arena reads them (:func:`kq_mlx.load.read_bandwidth`), twice: the second time from the
page cache. The forecast assumes uniform routing (every routed expert equally likely), which reads the most:
a trained model's routing is concentrated, so the arena hits more often than its residency.
"""

from __future__ import annotations

import json
import sys


def forecast(plan, bandwidth: dict) -> dict:
    """Reads a token and the tokens per second those reads allow (the reads alone: the floor's bound).

    Args:
        plan: a :class:`~kq_host.memory_plan.MemoryPlan`.
        bandwidth: :func:`kq_mlx.load.read_bandwidth`'s result.
    """
    misses = plan.num_layers * plan.top_k * (1 - plan.residency)
    per_token = misses * plan.expert
    bound = {name: (bandwidth[f"{name}_gbs"] * 1e9 / per_token if per_token else float("inf"))
             for name in ("first", "again")}
    return {"misses_per_token": misses, "bytes_per_token": per_token, "reads_tokens_per_s_disk": bound["first"],
            "reads_tokens_per_s_page_cache": bound["again"]}


def add_options(parser) -> None:
    """``kq plan``'s options (``func`` runs it)."""
    from kq.model_options import add_model_options

    add_model_options(parser)
    parser.add_argument("--sample", default="256MiB", help="how much of the experts to read for the bandwidth")
    parser.add_argument("--json", action="store_true", help="print the plan and forecast as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    from kq.model_options import flag_of, load_options
    from kq_host.memory_plan import MemoryPlanError, format_size, parse_size
    from kq_mlx.load import LoadError, plan, read_bandwidth

    try:
        sample = parse_size(args.sample, "--sample")
        split = plan(args.model, **load_options(args))
        bandwidth = read_bandwidth(args.model, sample_bytes=sample)
    except (LoadError, MemoryPlanError) as error:
        print(f"kq plan: {flag_of(error)}", file=sys.stderr)
        return 2
    ahead = forecast(split, bandwidth)
    if args.json:
        print(json.dumps({"plan": split.to_json(), "bandwidth": bandwidth, "forecast": ahead}, indent=1))
        return 0
    rows = [("non-expert weights", split.other), (f"KV cache ({split.context} tokens)", split.kv_cache),
            ("tier", split.tier), (f"arena ({split.slots} of {split.num_experts} experts x {split.num_layers} layers)",
                                   split.arena)]
    print(f"budget {format_size(split.budget) if split.budget else 'none (--residency)'}; "
          f"every expert {format_size(split.all_experts)}")
    for name, size in rows:
        print(f"  {name:<52} {format_size(size):>12}")
    print(f"  {'total':<52} {format_size(split.total):>12}")
    print(f"residency {split.residency:.1%}; reads measured now: {bandwidth['first_gbs']:.2f} GB/s first, "
          f"{bandwidth['again_gbs']:.2f} GB/s again (page cache), {format_size(bandwidth['bytes'])} each")
    if ahead["bytes_per_token"]:
        print(f"forecast, routing uniform: {ahead['misses_per_token']:.1f} experts read a token "
              f"({format_size(ahead['bytes_per_token'])}); the reads alone allow "
              f"{ahead['reads_tokens_per_s_disk']:.1f} tokens/s from the disk, "
              f"{ahead['reads_tokens_per_s_page_cache']:.1f} from the page cache")
    else:
        print("forecast: every expert resident, nothing to read after the first use")
    return 0
