// route_shed for MLX's CUDA backend: the twin of route_shed.metal, handed to
// mx.fast.cuda_kernel as a header and a body (split at the marker lines).
// For indices uint32 [rows, K], scores bfloat16 and template K = 8, MLX
// generates around the body:
//
//   __global__ void custom_kernel_kq_route_shed_uint32_bfloat16_k8_8(
//       const uint32_t* indices,
//       const __grid_constant__ Shape indices_shape,
//       const __nv_bfloat16* scores,
//       const int32_t* slot_table,
//       const __grid_constant__ Shape slot_table_shape,
//       uint32_t* slots,
//       float* mix,
//       int32_t* miss_ids,
//       float* miss_scores) {
//     constexpr int K = 8;
//     <body>
//   }
//
// NVRTC contracts a*b+c into FMA by default, so every float add and the
// division are explicit round-to-nearest intrinsics (__fadd_rn, __fdiv_rn),
// each followed by the contract's flush. The multiply s * scale is NOT
// __fmul_rn: measured on an H200 through CuPy/NVRTC, __fmul_rn gave 0 for
// 2^-126 * (1 - 2^-24), which IEEE (and the contract) rounds up to 2^-126;
// kq_mul_flush (exact_f32.inc, appended to this header by kq_mlx.sources)
// computes it on integer mantissas instead. The launch rounds the grid up to
// whole blocks, hence the bounds check.

// ==== header ====
#define KQ_MIN_NORMAL 1.17549435082228750797e-38f  // 2^-126
#define KQ_CANONICAL_NAN 0x7FC00000u
#define KQ_INLINE __device__ __forceinline__
#define KQ_AS_UINT(x) __float_as_uint(x)
#define KQ_AS_FLOAT(x) __uint_as_float(x)
#define KQ_ISNAN(x) isnan(x)
#define KQ_ISINF(x) isinf(x)

__device__ __forceinline__ float kq_flush(float x) {
  return fabsf(x) < KQ_MIN_NORMAL ? 0.0f : x;
}

__device__ __forceinline__ float kq_canonical(float x) {
  return isnan(x) ? __uint_as_float(KQ_CANONICAL_NAN) : x;
}

// Ascending key = descending score, NaN after every number.
__device__ __forceinline__ int kq_order_key(float s) {
  if (isnan(s)) return 0x7F800002;
  const int bits = __float_as_int(s);
  return -(bits >= 0 ? bits : (bits ^ 0x7FFFFFFF));
}

// ==== body ====
const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x;
const long long rows = indices_shape[0];
if (row >= rows) {
  return;
}
const long long num_experts = slot_table_shape[0];
const long long base = row * K;

float s[K];
int slot[K];
bool miss[K];
float total = 0.0f;
float kept = 0.0f;
int first_slot = -1;
for (int k = 0; k < K; k++) {
  s[k] = kq_flush(static_cast<float>(scores[base + k]));
  const long long expert = static_cast<long long>(indices[base + k]);
  const bool valid = expert >= 0 && expert < num_experts;
  slot[k] = valid ? slot_table[expert] : -1;
  miss[k] = valid && slot[k] < 0;
  total = kq_flush(__fadd_rn(total, s[k]));
  if (slot[k] >= 0) {
    kept = kq_flush(__fadd_rn(kept, s[k]));
    if (first_slot < 0) first_slot = slot[k];
  }
}
const float scale = kept > 0.0f ? kq_flush(__fdiv_rn(total, kept)) : 0.0f;
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
  miss_ids[base + rank] = static_cast<int>(indices[base + k]);
  miss_scores[base + rank] = kq_canonical(s[k]);
}
for (int k = miss_count; k < K; k++) {
  miss_ids[base + k] = -1;
  miss_scores[base + k] = 0.0f;
}
