// Maps the Metal Shading Language features route_shed.metal uses onto plain
// C++, so the exact header and body strings handed to mx.fast.metal_kernel can
// be compiled with g++ -ffp-contract=off and executed on the CPU, one call per
// row standing in for one GPU thread. Nothing here changes the arithmetic: f32
// + and / are IEEE round-to-nearest on x86-64 SSE, and the shim adds no FTZ.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#define device
#define constant
#define thread
#define kernel

typedef unsigned int uint;

struct uint3 {
  uint x, y, z;
};

template <typename To, typename From>
inline To as_type(From value) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To out;
  std::memcpy(&out, &value, sizeof(To));
  return out;
}

// bfloat16 is the top half of a float32: widening is a shift.
struct bfloat16_t {
  uint16_t bits;
  operator float() const { return as_type<float>(uint32_t(bits) << 16); }
};

typedef _Float16 float16_t;

namespace metal {
inline float fabs(float x) { return std::fabs(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
namespace precise {
// metal::precise::divide is the correctly rounded division; so is C++ `/`.
inline float divide(float a, float b) { return a / b; }
}  // namespace precise
}  // namespace metal
