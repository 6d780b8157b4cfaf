"""Hypothesis strategies for route_shed inputs: raw bit patterns, not only nice numbers."""

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

SCORE_DTYPES = {"float32": (np.float32, np.uint32), "bfloat16": (ml_dtypes.bfloat16, np.uint16),
                "float16": (np.float16, np.uint16)}
EDGE_F32_BITS = [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F800000, 0xFF800000,
                 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7F7FFFFF, 0x3F800000]


@st.composite
def route_shed_inputs(draw, max_rows=24, max_k=64, max_experts=300, shapes=None):
    """(indices, scores, slot_table) with skewed residency, duplicate and stray ids, all dtypes.

    ``shapes``: ``(rows, K, E)`` triples to draw the shape from instead of the ``max_*`` ranges.
    """
    if shapes:
        rows, top_k, experts = draw(st.sampled_from(shapes))
    else:
        rows = draw(st.integers(0, max_rows))
        top_k = draw(st.integers(1, max_k))
        experts = draw(st.integers(1, max_experts))
    index_dtype = draw(st.sampled_from([np.int32, np.uint32]))
    score_name = draw(st.sampled_from(list(SCORE_DTYPES)))
    seed = draw(st.integers(0, 2**32 - 1))
    resident = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
    rng = np.random.default_rng(seed)

    table = np.where(rng.random(experts) < resident, rng.permutation(experts), -1 - rng.integers(0, 5, experts))
    ids = rng.integers(0, experts, (rows, top_k))
    stray = rng.random(ids.shape) < draw(st.sampled_from([0.0, 0.05, 0.3]))
    strays = [experts, 2**31 - 1] + ([-1, -(2**31)] if index_dtype == np.int32 else [2**31, 2**32 - 1])
    ids = np.where(stray, rng.choice(strays, ids.shape), ids)
    if draw(st.booleans()):
        ids = np.where(rng.random(ids.shape) < 0.2, np.roll(ids, 1, axis=-1), ids)

    score_type, bits_type = SCORE_DTYPES[score_name]
    style = draw(st.sampled_from(["softmax", "raw_bits", "edges", "ties"]))
    if style == "softmax":
        logits = rng.normal(0, 2, ids.shape)
        scores = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(np.float32).astype(score_type)
    elif style == "raw_bits":
        scores = rng.integers(0, np.iinfo(bits_type).max, ids.shape, dtype=np.uint64,
                              endpoint=True).astype(bits_type).view(score_type)
    elif style == "edges":
        picks = np.array(EDGE_F32_BITS, np.uint32)[rng.integers(0, len(EDGE_F32_BITS), ids.shape)]
        normal = rng.random(ids.shape).astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            scores = np.where(rng.random(ids.shape) < 0.4, picks.view(np.float32), normal).astype(score_type)
    else:
        scores = rng.choice(np.array([0.25, 0.5, 0.125], np.float32), ids.shape).astype(score_type)
    return ids.astype(index_dtype), scores, table.astype(np.int32)
