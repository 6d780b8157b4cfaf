"""Bit-for-bit comparison of ``route_shed`` outputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kq_core.contract import NUMPY_DTYPES, RouteShedResult, TopkRouteShedResult


@dataclass(frozen=True)
class Mismatch:
    """The first difference between two results."""

    output: str
    index: tuple[int, ...] | None
    expected: str
    got: str

    def __str__(self) -> str:
        where = "" if self.index is None else str(list(self.index))
        return f"{self.output}{where}: expected {self.expected}, got {self.got}"


# The unsigned integer of each float width, to read a float's bits.
_BITS_OF_WIDTH = {4: np.uint32, 2: np.uint16, 1: np.uint8}


def _show(array: np.ndarray, index) -> str:
    """One entry as plain Python: a float as its bits in hex and its value (``0x3f000000 (0.5)``), else an int."""
    if array.dtype.kind == "f" or array.dtype == np.dtype(NUMPY_DTYPES["bfloat16"]):
        width = array.dtype.itemsize
        bits = int(array.view(_BITS_OF_WIDTH[width])[index])
        return f"0x{bits:0{2 * width}x} ({float(array[index])!r})"
    return repr(int(array[index]))


def first_mismatch(expected: RouteShedResult | TopkRouteShedResult, got, prefix: str = "") -> Mismatch | None:
    """Compares dtype, shape and every bit of each output; None when identical.

    ``expected`` is an oracle result (a plain 4-tuple is read as a
    ``RouteShedResult``); a nested result (``TopkRouteShedResult.shed``) is
    compared field by field, its outputs named ``shed.mix`` and so on.
    """
    for name, want, have in zip(getattr(expected, "_fields", RouteShedResult._fields), expected, got):
        if hasattr(want, "_fields"):
            mismatch = first_mismatch(want, have, f"{prefix}{name}.")
            if mismatch is not None:
                return mismatch
            continue
        have = np.asarray(have)
        if have.dtype != want.dtype or have.shape != want.shape:
            return Mismatch(prefix + name, None, f"{want.dtype}{list(want.shape)}", f"{have.dtype}{list(have.shape)}")
        width = _BITS_OF_WIDTH[want.dtype.itemsize]
        differs = want.view(width) != have.view(width)
        if differs.any():
            index = tuple(int(i) for i in np.argwhere(differs)[0])
            return Mismatch(prefix + name, index, _show(want, index), _show(have, index))
    return None
