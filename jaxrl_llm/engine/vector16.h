// 16-lane float32 arithmetic shared by the engine's CPU kernels (decode_attention.cc, inverse_cdf.cc,
// packed_matmul.cc): GCC/Clang vector extensions, one AVX-512 register (two AVX2 ones), an exponential for x <= 0,
// and bfloat16 rounding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

typedef float F32x16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));
constexpr int kLanes = 16;

// 16 float32 values, or 16 bfloat16 bits (uint16) widened to float32 (exactly).
template <typename T>
inline F32x16 Load16(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    F32x16 x;
    std::memcpy(&x, src, sizeof(x));
    return x;
  } else {
    U16x16 bits;
    std::memcpy(&bits, src, sizeof(bits));
    const U32x16 wide = __builtin_convertvector(bits, U32x16) << 16;
    F32x16 x;
    std::memcpy(&x, &wide, sizeof(x));
    return x;
  }
}

// float32 to bfloat16 bits, rounded to nearest even (a NaN kept a quiet NaN), as XLA's convert: one value, 16 lanes.
inline uint16_t Bf16Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (x != x) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline void StoreBf16(uint16_t* dst, F32x16 x) {
  U32x16 bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const U32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const auto nan = x != x;
  const U32x16 quiet = (bits >> 16) | 0x40u;
  const U16x16 out = __builtin_convertvector(nan ? quiet : rounded, U16x16);
  std::memcpy(dst, &out, sizeof(out));
}

inline F32x16 Splat(float x) { return F32x16{} + x; }

inline F32x16 Max16(F32x16 a, F32x16 b) { return a > b ? a : b; }

inline float HorizontalMax(F32x16 x) {
  float lanes[kLanes];
  std::memcpy(lanes, &x, sizeof(lanes));
  return *std::max_element(lanes, lanes + kLanes);
}

inline float HorizontalSum(F32x16 x) {
  float lanes[kLanes], total = 0.0f;
  std::memcpy(lanes, &x, sizeof(lanes));
  for (float lane : lanes) total += lane;
  return total;
}

// exp(x) for x <= 0 on 16 lanes in plain arithmetic: x = n ln2 + r, |r| <= ln2 / 2 (n rounded to nearest by the
// 1.5 * 2^23 trick), a degree-6 polynomial for exp(r) (relative error ~2e-7), 2^n from the exponent bits; 0 below -87
// (exp(-87) ~ 1.6e-38), so -inf gives 0 as under XLA's exp.
inline F32x16 Exp16(F32x16 x) {
  const auto tiny = x < Splat(-87.0f);
  x = tiny ? Splat(-87.0f) : x;
  const F32x16 magic = Splat(12582912.0f);
  const F32x16 n = (x * 1.44269504088896341f + magic) - magic;
  const F32x16 r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  F32x16 p = Splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I32x16 bits = (__builtin_convertvector(n, I32x16) + 127) << 23;
  F32x16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? Splat(0.0f) : p * scale;
}
