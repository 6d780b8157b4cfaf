"""What every benchmark shares: the run header, JSON output, medians, the device's name, model sizes.

The harnesses behind ``kq bench`` (:mod:`kq.bench.kernels`, :mod:`~kq.bench.host`,
:mod:`~kq.bench.compiles`, :mod:`~kq.bench.decode_e2e`) and the maintainers' jobs
(:mod:`kq.bench.jobs`) take these from here, so a figure's hardware, versions and date are
written the same way everywhere.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

# Expert sizes of real models, (hidden, expert width), for synthetic experts: OLMoE-1B-7B's 12.6 MB
# bf16 experts and DeepSeek-V3's 88 MB ones.
EXPERT_SIZES = {"olmoe": (2048, 1024), "deepseek-v3": (7168, 2048)}


def jax_device_name() -> str:
    """JAX's first device and version, e.g. ``"gpu NVIDIA H200, jax 0.11.2"`` or ``"cpu, jax 0.10.2"``."""
    import jax

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    name = device.platform if kind.lower() == device.platform else f"{device.platform} {kind}"
    return f"{name}, jax {jax.__version__}"


def run_header(framework: str | None = "jax", **extra) -> dict:
    """Where and when a benchmark ran: date, machine, device and versions, then ``extra``.

    Args:
        framework: ``"jax"`` or ``"mlx"`` adds that framework's device and version; ``None`` neither.
        **extra: more keys (the job's options), written after the header's.
    """
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    header = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "processor": platform.processor()}
    if framework == "jax":
        import jax

        header["device"] = jax_device_name()
        versions["jax"] = jax.__version__
    elif framework == "mlx":
        import mlx.core as mx

        header["device"] = str(mx.default_device())
        versions["mlx"] = mx.__version__
    elif framework is not None:
        raise ValueError(f"run_header: framework must be 'jax', 'mlx' or None, got {framework!r}")
    return {**header, "versions": versions, **extra}


def write_json(path: str | Path, payload: dict) -> None:
    """``payload`` as indented JSON at ``path``, replaced whole (a job may call it after every row)."""
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after one warm-up call, in seconds."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def median_ms(seconds) -> float:
    """The median of a sequence of seconds, in milliseconds (0 for an empty one)."""
    return statistics.median(seconds) * 1e3 if len(seconds) else 0.0
