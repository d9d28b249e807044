// Decode attention for XLA:CPU: one new token per row written into that row's contiguous key and value cache, then
// its query over the cache, as an XLA FFI custom call (built on first use by jaxrl_llm/engine/cpu_kernel.py).
//
//   q         [B, H, hd]      float32 (the activations), rounded to bfloat16 first when the cache is bfloat16
//   k_new     [B, KVH, hd]    the token's key, as the cache stores it; written at k[b, :, :, position[b]]
//   v_new     [B, KVH, hd]    its value; written at v[b, :, position[b], :]
//   position  [B]             int32; a negative position writes nothing (an idle slot)
//   k         [B, KVH, hd, C] bfloat16 bits (uint16) or float32: the decode loop's key layout (updated in place)
//   v         [B, KVH, C, hd] the same dtype as k (updated in place)
//   allowed   [B, C]          bool: the keys each row's query may read (the new one included)
//   out       [B, H, hd]      float32; the k and v outputs alias the k and v inputs
//
//   out[b, h] = sum_s p[b, h, s] v[b, h / G, s],   p = softmax_s(softcap(scale * q[b, h] . k[b, h / G, :, s]))
//
// over the allowed `s` only (G = H / KVH query heads share a KV head). Under a bfloat16 cache the probabilities are
// rounded to bfloat16 before the second contraction, as `jaxrl_llm.models.precision` does for the XLA path's dots;
// both contractions accumulate in float32. A row with no allowed key gets zeros.
//
// Why a kernel: XLA:CPU runs this as one [G x hd] x [hd x C] dot per row and KV head at ~13 GFLOP/s, 7.6x the time
// it takes to read the cache once, and its one-token scatter into the cache at ~36 ns an element (bench/README.md,
// decode_phases.py). Here each (row, KV head) is one task that writes its token and streams its keys and values once, vectorised along the cache (keys) and along hd (values); the tasks are spread
// over XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float Bf16ToF32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to the nearest bfloat16, ties to even (what XLA's convert does); NaN stays NaN.
inline float RoundToBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

template <typename T>
inline void ToFloat(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(dst + i, &u, sizeof(float));
    }
  }
}

// exp(x) for x <= 0 in plain arithmetic (so the loop vectorises): x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial for exp(r) (relative error ~2e-7), 2^n from the exponent bits. Below -87 it returns 0.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Shape {
  int64_t rows, heads, kv_heads, head_dim, context;
};

// 16 float32 lanes (GCC/Clang vector extensions: one AVX-512 register, two AVX2 ones).
typedef float F32x16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
constexpr int kLanes = 16;

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

// The first `lanes` (< 16) values, zeros after.
template <typename T>
inline F32x16 LoadPartial(const T* src, int64_t lanes) {
  T tmp[kLanes] = {};
  std::memcpy(tmp, src, lanes * sizeof(T));
  return Load16(tmp);
}

// `x` as the policy rounds an operand next to a `T` cache: to bfloat16 beside bfloat16 bits, else as it is.
template <typename T>
inline float Rounded(float x) {
  return std::is_same_v<T, float> ? x : RoundToBf16(x);
}

// The mask's span [first, last] for a row, or first > last when it allows nothing.
inline void Span(const bool* mask, int64_t c, int64_t* first, int64_t* last) {
  *first = 0, *last = c - 1;
  while (*first < c && !mask[*first]) ++*first;
  while (*last >= *first && !mask[*last]) --*last;
}

typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef uint8_t U8x16 __attribute__((vector_size(16)));

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

// ExpNonPositive on 16 lanes (n rounded to nearest by the 1.5 * 2^23 trick, exact for |n| < 2^22).
inline F32x16 Exp16(F32x16 x) {
  x = Max16(x, Splat(-87.0f));
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
  return p * scale;
}

