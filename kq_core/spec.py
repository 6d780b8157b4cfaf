"""Loads ``shared/spec.json``: the contract text and the golden vectors.

Arrays are stored as ``{"dtype", "shape", "values"}`` for integers and
``{"dtype", "shape", "bits"}`` for floats, the bits as hex strings so that
NaN payloads, signed zeros and subnormals survive JSON unchanged.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from kq_core.contract import NUMPY_DTYPES, RouteShedResult

_FLOAT_BITS = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
INPUT_NAMES = ("indices", "scores", "slot_table")
OUTPUT_NAMES = RouteShedResult._fields


@dataclass(frozen=True)
class GoldenCase:
    """One golden vector: inputs and the outputs the contract assigns them."""

    name: str
    description: str
    inputs: dict[str, np.ndarray]
    expected: RouteShedResult
    options: dict = field(default_factory=dict)  # keyword options of the op, e.g. {"num_slots": 6}

    @property
    def rows(self) -> int:
        return int(np.prod(self.inputs["indices"].shape[:-1]))


@dataclass(frozen=True)
class Spec:
    version: str
    contract: tuple[str, ...]
    cases: tuple[GoldenCase, ...]

    def case(self, name: str) -> GoldenCase:
        for case in self.cases:
            if case.name == name:
                return case
        raise KeyError(f"no golden case named {name!r}")


def encode_array(array: np.ndarray) -> dict:
    """Encodes an array losslessly for spec.json."""
    name = np.dtype(array.dtype).name
    out = {"dtype": name, "shape": list(array.shape)}
    if name in _FLOAT_BITS:
        width = 2 * np.dtype(_FLOAT_BITS[name]).itemsize
        out["bits"] = [f"0x{b:0{width}x}" for b in array.reshape(-1).view(_FLOAT_BITS[name]).tolist()]
    else:
        out["values"] = array.reshape(-1).tolist()
    return out


def decode_array(obj: dict) -> np.ndarray:
    """Inverse of :func:`encode_array`."""
    name = obj["dtype"]
    shape = tuple(obj["shape"])
    if name in _FLOAT_BITS:
        bits = np.array([int(b, 16) for b in obj["bits"]], dtype=_FLOAT_BITS[name])
        return bits.view(NUMPY_DTYPES[name]).reshape(shape)
    return np.array(obj["values"], dtype=NUMPY_DTYPES[name]).reshape(shape)


def default_spec_path() -> Path:
    """The spec shipped with the package (a link to the repo's shared/spec.json)."""
    return Path(str(resources.files("kq_core") / "spec.json"))


@functools.lru_cache(maxsize=4)
def load_spec(path: str | Path | None = None) -> Spec:
    """Reads and decodes the spec; cached per path."""
    raw = json.loads(Path(path or default_spec_path()).read_text())
    cases = tuple(
        GoldenCase(
            name=c["name"],
            description=c["description"],
            inputs={k: decode_array(c["inputs"][k]) for k in INPUT_NAMES},
            expected=RouteShedResult(*(decode_array(c["expected"][k]) for k in OUTPUT_NAMES)),
            options=c.get("options", {}),
        )
        for c in raw["cases"]
    )
    return Spec(version=raw["version"], contract=tuple(raw["contract"]), cases=cases)
