// route_shed on Metal: the header handed to mx.fast.metal_kernel, for the
// shared row loop in route_shed_row.inc (the kernel's body). kq_mlx.sources
// puts the contract's constants before this header and ieee_f32.inc after
// it; the C++ harness (kq_mlx/harness) compiles the very same strings on the
// CPU. For indices uint32 [rows, K], scores bfloat16, MLX generates around
// the body:
//
//   template <typename IdT, typename ScoreT, int K, int S, int TIER>
//   [[kernel]] void custom_kernel_kq_route_shed_uint32_bfloat16_k8(
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
// integer mantissas (kq_mul_flush, ieee_f32.inc) so that no GPU's
// flush-to-zero rule can turn a product that IEEE rounds up to 2^-126 into 0;
// every sum is a sequential add followed by the contract's flush.

#define KQ_INLINE inline
#define KQ_AS_UINT(x) as_type<uint>(x)
#define KQ_AS_INT(x) as_type<int>(x)
#define KQ_AS_FLOAT(x) as_type<float>(x)
#define KQ_ISNAN(x) metal::isnan(x)
#define KQ_ISINF(x) metal::isinf(x)
#define KQ_FABS(x) metal::fabs(x)
#define KQ_ADD(a, b) ((a) + (b))
#define KQ_DIV(a, b) metal::precise::divide(a, b)
// One thread per row; rows and offsets fit 32 bits on Metal's grids.
#define KQ_ROW() (thread_position_in_grid.x)
typedef uint kq_index_t;
typedef long kq_long_t;