// RoundToBf16 on 16 lanes (finite values: probabilities).
inline F32x16 RoundToBf16x16(F32x16 x) {
  U32x16 u;
  std::memcpy(&u, &x, sizeof(u));
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// Lanes i0 .. i0 + 15 of the mask (false past n) as all-ones / zero lanes.
inline I32x16 MaskLanes(const bool* mask, int64_t i0, int64_t n) {
  uint8_t bytes[kLanes] = {};
  std::memcpy(bytes, mask + i0, std::min<int64_t>(kLanes, n - i0));
  U8x16 packed;
  std::memcpy(&packed, bytes, sizeof(packed));
  return __builtin_convertvector(packed, I32x16) != 0;
}

// scores [G, n16] (n16 = n rounded up to 16; lanes past n are ignored) -> probabilities in place: scale, soft cap,
// the mask, softmax, rounded as `T`'s policy asks; disallowed and padding lanes get 0.
template <typename T>
void Softmax(float* scores, const bool* mask, int64_t g_count, int64_t n, float scale, float softcap) {
  const int64_t n16 = (n + kLanes - 1) / kLanes * kLanes;
  const F32x16 neg_inf = Splat(-INFINITY);
  for (int64_t g = 0; g < g_count; ++g) {
    float* sg = scores + g * n16;
    if (softcap > 0.0f) {
      for (int64_t i = 0; i < n; ++i) sg[i] = softcap * std::tanh(sg[i] * scale / softcap);
    }
    const float pre = softcap > 0.0f ? 1.0f : scale;
    F32x16 peak = neg_inf;
    for (int64_t i0 = 0; i0 < n16; i0 += kLanes) {
      F32x16 x;
      std::memcpy(&x, sg + i0, sizeof(x));
      x = MaskLanes(mask, i0, n) ? x * pre : neg_inf;
      std::memcpy(sg + i0, &x, sizeof(x));
      peak = Max16(peak, x);
    }
    const float top = HorizontalMax(peak);
    F32x16 total{};
    for (int64_t i0 = 0; i0 < n16; i0 += kLanes) {
      F32x16 x;
      std::memcpy(&x, sg + i0, sizeof(x));
      const F32x16 e = MaskLanes(mask, i0, n) ? Exp16(x - top) : F32x16{};
      std::memcpy(sg + i0, &e, sizeof(e));
      total += e;
    }
    const float inv = 1.0f / HorizontalSum(total);
    for (int64_t i0 = 0; i0 < n16; i0 += kLanes) {
      F32x16 x;
      std::memcpy(&x, sg + i0, sizeof(x));
      x *= inv;
      if constexpr (!std::is_same_v<T, float>) x = RoundToBf16x16(x);
      std::memcpy(sg + i0, &x, sizeof(x));
    }
  }
}

// One (row, KV head) with G query heads and hd = 16 * HC, the accumulators in registers: scores 16 keys at a
// time (G vectors), the output's G x HC vectors over every key.
template <typename T, int G, int HC>
void AttendBlocked(const float* q_rows, const T* keys, const T* values, const bool* mask, float* out_rows,
                   int64_t c, int64_t first, int64_t n, float scale, float softcap, std::vector<float>& scratch) {
  constexpr int64_t hd = HC * kLanes;
  const int64_t n16 = (n + kLanes - 1) / kLanes * kLanes;
  scratch.resize(G * hd + G * n16);
  float* qs = scratch.data();
  float* scores = qs + G * hd;
  for (int64_t i = 0; i < G * hd; ++i) qs[i] = Rounded<T>(q_rows[i]);
  const T* k0 = keys + first;
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const int64_t lanes = std::min<int64_t>(kLanes, n - i0);
    F32x16 acc[G] = {};
    for (int64_t d = 0; d < hd; ++d) {
      const F32x16 kv = lanes == kLanes ? Load16(k0 + d * c + i0) : LoadPartial(k0 + d * c + i0, lanes);
      for (int g = 0; g < G; ++g) acc[g] += qs[g * hd + d] * kv;
    }
    for (int g = 0; g < G; ++g) std::memcpy(scores + g * n16 + i0, &acc[g], sizeof(acc[g]));
  }
  Softmax<T>(scores, mask + first, G, n, scale, softcap);
  F32x16 out[G][HC] = {};
  const T* v0 = values + first * hd;
  for (int64_t i = 0; i < n; ++i) {
    if (!mask[first + i]) continue;
    F32x16 row[HC];
    for (int h = 0; h < HC; ++h) row[h] = Load16(v0 + i * hd + h * kLanes);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * n16 + i];
      for (int h = 0; h < HC; ++h) out[g][h] += p * row[h];
    }
  }
  for (int g = 0; g < G; ++g) std::memcpy(out_rows + g * hd, out[g], hd * sizeof(float));
}

