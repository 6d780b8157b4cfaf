// route_shed: one thread per row, f32 arithmetic in the contract's order.
//
// This file holds the two strings handed to mx.fast.metal_kernel, split at the
// marker lines: the header (helpers, placed before the kernel) and the body.
// kq_mlx.sources reads them; the C++ harness (kq_mlx/harness) compiles the very
// same strings on the CPU. For indices uint32 [rows, K], scores bfloat16, the
// kernel MLX generates around the body reads:
//
//   template <typename IdT, typename ScoreT, int K>
//   [[kernel]] void custom_kernel_kq_route_shed_uint32_t_bfloat16_t_8(
//     const device uint32_t* indices [[buffer(0)]],
//     const constant int* indices_shape [[buffer(1)]],
//     const device bfloat16_t* scores [[buffer(2)]],
//     const device int32_t* slot_table [[buffer(3)]],
//     const constant int* slot_table_shape [[buffer(4)]],
//     device uint32_t* slots [[buffer(5)]],
//     device float* mix [[buffer(6)]],
//     device int32_t* miss_ids [[buffer(7)]],
//     device float* miss_scores [[buffer(8)]],
//     uint3 thread_position_in_grid [[thread_position_in_grid]]) { <body> }
//
// Exactness: compiled with math_mode "safe"; the division is
// metal::precise::divide (correctly rounded); the multiply s * scale is done on
// integer mantissas (kq_mul_flush, exact_f32.inc, appended to this header by
// kq_mlx.sources) so that no GPU's flush-to-zero rule can turn a product that
// IEEE rounds up to 2^-126 into 0; every sum is a sequential add followed by
// the contract's flush.

// ==== header ====
#define KQ_MIN_NORMAL 1.17549435082228750797e-38f  // 2^-126
#define KQ_CANONICAL_NAN 0x7FC00000u
#define KQ_INLINE inline
#define KQ_AS_UINT(x) as_type<uint>(x)
#define KQ_AS_FLOAT(x) as_type<float>(x)
#define KQ_ISNAN(x) metal::isnan(x)
#define KQ_ISINF(x) metal::isinf(x)

inline float kq_flush(float x) {
  return metal::fabs(x) < KQ_MIN_NORMAL ? 0.0f : x;
}

inline float kq_canonical(float x) {
  return metal::isnan(x) ? as_type<float>(KQ_CANONICAL_NAN) : x;
}

// Ascending key = descending score, NaN after every number.
inline int kq_order_key(float s) {
  if (metal::isnan(s)) return 0x7F800002;
  const int bits = as_type<int>(s);
  return -(bits >= 0 ? bits : (bits ^ 0x7FFFFFFF));
}

// ==== body ====
const uint row = thread_position_in_grid.x;
const int rows = indices_shape[0];
if (row >= uint(rows)) {
  return;
}
const long num_experts = long(slot_table_shape[0]);
const uint base = row * uint(K);

float s[K];
int slot[K];
bool miss[K];
float total = 0.0f;
float kept = 0.0f;
int first_slot = -1;
for (int k = 0; k < K; k++) {
  s[k] = kq_flush(float(scores[base + k]));
  const long expert = long(indices[base + k]);
  const bool valid = expert >= 0 && expert < num_experts;
  slot[k] = valid ? slot_table[expert] : -1;
  miss[k] = valid && slot[k] < 0;
  total = kq_flush(total + s[k]);
  if (slot[k] >= 0) {
    kept = kq_flush(kept + s[k]);
    if (first_slot < 0) first_slot = slot[k];
  }
}
const float scale = kept > 0.0f ? kq_flush(metal::precise::divide(total, kept)) : 0.0f;
const int fallback = first_slot < 0 ? 0 : first_slot;

int miss_count = 0;
for (int k = 0; k < K; k++) {
  const bool keep = slot[k] >= 0;
  slots[base + k] = keep ? slot[k] : fallback;
  mix[base + k] = keep ? kq_canonical(kq_mul_flush(s[k], scale)) : 0.0f;
  miss_count += miss[k] ? 1 : 0;
}
for (int k = 0; k < K; k++) {
  if (!miss[k]) continue;
  const int key = kq_order_key(s[k]);
  int rank = 0;
  for (int j = 0; j < K; j++) {
    const int other = kq_order_key(s[j]);
    rank += (miss[j] && (other < key || (other == key && j < k))) ? 1 : 0;
  }
  miss_ids[base + rank] = int(indices[base + k]);
  miss_scores[base + rank] = kq_canonical(s[k]);
}
for (int k = miss_count; k < K; k++) {
  miss_ids[base + k] = -1;
  miss_scores[base + k] = 0.0f;
}
