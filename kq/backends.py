"""Every implementation of ``route_shed`` that can run on this machine, behind one interface.

``kq check``, ``kq bench`` and the test suite iterate over :func:`all_backends`.
A backend imports its framework only when it is probed, so ``kq`` works with
NumPy alone, with only JAX, or with only MLX installed.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kq_core.contract import RouteShedResult
from kq_core.oracle import route_shed_oracle
from kq_core.validate import check_route_shed_args

# runner(indices, scores, slot_table, num_slots=None, on_miss="shed") -> RouteShedResult of NumPy arrays
Runner = Callable[..., RouteShedResult]


@dataclass(frozen=True)
class Backend:
    """One implementation.

    Attributes:
        name: short id used in test ids and on the command line.
        probe: returns ``(runner, device description)``, or raises
            :class:`Unavailable` with the reason it cannot run here.
        interpreted: runs the kernel through an interpreter that traces and compiles every new
            shape slowly; ``kq check`` gives it fewer random shapes unless ``--thorough``.
    """

    name: str
    probe: Callable[[], tuple[Runner, str]]
    interpreted: bool = False


class Unavailable(RuntimeError):
    """The backend cannot run on this machine; the message says why."""


def _require(module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as why:
        raise Unavailable(f"{module} cannot be imported ({why})") from why


def _numpy_probe():
    return route_shed_oracle, "cpu"


def _as_numpy(result) -> RouteShedResult:
    return RouteShedResult(*(np.asarray(x) for x in result))


def _jax_device() -> str:
    import jax

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    name = device.platform if kind.lower() == device.platform else f"{device.platform} {kind}"
    return f"{name}, jax {jax.__version__}"


def _jax_probe(impl: str, *, needs_gpu: bool):
    def probe():
        _require("jax")
        import jax

        import kq_jax

        if needs_gpu and jax.default_backend() != "gpu":
            raise Unavailable(f"needs a CUDA GPU; jax's default backend is {jax.default_backend()}")
        if impl == "pallas_interpret" and jax.default_backend() == "gpu":
            raise Unavailable("the interpreter runs on the CPU backend; on a GPU jax-pallas is checked")
        fn = jax.jit(functools.partial(kq_jax.route_shed, impl=impl), static_argnames=("num_slots", "on_miss"))

        def run(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            # NumPy inputs are checked before jit canonicalises their dtypes (int64 to int32).
            check_route_shed_args(indices, scores, slot_table, num_slots, on_miss)
            return _as_numpy(fn(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss))

        return run, _jax_device()

    return probe


def _mlx_probe(*, compiled: bool, on_gpu: bool = False):
    def probe():
        _require("mlx")
        import mlx.core as mx

        from kq_mlx.route_shed_mlx import route_shed_ops

        device = mx.gpu if on_gpu else mx.cpu
        if on_gpu and not mx.is_available(mx.gpu):
            raise Unavailable("needs MLX with a GPU")

        def run(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            with mx.stream(device):
                return _as_numpy(route_shed_ops(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss,
                                                compiled=compiled))

        return run, f"{'gpu' if on_gpu else 'cpu'}, mlx {mx.__version__}"

    return probe


def _mlx_gpu_probe(kind: str):
    def probe():
        _require("mlx")
        import mlx.core as mx

        from kq_mlx.route_shed_mlx import implementation_for, route_shed

        if implementation_for(mx.gpu) != kind:
            raise Unavailable(f"needs MLX with a {kind} GPU")

        def run(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            return _as_numpy(route_shed(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss,
                                        stream=mx.gpu))

        return run, f"gpu ({kind}), mlx {mx.__version__}"

    return probe


def _metal_cpu_probe():
    from kq_mlx.metal_cpu import CompilerUnavailable, compiler, route_shed_metal_cpu

    try:
        return route_shed_metal_cpu, f"cpu via {compiler()} (route_shed.metal)"
    except CompilerUnavailable as why:
        raise Unavailable(str(why)) from why


def _cuda_source_probe():
    _require("cupy")
    import cupy

    from kq_mlx.cuda_cupy import route_shed_cuda_cupy

    try:
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except cupy.cuda.runtime.CUDARuntimeError as why:
        raise Unavailable(f"no CUDA device: {why}") from why
    return route_shed_cuda_cupy, f"{name} via CuPy/NVRTC (route_shed.cu)"


BACKENDS: tuple[Backend, ...] = (
    Backend("numpy-oracle", _numpy_probe),
    Backend("jax-reference", _jax_probe("reference", needs_gpu=False)),
    Backend("jax-pallas-interpret", _jax_probe("pallas_interpret", needs_gpu=False), interpreted=True),
    Backend("jax-pallas", _jax_probe("pallas", needs_gpu=True)),
    Backend("mlx-ops", _mlx_probe(compiled=True)),
    Backend("mlx-ops-eager", _mlx_probe(compiled=False)),
    Backend("mlx-ops-gpu", _mlx_probe(compiled=True, on_gpu=True)),
    Backend("metal-source-cpu", _metal_cpu_probe),
    Backend("mlx-metal", _mlx_gpu_probe("metal")),
    Backend("mlx-cuda", _mlx_gpu_probe("cuda")),
    Backend("cuda-source-cupy", _cuda_source_probe),
)


def all_backends() -> tuple[Backend, ...]:
    return BACKENDS


def backend(name: str) -> Backend:
    for candidate in BACKENDS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"unknown backend {name!r}; known: {', '.join(b.name for b in BACKENDS)}")
