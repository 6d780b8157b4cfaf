"""Benchmarks and GPU jobs of kq, run from the repository root as ``python -m benchmarks JOB [ARGS]``.

Jobs: ``sweep_route_shed`` and ``sweep_topk`` (the Pallas kernels' launch
parameters, bits checked, kernel time), ``launches`` (kernel launches for
compute-sanitizer and Nsight Compute), ``moe_overhead`` (the JAX MoE layer on
an arena against the resident layer). ``benchmarks/gpu_job.sh`` runs the GPU test suite,
``kq check``, memcheck and these on a CUDA machine in one call. ``kq bench``
is the user-facing benchmark; these are the maintainers'.
"""


def jax_run_header() -> dict:
    """Where and when a JAX job ran: the date, JAX's first device, and the versions."""
    import platform
    import time

    import jax
    import numpy as np

    return {"date": time.strftime("%Y-%m-%d"), "device": str(jax.devices()[0].device_kind),
            "machine": platform.platform(),
            "versions": {"python": platform.python_version(), "jax": jax.__version__, "numpy": np.__version__}}
