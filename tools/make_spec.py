"""Regenerates shared/spec.json from the oracle.

Run ``python tools/make_spec.py`` after a deliberate change to the contract;
tests/test_spec.py fails whenever the file and the oracle disagree.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kq_core.inputs import adversarial_inputs, router_inputs
from kq_core.oracle import route_shed_oracle
from kq_core.spec import encode_array

VERSION = "1.2.0"
CONTRACT = [
    "Inputs: indices int32|uint32 [..., K]; scores float32|bfloat16|float16 [..., K] (same shape); "
    "slot_table int32 [E] (slot_table[e] >= 0: arena slot of resident expert e; negative: not resident). "
    "1 <= K <= 64, E >= 1, any number of leading dims, zero rows allowed.",
    "Outputs, shaped like indices: slots (dtype of indices), mix float32, miss_ids int32, miss_scores float32.",
    "All arithmetic is IEEE-754 binary32, round to nearest even, in the order below; "
    "flush(x) maps every |x| < 2^-126 (subnormals and -0.0) to +0.0.",
    "1. s_k = flush(f32(scores_k)); upcasting bf16/f16 is exact.",
    "2. e_k = indices_k as signed 64-bit (uint32 ids >= 2^31 are out of range); valid_k = 0 <= e_k < E; "
    "slot_k = slot_table[e_k] if valid_k else -1; entry k is kept iff slot_k >= 0.",
    "3. total = kept = 0.0; for k = 0..K-1 ascending: total = flush(total + s_k); if kept: kept = flush(kept + s_k). "
    "No tree reduction, no reassociation, no fused multiply-add.",
    "4. scale = flush(total / kept) (correctly rounded division) if kept > 0.0, else 0.0.",
    "5. kept: slots_k = slot_k, mix_k = flush(s_k * scale); shed: slots_k = slot of the first kept entry "
    "in k order (0 if none), mix_k = +0.0.",
    "6. Misses are the entries that are shed and valid. They fill the front of miss_ids/miss_scores (e_k, s_k) "
    "in descending s_k, NaN below every number, ties by lower k; the other positions hold -1 and +0.0.",
    "7. Every NaN written to mix or miss_scores is the quiet NaN 0x7FC00000.",
    "Option num_slots = S (a case's \"options\"): in step 2 a slot_k >= S is -1 too: an entry the arena cannot "
    "hold is not resident (shed, and a miss when the id is valid).",
    "Option on_miss = \"tier\" (with num_slots = S): a miss is served by a low-precision tier holding every "
    "expert instead of being shed. Steps 3-5 become: every valid entry keeps its score, mix_k = s_k (no rescale); "
    "kept: slots_k = slot_k; a miss: slots_k = S + e_k (one index space: the arena's S slots, then the tier's E "
    "experts); an invalid entry: slots_k = slot of the first kept entry (0 if none), mix_k = +0.0. Steps 6-7 as "
    "written. S + E must be at most 2^31 - 1.",
]

F32 = np.float32


def f32_bits(bits) -> np.ndarray:
    return np.array(bits, np.uint32).view(np.float32)


def row(ids, scores, table, *, index_dtype=np.int32, score_dtype=np.float32):
    return (
        np.array(ids, dtype=np.int64).astype(index_dtype),
        np.array(scores, dtype=np.float32).astype(score_dtype),
        np.array(table, dtype=np.int32),
    )


def with_raw_row(inputs, score_bits):
    """Appends a row with the first row's ids and the given raw 16-bit score patterns."""
    ids, scores, table = inputs
    extra = np.array([score_bits], np.uint16).view(scores.dtype)
    return np.concatenate([ids, ids[:1]]), np.concatenate([scores, extra]), table


