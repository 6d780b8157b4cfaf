"""The floor a decode row can reach: the read bandwidth of the path a miss takes, and the arithmetic.

Shared by ``kq bench --sets decode-e2e`` (:mod:`kq.bench.decode_e2e`) and the MLX decode job
(:mod:`kq.bench.jobs.mlx_decode`): the floor in tokens/s is 1 / max(the resident token's time, a token's
critical bytes / the misses' path's read bandwidth).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kq_core.validate import is_int


def miss_path_gib_per_s(store, layers: int, experts: int, *, to_device=None, workers: int = 8, passes: int = 3,
                        max_bytes: int = 2**30) -> float:
    """Read bandwidth of the path a miss takes, GiB/s: experts read through ``store.read_expert`` (the
    residency manager's loader) by ``workers`` threads (its workers), each read handed to ``to_device``
    when given (on a GPU: the copy to the device, waited for), the page cache warmed by an untimed first
    pass, the median of ``passes`` timed passes.

    Args:
        store: a :class:`~kq_host.expert_store.ExpertStore` (or anything with its ``read_expert(layer,
            expert)`` returning ``{projection: array}`` and ``expert_nbytes(layer)``).
        layers, experts: the experts a pass may read, layer by layer (layer 0's experts 0, 1, ... first).
        to_device: ``payload -> None``, the payload's copy past host memory, waited for; None: host memory
            is the end of the path (a CPU, unified memory).
        workers: concurrent reads.
        passes: timed passes.
        max_bytes: a pass reads experts up to this many bytes (at least one expert).

    Raises:
        ValueError: an argument out of range, named.
    """
    from concurrent.futures import ThreadPoolExecutor

    for name, value in (("layers", layers), ("experts", experts), ("workers", workers), ("passes", passes),
                        ("max_bytes", max_bytes)):
        if not is_int(value) or value < 1:
            raise ValueError(f"miss_path_gib_per_s: {name} must be an int >= 1, got {value!r}")
    chosen, total = [], 0
    for layer in range(layers):
        nbytes = store.expert_nbytes(layer)
        for expert in range(experts):
            if chosen and total + nbytes > max_bytes:
                break
            chosen.append((layer, expert))
            total += nbytes
        else:
            continue
        break

    def read(where):
        payload = store.read_expert(*where)
        if to_device is not None:
            to_device(payload)

    seconds = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kq-bandwidth") as pool:
        for _ in range(passes + 1):  # the first pass warms the page cache
            start = time.perf_counter()
            list(pool.map(read, chosen))
            seconds.append(time.perf_counter() - start)
    return total / statistics.median(seconds[1:]) / 2**30


def floor_columns(tokens_per_s: float, resident_tokens_per_s: float, critical_mib_per_token: float,
                  read_gib_per_s: float) -> dict[str, float]:
    """The floor a row can reach and the row against it and against the resident model.

    The floor in tokens/s is 1 / max(the resident token's time, critical bytes per token / read bandwidth):
    the lower of the resident's rate and the rate at which the misses' path reads a token's critical bytes.

    Args:
        tokens_per_s: the row's measured rate.
        resident_tokens_per_s: the resident (unmodified) model's, the baseline.
        critical_mib_per_token: MiB a token must read before it can finish.
        read_gib_per_s: the misses' path's read bandwidth.

    Returns:
        ``{"x_resident", "floor_with_reads_tokens_per_s", "x_floor"}``.

    Raises:
        ValueError: a rate or the bandwidth not positive and finite, or negative critical bytes.
    """
    for name, value in (("tokens_per_s", tokens_per_s), ("resident_tokens_per_s", resident_tokens_per_s),
                        ("read_gib_per_s", read_gib_per_s)):
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"floor_columns: {name} must be positive and finite, got {value!r}")
    if not (np.isfinite(critical_mib_per_token) and critical_mib_per_token >= 0):
        raise ValueError(f"floor_columns: critical_mib_per_token must be >= 0 and finite, got {critical_mib_per_token!r}")
    reads_allow = read_gib_per_s * 1024 / critical_mib_per_token if critical_mib_per_token else float("inf")
    floor = min(resident_tokens_per_s, reads_allow)
    return {"x_resident": tokens_per_s / resident_tokens_per_s, "floor_with_reads_tokens_per_s": floor,
            "x_floor": tokens_per_s / floor}
