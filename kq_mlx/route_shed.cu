// route_shed on MLX's CUDA backend: the header handed to mx.fast.cuda_kernel,
// for the shared row loop in route_shed_row.inc (the kernel's body).
// kq_mlx.sources puts the contract's constants before this header and
// ieee_f32.inc after it. For indices uint32 [rows, K], scores bfloat16 and
// K = 8, MLX generates around the body:
//
//   __global__ void custom_kernel_kq_route_shed_uint32_bfloat16_k8(
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
//     constexpr int S = ...;  // the arena's slot count, 2^31 - 1 for none
//     constexpr int TIER = 0;  // 1: on_miss="tier"
//     <body>
//   }
//
// NVRTC contracts a*b+c into FMA by default, so every float add and the
// division are explicit round-to-nearest intrinsics (__fadd_rn, __fdiv_rn),
// each followed by the contract's flush. The multiply s * scale is not
// __fmul_rn, which flushed a product that IEEE rounds up to 2^-126 under
// NVRTC (docs/kernels.md): kq_mul_flush (ieee_f32.inc) computes it on
// integer mantissas. The launch rounds the grid up to whole blocks, hence the
// body's bounds check.

#define KQ_INLINE __device__ __forceinline__
#define KQ_AS_UINT(x) __float_as_uint(x)
#define KQ_AS_INT(x) __float_as_int(x)
#define KQ_AS_FLOAT(x) __uint_as_float(x)
#define KQ_ISNAN(x) isnan(x)
#define KQ_ISINF(x) isinf(x)
#define KQ_FABS(x) fabsf(x)
#define KQ_ADD(a, b) __fadd_rn(a, b)
#define KQ_DIV(a, b) __fdiv_rn(a, b)
#define KQ_ROW() ((long long)blockIdx.x * blockDim.x + threadIdx.x)
typedef long long kq_index_t;
typedef long long kq_long_t;
