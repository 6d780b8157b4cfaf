"""Host-to-device copies of landed experts: pageable NumPy against pinned staging, JAX on a GPU.

What staging a token's landed experts in pinned (page-locked) host memory would buy the arena's
publish, measured by the paths a landed expert can take to the device, each timed to completion
(``block_until_ready``), median of ``--repeats``, for one large array and for a token's worth of
expert-sized arrays (``--experts`` arrays of ``--expert-mib``):

* ``pageable``: ``jax.device_put`` of NumPy arrays (what ``JaxArena.write_slots`` hands its scatter);
* ``to_pinned``: NumPy into JAX ``pinned_host`` arrays (a host copy: what staging adds);
* ``pinned``: ``pinned_host`` arrays to device memory (the DMA that staging would leave);
* ``locked_numpy`` (with CuPy): ``jax.device_put`` of NumPy arrays whose memory is page-locked
  (``cupyx.empty_pinned``), i.e. a loader reading straight into pinned buffers.

``python -m kq.bench.jobs h2d_staging --json out.json``
"""

from __future__ import annotations

import argparse

import numpy as np
from kq.bench.common import median_seconds, run_header, write_json


def measure(experts: int, expert_mib: float, repeats: int) -> dict:
    import jax

    device = jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    elements = int(expert_mib * 2**20 / 2)
    shapes = {"one 64 MiB array": [32 * 2**20], f"{experts} experts of {expert_mib} MiB": [elements] * experts}
    rows = []
    for label, sizes in shapes.items():
        host = [np.random.default_rng(i).standard_normal(n).astype(np.float16) for i, n in enumerate(sizes)]
        nbytes = sum(a.nbytes for a in host)
        staged = [jax.device_put(a, pinned) for a in host]
        paths = {
            "pageable": lambda: jax.block_until_ready([jax.device_put(a, on_device) for a in host]),
            "to_pinned": lambda: jax.block_until_ready([jax.device_put(a, pinned) for a in host]),
            "pinned": lambda: jax.block_until_ready([jax.device_put(a, on_device) for a in staged]),
        }
        try:
            import cupyx

            locked = []
            for a in host:
                buffer = cupyx.empty_pinned(a.shape, a.dtype)
                buffer[...] = a
                locked.append(buffer)
            paths["locked_numpy"] = lambda: jax.block_until_ready([jax.device_put(a, on_device) for a in locked])
        except ImportError:
            pass
        for path, function in paths.items():
            seconds = median_seconds(function, repeats)
            rows.append(dict(arrays=label, path=path, mib=nbytes / 2**20, ms=seconds * 1e3,
                             gib_per_s=nbytes / seconds / 2**30))
    return run_header(method=__doc__, results=rows)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m kq.bench.jobs h2d_staging", description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32, help="expert-sized arrays per token (default 32)")
    parser.add_argument("--expert-mib", type=float, default=4.5, help="MiB per array (default 4.5: an 8x64-2048 "
                        "expert's three f16 projections)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = measure(args.experts, args.expert_mib, args.repeats)
    for row in result["results"]:
        print(f"{row['arrays']:>28}  {row['path']:>12}  {row['mib']:8.1f} MiB  {row['ms']:8.2f} ms  "
              f"{row['gib_per_s']:6.1f} GiB/s")
    if args.json:
        write_json(args.json, result)
    return 0