def cases():
    """Yields (name, description, (indices, scores, slot_table))."""
    rng = np.random.default_rng(20261130)
    table16 = np.array([3, -1, 0, -1, 5, 1, -1, 2, -7, 4, -1, 6, 7, -1, -2147483648, -1], np.int32)

    def gen(**kw):
        return router_inputs(rng, **kw)

    yield "decode_typical", "one decode row, K=8, E=64, about 70% resident", gen(rows=1, top_k=8, num_experts=64)
    yield "decode_uint32", "K=8, E=128, uint32 ids as mlx-lm routers produce", gen(
        rows=4, top_k=8, num_experts=128, index_dtype="uint32")
    yield "k1_kept", "K=1, resident expert", row([[2]], [[0.75]], table16)
    yield "k1_shed", "K=1, non-resident expert: scale 0, slot 0, one miss", row([[1]], [[0.75]], table16)
    yield "k6", "K=6 (not a power of two)", gen(rows=5, top_k=6, num_experts=32)
    yield "k10", "K=10 (not a power of two)", gen(rows=5, top_k=10, num_experts=40)
    yield "k64", "K=64, E=256", gen(rows=4, top_k=64, num_experts=256, resident_fraction=0.5)
    yield "e1", "E=1: id 0 is the only valid id", row(
        [[0, 1, -1], [1, 0, 0], [5, 2, 1]], [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.4, 0.4, 0.2]], [4])
    yield "e1_not_resident", "E=1 with the only expert not resident", row([[0, 1], [0, 0]], [[0.7, 0.3], [0.2, 0.8]], [-1])
    yield "all_resident", "every entry kept: total == kept, scale must be exactly 1", gen(
        rows=64, top_k=8, num_experts=64, resident_fraction=1.0, normalized=False)
    yield "none_resident", "no entry kept: slots 0, mix 0, every valid id a miss", gen(
        rows=8, top_k=8, num_experts=64, resident_fraction=0.0)
    yield "first_kept_not_first", "the first kept entry is at k > 0; shed entries take its slot", row(
        [[1, 3, 4, 6], [13, 10, 6, 12], [1, 3, 6, 9]],
        [[0.4, 0.3, 0.2, 0.1], [0.5, 0.25, 0.125, 0.125], [0.3, 0.3, 0.2, 0.2]], table16)
    yield "tied_miss_scores", "equal miss scores are ordered by lower k", row(
        [[1, 3, 6, 10, 13, 2], [3, 1, 13, 6, 10, 0]],
        [[0.2, 0.2, 0.1, 0.2, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25, 0.0, 0.0]], table16)
    special = f32_bits([
        [0x00000000, 0x80000000, 0x00000001, 0x3F000000],
        [0x007FFFFF, 0x807FFFFF, 0x3F000000, 0x3E800000],
        [0xBF000000, 0x3F800000, 0x3F400000, 0x3E800000],
        [0x7F800000, 0x3F000000, 0x3E800000, 0x3E000000],
        [0x3F000000, 0x7F800000, 0x3E800000, 0xFF800000],
        [0x7FC00000, 0x3F000000, 0xFFC00001, 0x3E800000],
        [0x3F000000, 0x7F800001, 0x3E800000, 0x7FC00000],
        [0x7F7FFFFF, 0x7F7FFFFF, 0x3F800000, 0x3F800000],
        [0xFF800000, 0x7F800000, 0x3F800000, 0x3F000000],
    ])
    special_ids = np.tile(np.array([[2, 1, 0, 3]]), (special.shape[0], 1))
    special_ids[3::2] = [[1, 2, 3, 0]]
    yield "special_scores", "zero, -0.0, subnormal, negative, inf, NaN and overflowing scores", row(
        special_ids, special, table16)
    yield "kept_mass_zero", "kept entries carry zero (or negative) mass: scale is 0", row(
        [[2, 1, 0, 3], [1, 2, 3, 0], [0, 2, 1, 4]],
        [[0.0, 0.5, 0.0, 0.5], [0.5, 0.0, 0.5, 0.0], [0.25, -0.5, 0.75, 0.0]], table16)
    yield "product_rounds_up_to_normal", (
        "s*scale lands in [2^-126 - 2^-150, 2^-126): IEEE rounds it up to 2^-126, "
        "a flush-after-24-bit-rounding unit (XLA CPU) gives 0"), row(
        [[2, 0, 1], [2, 0, 1]],
        f32_bits([[0x00800000, 0x3F800000, 0xB3800000], [0x00800002, 0x3F800000, 0xB3800000]]), table16)
    yield "ids_out_of_range_int32", "negative int32 ids and ids >= E: shed, never reported as misses", row(
        [[-1, 0, 16, 2], [-2147483648, 2147483647, 1, 7], [17, -5, 3, 1]],
        [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], table16)
    yield "ids_out_of_range_uint32", "uint32 ids >= 2^31 and >= E are out of range", row(
        [[2**31, 0, 16, 2], [2**32 - 1, 2**31 - 1, 1, 7]],
        [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]], table16, index_dtype=np.uint32)
    yield "duplicate_ids", "the same expert twice in a row counts twice", row(
        [[0, 0, 1, 1], [3, 1, 3, 1], [4, 4, 4, 4]],
        [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], table16)
    yield "scores_bfloat16", "bf16 scores, plus a row of subnormal, NaN, -inf and signed-zero bf16 values", with_raw_row(
        gen(rows=7, top_k=8, num_experts=64, score_dtype="bfloat16"),
        [0x0001, 0x8001, 0x7FC1, 0x3F00, 0x0080, 0xFF80, 0x0000, 0x8000])
    yield "scores_float16", "f16 scores; f16 subnormals are normal in f32 and are kept", with_raw_row(
        gen(rows=7, top_k=8, num_experts=64, score_dtype="float16"),
        [0x0001, 0x8001, 0x03FF, 0x7E01, 0x7C00, 0xFC00, 0x3C00, 0x0000])
    ids, sc, tab = gen(rows=6, top_k=4, num_experts=32)
    yield "leading_dims_bsk", "leading dims [B=2, S=3, K=4]", (ids.reshape(2, 3, 4), sc.reshape(2, 3, 4), tab)
    yield "zero_rows", "no rows at all: [0, 8] in, [0, 8] out", (
        np.zeros((0, 8), np.int32), np.zeros((0, 8), np.float32), tab)
    yield "adversarial_mixed", "K=8, E=64: every edge value mixed into router rows", adversarial_inputs(
        rng, 256, 8, 64, edge_fraction=0.2)
    yield "random_block", "4096 router rows, K=8, E=256, 70% resident", gen(rows=4096, top_k=8, num_experts=256)
    # num_slots: table entries the arena cannot hold (>= S) are not resident.
    bounded = np.array([0, 5, 6, 7, 100000, 2147483647, -1, 3, 1, 6, 2, -5], np.int32)
    yield "num_slots_bound", "num_slots = 6: entries 6, 7, 100000 and 2^31-1 are past the arena, shed as misses", (
        *row([[0, 1, 2, 3, 4, 5, 6, 7], [9, 2, 4, 8, 11, 5, 1, 0], [12, 3, 2, 4, 13, 9, 5, 10]],
             [[0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05], [0.25, 0.25, 0.125, 0.125, 0.125, 0.0625, 0.0625, 0.0],
              [0.4, 0.2, 0.1, 0.1, 0.1, 0.05, 0.03, 0.02]], bounded, index_dtype=np.uint32), {"num_slots": 6})
    yield "num_slots_all_out", "num_slots = 1: only slot 0 fits; a row with no entry in it keeps nothing", (
        *row([[1, 2, 3], [0, 4, 1]], [[0.5, 0.3, 0.2], [0.2, 0.6, 0.2]], [0, 3, 1, 2, 7]), {"num_slots": 1})
    ids, sc, tab = adversarial_inputs(rng, 5, 64, 256, edge_fraction=0.2)
    tab = np.where(rng.random(tab.shape) < 0.3, rng.integers(64, 2**31 - 1, tab.shape), tab).astype(np.int32)
    yield "num_slots_k64", "K=64 with table entries past num_slots = 64, adversarial rows", (
        ids, sc, tab, {"num_slots": 64})
    yield from tier_cases(rng, table16, bounded, (ids, sc, tab))