// Any G and hd: the same arithmetic in plain loops.
template <typename T>
void AttendGeneric(const float* q_rows, const T* keys, const T* values, const bool* mask, float* out_rows,
                   int64_t g_count, int64_t hd, int64_t c, int64_t first, int64_t n, float scale, float softcap,
                   std::vector<float>& scratch) {
  const int64_t n16 = (n + kLanes - 1) / kLanes * kLanes;
  scratch.resize(g_count * hd + g_count * n16 + std::max(n, hd));
  float* qs = scratch.data();
  float* scores = qs + g_count * hd;
  float* row_buf = scores + g_count * n16;
  for (int64_t i = 0; i < g_count * hd; ++i) qs[i] = Rounded<T>(q_rows[i]);
  std::fill(scores, scores + g_count * n16, 0.0f);
  for (int64_t d = 0; d < hd; ++d) {
    ToFloat(keys + d * c + first, row_buf, n);
    for (int64_t g = 0; g < g_count; ++g) {
      const float qd = qs[g * hd + d];
      float* sg = scores + g * n16;
      for (int64_t i = 0; i < n; ++i) sg[i] += qd * row_buf[i];
    }
  }
  Softmax<T>(scores, mask + first, g_count, n, scale, softcap);
  std::fill(out_rows, out_rows + g_count * hd, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    if (!mask[first + i]) continue;
    ToFloat(values + (first + i) * hd, row_buf, hd);
    for (int64_t g = 0; g < g_count; ++g) {
      const float p = scores[g * n16 + i];
      float* o = out_rows + g * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] += p * row_buf[d];
    }
  }
}

template <typename T, int G>
bool DispatchHeadDim(const float* q_rows, const T* keys, const T* values, const bool* mask, float* out_rows,
                     int64_t hd, int64_t c, int64_t first, int64_t n, float scale, float softcap,
                     std::vector<float>& scratch) {
  switch (hd) {
    case 32: AttendBlocked<T, G, 2>(q_rows, keys, values, mask, out_rows, c, first, n, scale, softcap, scratch); return true;
    case 64: AttendBlocked<T, G, 4>(q_rows, keys, values, mask, out_rows, c, first, n, scale, softcap, scratch); return true;
    case 128: AttendBlocked<T, G, 8>(q_rows, keys, values, mask, out_rows, c, first, n, scale, softcap, scratch); return true;
    default: return false;
  }
}

// One (row, KV head): its G query heads against the row's keys and values.
template <typename T>
void AttendOne(const float* q, const T* k, const T* v, const bool* allowed, float* out, const Shape& s,
               float scale, float softcap, int64_t row, int64_t kv_head, std::vector<float>& scratch) {
  const int64_t g_count = s.heads / s.kv_heads, hd = s.head_dim, c = s.context;
  const bool* mask = allowed + row * c;
  float* out_rows = out + (row * s.heads + kv_head * g_count) * hd;
  int64_t first, last;
  Span(mask, c, &first, &last);
  if (first > last) {
    std::fill(out_rows, out_rows + g_count * hd, 0.0f);
    return;
  }
  const int64_t n = last - first + 1;
  const float* q_rows = q + (row * s.heads + kv_head * g_count) * hd;
  const T* keys = k + (row * s.kv_heads + kv_head) * hd * c;
  const T* values = v + (row * s.kv_heads + kv_head) * c * hd;
  bool done = false;
  switch (g_count) {
#define JAXRL_G(G) \
    case G: done = DispatchHeadDim<T, G>(q_rows, keys, values, mask, out_rows, hd, c, first, n, scale, softcap, scratch); break;
    JAXRL_G(1) JAXRL_G(2) JAXRL_G(3) JAXRL_G(4) JAXRL_G(5) JAXRL_G(6) JAXRL_G(7) JAXRL_G(8)
#undef JAXRL_G
    default: break;
  }
  if (!done) {
    AttendGeneric(q_rows, keys, values, mask, out_rows, g_count, hd, c, first, n, scale, softcap, scratch);
  }
}

