"""Input generators shared by the golden spec, the tests, ``kq check`` and ``kq bench``.

Two flavours:

* ``router_inputs``: what a real MoE router produces (distinct top-k ids drawn
  with Zipf-like expert popularity, softmax-like scores) against a slot table
  with a chosen resident fraction.
* ``adversarial_inputs``: the same, with a fraction of entries replaced by the
  values the contract has rules for (zero, -0.0, subnormal, negative, inf,
  NaN with odd payloads, out-of-range and duplicate ids).

``random_cases`` mixes both over shapes and every index and score dtype: the random rows of
``kq check`` and ``kq.spec.random_cases``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

import numpy as np

from kq_core.contract import NUMPY_DTYPES
from kq_core.validate import is_int

_SPECIAL_SCORE_BITS = np.array(
    [
        0x00000000,  # +0
        0x80000000,  # -0
        0x00000001,  # smallest subnormal
        0x007FFFFF,  # largest subnormal
        0x807FFFFF,  # negative subnormal
        0x00800000,  # smallest normal
        0x3F800000,  # 1.0
        0xBF800000,  # -1.0
        0x7F800000,  # +inf
        0xFF800000,  # -inf
        0x7FC00000,  # canonical NaN
        0xFFC00001,  # negative NaN with payload
        0x7F800001,  # signalling NaN
        0x7F7FFFFF,  # largest finite
        0x33800000,  # 2**-24: tiny normal
    ],
    dtype=np.uint32,
)


def _own_errstate(generate):
    """``generate`` run under an error state of its own, every floating-point flag ignored: the generators make
    overflows, underflows and NaNs on purpose, so a state set by the caller (``np.seterr(under="raise")`` in a test
    suite's conftest, say) neither stops them nor warns; the bits are the same under any state. Each public
    generator has it (the private helpers run inside them)."""

    @functools.wraps(generate)
    def generate_ignoring_flags(*args, **kwargs):
        with np.errstate(all="ignore"):
            return generate(*args, **kwargs)

    return generate_ignoring_flags


@_own_errstate
def slot_table(rng: np.random.Generator, num_experts: int, resident_fraction: float) -> np.ndarray:
    """A valid ``int32 [E]`` table: a random subset resident, in distinct slots."""
    resident = rng.random(num_experts) < resident_fraction
    table = np.full(num_experts, -1, np.int32)
    count = int(resident.sum())
    table[resident] = rng.permutation(count).astype(np.int32)
    negative = ~resident & (rng.random(num_experts) < 0.25)
    # Any negative value means "not resident", not only -1.
    table[negative] = rng.integers(np.iinfo(np.int32).min, -1, negative.sum(), dtype=np.int32)
    return table


@_own_errstate
def expert_popularity(rng: np.random.Generator, num_experts: int, skew: float = 1.1) -> np.ndarray:
    """Zipf-like probabilities over experts, in a random order of experts."""
    weights = 1.0 / np.arange(1, num_experts + 1) ** skew
    return rng.permutation(weights / weights.sum())


def _expert_bias(rng: np.random.Generator, num_experts: int) -> np.ndarray:
    """Integer Zipf-like log-popularity per expert, in a random order of experts.

    ``-0.2 * log2(rank)`` in units of ``2**16``, with log2 piecewise linear between powers of two
    (integers only, so every platform computes the same bias).
    """
    rank = np.arange(1, num_experts + 1, dtype=np.int64)
    octave = np.array([int(r).bit_length() - 1 for r in rank], np.int64)
    log2_rank = (octave << 16) + ((rank << 16) >> octave) - (1 << 16)
    return rng.permutation(-log2_rank // 5)


def _binary32(rng: np.random.Generator, shape, low_exponent: int, high_exponent: int) -> np.ndarray:
    """Positive float32 values ``m * 2**e`` (24-bit ``m`` in [0.5, 1), integer ``e`` in [low, high)), exactly."""
    mantissas = rng.integers(1 << 23, 1 << 24, shape).astype(np.float32)
    return np.ldexp(mantissas, rng.integers(low_exponent, high_exponent, shape) - 24).astype(np.float32)


@_own_errstate
def router_inputs(
    rng: np.random.Generator,
    rows: int,
    top_k: int,
    num_experts: int,
    *,
    resident_fraction: float = 0.7,
    index_dtype: str = "int32",
    score_dtype: str = "float32",
    normalized: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Realistic router output: distinct ids per row (when ``top_k <= E``), softmax-like scores.

    Built from integers and correctly rounded arithmetic only (no ``exp``, ``log`` or ``pow``,
    whose last bit differs across NumPy builds and CPUs), so a seed gives the same bits everywhere.

    Returns:
        ``(indices [rows, top_k], scores [rows, top_k], slot_table [E])``.
    """
    if top_k <= num_experts:
        # Gumbel-like top-k in integers: a popularity bias plus triangular noise; the expert id
        # in the low digits makes every key distinct, so the order has no ties to break.
        noise = rng.integers(0, 1 << 16, (rows, num_experts)) + rng.integers(0, 1 << 16, (rows, num_experts))
        keys = (noise + _expert_bias(rng, num_experts)[None, :]) * num_experts + np.arange(num_experts)
        ids = np.empty((rows, top_k), np.int64)
        every_row = np.arange(rows)
        for k in range(top_k):
            ids[:, k] = keys.argmax(axis=1)
            keys[every_row, ids[:, k]] = np.iinfo(np.int64).min
    else:
        ids = rng.integers(0, num_experts, (rows, top_k))
    scores = _binary32(rng, (rows, top_k), -8, 1)
    if normalized:
        total = np.zeros(rows, np.float32)
        for k in range(top_k):  # one rounding per addition, in k order
            total = total + scores[:, k]
        scores = scores / total[:, None]
    scores = np.sort(scores, axis=1)[:, ::-1]
    return (
        ids.astype(NUMPY_DTYPES[index_dtype]),
        scores.astype(NUMPY_DTYPES[score_dtype]),
        slot_table(rng, num_experts, resident_fraction),
    )


@_own_errstate
def adversarial_inputs(
    rng: np.random.Generator,
    rows: int,
    top_k: int,
    num_experts: int,
    *,
    edge_fraction: float = 0.15,
    resident_fraction: float = 0.6,
    index_dtype: str = "int32",
    score_dtype: str = "float32",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Router output with a fraction of entries replaced by contract edge cases."""
    ids, scores, table = router_inputs(
        rng, rows, top_k, num_experts, resident_fraction=resident_fraction,
        index_dtype="int32", score_dtype="float32", normalized=rng.random() < 0.5,
    )
    ids = ids.astype(np.int64)
    shape = ids.shape
    special = rng.random(shape) < edge_fraction
    picks = _SPECIAL_SCORE_BITS[rng.integers(0, len(_SPECIAL_SCORE_BITS), shape)]
    scores = np.where(special, picks.view(np.float32), scores)
    wide = rng.random(shape) < edge_fraction / 2
    magnitudes = _binary32(rng, shape, -40, 41) * rng.choice(np.array([-1, 1], np.float32), shape)
    scores = np.where(wide, magnitudes, scores)

    bad_id = rng.random(shape) < edge_fraction / 2
    if index_dtype == "uint32":
        strays = rng.choice([num_experts, num_experts + 7, 2**31, 2**32 - 1], shape)
    else:
        strays = rng.choice([num_experts, num_experts + 7, -1, -(2**31), 2**31 - 1], shape)
    ids = np.where(bad_id, strays, ids)
    duplicate = rng.random(shape) < edge_fraction / 2
    ids = np.where(duplicate, np.roll(ids, 1, axis=-1), ids)
    scores = scores.astype(NUMPY_DTYPES[score_dtype])  # huge scores become f16 inf, NaN stays NaN: intended
    return ids.astype(NUMPY_DTYPES[index_dtype]), scores, table


# (rows weight, K, E): single-row decode cases stay one row; the others share the row budget by weight.
RANDOM_SHAPES = ((1, 8, 256), (8, 6, 40), (4, 10, 64), (1, 64, 512), (16, 2, 8), (2, 1, 4))
# Every (index dtype, score dtype) pair the contract takes.
DTYPE_PAIRS = tuple(itertools.product(("int32", "uint32"), ("float32", "bfloat16", "float16")))


@_own_errstate
def split_rows(total: int, weights) -> list[int]:
    """``total`` split in proportion to ``weights``, exactly (largest remainders get the leftover rows)."""
    weights = np.asarray(weights, np.float64)
    quotas = total * weights / weights.sum()
    rows = np.floor(quotas).astype(int)
    leftover = total - int(rows.sum())
    rows[np.argsort(-(quotas - rows), kind="stable")[:leftover]] += 1
    return rows.tolist()


def _count(name: str, value) -> int:
    """``value`` as an int >= 0, or a ValueError naming ``name``."""
    if not is_int(value) or value < 0:
        raise ValueError(f"random_cases: {name} must be an int >= 0, got {value!r}")
    return int(value)


def random_cases(seed: int, rows: int, *, every_dtype: bool = True
                 ) -> Iterator[tuple[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Exactly ``rows`` random rows over shapes, dtypes and edge mixes, the same bits for a seed everywhere.

    Each (shape, index dtype, score dtype) gets a router-like and an adversarial case; the row budget
    is split between them by the shapes' weights (:data:`RANDOM_SHAPES`), and a case given no row is
    left out. With ``every_dtype=False`` each shape takes one dtype pair, the pairs taken in turn (a
    twelfth of the shapes to compile).

    Args:
        seed: an int >= 0.
        rows: the rows of all the cases together, an int >= 0.
        every_dtype: every shape over every pair of :data:`DTYPE_PAIRS`, or one pair a shape.

    Yields:
        ``(name, (indices [rows_i, K], scores [rows_i, K], slot_table int32 [E]))``, the name
        ``{router|edges}-{rows_i}x{K}-E{E}-{index dtype}-{score dtype}``.

    Raises:
        ValueError: ``seed`` or ``rows`` is not an int >= 0 (the message names it), on the call.
    """
    seed, rows = _count("seed", seed), _count("rows", rows)
    return _mixed_cases(np.random.default_rng(seed), rows, every_dtype)


def _mixed_cases(rng: np.random.Generator, rows_budget: int, every_dtype: bool):
    pairs = [(shape, *pair) for shape, pair in itertools.product(RANDOM_SHAPES, DTYPE_PAIRS)] if every_dtype else [
        (shape, *DTYPE_PAIRS[i % len(DTYPE_PAIRS)]) for i, shape in enumerate(RANDOM_SHAPES)]
    combos = [(shape, index_dtype, score_dtype, generator) for shape, index_dtype, score_dtype in pairs
              for generator in (router_inputs, adversarial_inputs)]
    for ((_, top_k, experts), index_dtype, score_dtype, generator), rows in zip(
            combos, split_rows(rows_budget, [shape[0] for shape, *_ in combos])):
        if rows:
            kind = "router" if generator is router_inputs else "edges"
            yield f"{kind}-{rows}x{top_k}-E{experts}-{index_dtype}-{score_dtype}", generator(
                rng, rows, top_k, experts, index_dtype=index_dtype, score_dtype=score_dtype)