def tier_cases(rng, table16, bounded, k64_inputs):
    """Cases of on_miss = "tier": misses keep their scores and take slot num_slots + id."""
    tier = {"on_miss": "tier"}

    def gen(**kw):
        return router_inputs(rng, **kw)

    yield "tier_decode", "tier: K=8, E=64, about 70% resident in an arena of 48 slots", (
        *gen(rows=4, top_k=8, num_experts=64), {"num_slots": 48, **tier})
    yield "tier_uint32", "tier: uint32 ids, K=8, E=128, 50% resident", (
        *gen(rows=4, top_k=8, num_experts=128, index_dtype="uint32", resident_fraction=0.5),
        {"num_slots": 128, **tier})
    yield "tier_none_resident", "tier: no entry kept: every valid id a tier slot, full weight", (
        *gen(rows=4, top_k=8, num_experts=64, resident_fraction=0.0), {"num_slots": 16, **tier})
    yield "tier_special_scores", "tier: zero, subnormal, negative, inf and NaN scores keep their (flushed) value", (
        *row([[2, 1, 0, 3], [1, 2, 3, 0], [0, 1, 2, 3], [3, 1, 2, 0]],
             f32_bits([[0x80000000, 0x00000001, 0xBF000000, 0x7F800000],
                       [0x7FC00000, 0xFFC00001, 0x3F000000, 0xFF800000],
                       [0x7F7FFFFF, 0x7F7FFFFF, 0x007FFFFF, 0x3E800000],
                       [0x7F800001, 0x00800000, 0x3F800000, 0x80800000]]), table16), {"num_slots": 8, **tier})
    yield "tier_ids_out_of_range", "tier: out-of-range ids (int32 and uint32) are shed, not served", (
        *row([[-1, 0, 16, 2], [-2147483648, 2147483647, 1, 7], [17, -5, 3, 13]],
             [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], table16), {"num_slots": 8, **tier})
    yield "tier_ids_out_of_range_uint32", "tier: uint32 ids >= 2^31 and >= E are shed", (
        *row([[2**31, 1, 16, 2], [2**32 - 1, 2**31 - 1, 1, 13]],
             [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]], table16, index_dtype=np.uint32), {"num_slots": 8, **tier})
    yield "tier_num_slots_bound", "tier: table entries past num_slots = 6 are served by the tier", (
        *row([[0, 1, 2, 3, 4, 5, 6, 7], [9, 2, 4, 8, 11, 5, 1, 0]],
             [[0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05], [0.25, 0.25, 0.125, 0.125, 0.125, 0.0625, 0.0625, 0.0]],
             bounded), {"num_slots": 6, **tier})
    yield "tier_largest_slot", "tier: num_slots + E = 2^31 - 1, the largest tier slot an int32 holds", (
        *row([[0, 1, 2], [3, 2, 1]], [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]], [0, -1, 1, -1]),
        {"num_slots": 2**31 - 5, **tier})
    yield "tier_scores_bfloat16", "tier: bf16 scores, plus a row of subnormal, NaN, -inf and signed-zero values", (
        *with_raw_row(gen(rows=5, top_k=8, num_experts=64, score_dtype="bfloat16"),
                      [0x0001, 0x8001, 0x7FC1, 0x3F00, 0x0080, 0xFF80, 0x0000, 0x8000]), {"num_slots": 64, **tier})
    ids, sc, tab = k64_inputs
    yield "tier_k64", "tier: K=64, adversarial rows, table entries past num_slots = 64", (
        ids, sc, tab, {"num_slots": 64, **tier})
    ids, sc, tab = gen(rows=2, top_k=8, num_experts=32)
    yield "tier_zero_rows", "tier: no rows at all", (
        np.zeros((0, 8), np.int32), np.zeros((0, 8), np.float32), tab, {"num_slots": 32, **tier})