// The (row, KV head) tasks handed out one at a time from a shared counter: the calling thread and up to
// `threads - 1` pool tasks take them until none is left; the call returns once every task taken has finished. A
// pool task that starts late finds no work (it holds the state through its shared_ptr), so a busy pool never
// blocks the call.
template <typename T>
struct Work {
  const float* q;
  const T* k_new;
  const T* v_new;
  const int32_t* position;
  T* k;
  T* v;
  const bool* allowed;
  float* out;
  Shape shape;
  float scale, softcap;
  int64_t tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    std::vector<float> scratch;
    int64_t finished = 0;
    const int64_t hd = shape.head_dim, c = shape.context;
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      const int64_t row = t / shape.kv_heads, at = position[row];
      if (at >= 0 && at < c) {  // t = row * KVH + kv_head indexes the [B, KVH] caches and new tokens alike
        for (int64_t d = 0; d < hd; ++d) k[(t * hd + d) * c + at] = k_new[t * hd + d];
        std::memcpy(v + (t * c + at) * hd, v_new + t * hd, hd * sizeof(T));
      }
      AttendOne<T>(q, k, v, allowed, out, shape, scale, softcap, row, t % shape.kv_heads, scratch);
      ++finished;
    }
    done.fetch_add(finished);
  }
};

template <typename T>
void Run(ffi::ThreadPool pool, const float* q, const void* k_new, const void* v_new, const int32_t* position,
         void* k, void* v, const bool* allowed, float* out, const Shape& shape, float scale, float softcap) {
  auto work = std::make_shared<Work<T>>();
  work->q = q, work->allowed = allowed, work->out = out, work->position = position;
  work->k_new = static_cast<const T*>(k_new), work->v_new = static_cast<const T*>(v_new);
  work->k = static_cast<T*>(k), work->v = static_cast<T*>(v);
  work->shape = shape, work->scale = scale, work->softcap = softcap;
  work->tasks = shape.rows * shape.kv_heads;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load() < work->tasks) std::this_thread::yield();
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_new,
                               ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> position, ffi::AnyBuffer k_in,
                               ffi::AnyBuffer v_in, ffi::Buffer<ffi::PRED> allowed,
                               ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::AnyBuffer> k,
                               ffi::Result<ffi::AnyBuffer> v, float scale, float softcap) {
  const auto qd = q.dimensions(), kd = k->dimensions(), vd = v->dimensions(), ad = allowed.dimensions();
  const auto knd = k_new.dimensions(), vnd = v_new.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || ad.size() != 2 || knd.size() != 3 ||
      vnd.size() != 3 || position.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("decode_attention: q [B, H, hd], k_new and v_new [B, KVH, hd], position "
                                       "[B], k [B, KVH, hd, C], v [B, KVH, C, hd], allowed [B, C]");
  }
  const Shape shape{qd[0], qd[1], kd[1], qd[2], kd[3]};
  const bool shapes_agree =
      kd[0] == shape.rows && kd[2] == shape.head_dim && vd[0] == shape.rows && vd[1] == shape.kv_heads &&
      vd[2] == shape.context && vd[3] == shape.head_dim && ad[0] == shape.rows && ad[1] == shape.context &&
      position.dimensions()[0] == shape.rows && shape.heads % shape.kv_heads == 0;
  for (const auto& nd : {knd, vnd}) {
    if (!shapes_agree || nd[0] != shape.rows || nd[1] != shape.kv_heads || nd[2] != shape.head_dim) {
      return ffi::Error::InvalidArgument("decode_attention: mismatched shapes of q, k_new, v_new, position, k, v "
                                         "and allowed");
    }
  }
  const auto type = k->element_type();
  if (v->element_type() != type || k_new.element_type() != type || v_new.element_type() != type) {
    return ffi::Error::InvalidArgument("decode_attention: k, v, k_new and v_new must share a dtype");
  }
  // k and v alias k_in and v_in (input_output_aliases), so the caches are updated where they lie.
  const bool* mask = allowed.typed_data();
  if (type == ffi::U16 || type == ffi::BF16) {
    Run<uint16_t>(pool, q.typed_data(), k_new.untyped_data(), v_new.untyped_data(), position.typed_data(),
                  k->untyped_data(), v->untyped_data(), mask, out->typed_data(), shape, scale, softcap);
  } else if (type == ffi::F32) {
    Run<float>(pool, q.typed_data(), k_new.untyped_data(), v_new.untyped_data(), position.typed_data(),
               k->untyped_data(), v->untyped_data(), mask, out->typed_data(), shape, scale, softcap);
  } else {
    return ffi::Error::InvalidArgument("decode_attention: the caches must be bfloat16 bits (uint16) or float32");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));