def build() -> dict:
    out_cases = []
    for name, description, (indices, scores, slot_table, *options) in cases():
        options = options[0] if options else {}
        expected = route_shed_oracle(indices, scores, slot_table, **options)
        case = {"name": name, "description": description}
        if options:
            case["options"] = options
        case["inputs"] = {"indices": encode_array(indices), "scores": encode_array(scores),
                          "slot_table": encode_array(slot_table)}
        case["expected"] = {k: encode_array(v) for k, v in expected._asdict().items()}
        out_cases.append(case)
    return {"name": "route_shed", "version": VERSION, "contract": CONTRACT,
            "canonical_nan": "0x7fc00000", "cases": out_cases}


def dump(spec: dict) -> str:
    """One array per line: readable diffs without a line per element."""
    lines = ["{"]
    for key in ("name", "version", "canonical_nan"):
        lines.append(f"  {json.dumps(key)}: {json.dumps(spec[key])},")
    lines.append('  "contract": [')
    lines.append(",\n".join(f"    {json.dumps(line)}" for line in spec["contract"]))
    lines.append("  ],")
    lines.append('  "cases": [')
    case_texts = []
    for case in spec["cases"]:
        parts = [f'    {{"name": {json.dumps(case["name"])}, "description": {json.dumps(case["description"])},']
        if "options" in case:
            parts.append(f'     "options": {json.dumps(case["options"])},')
        for group in ("inputs", "expected"):
            arrays = ",\n".join(f"      {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                                for k, v in case[group].items())
            parts.append(f'     "{group}": {{\n{arrays}\n     }}' + ("," if group == "inputs" else ""))
        parts.append("    }")
        case_texts.append("\n".join(parts))
    lines.append(",\n".join(case_texts))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    target = Path(__file__).resolve().parents[1] / "shared" / "spec.json"
    target.write_text(dump(build()))
    print(f"wrote {target}")
