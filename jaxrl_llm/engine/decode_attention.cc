// Paged decode attention for XLA:CPU: one query per row over that row's keys and values in the engine's page pool,
// as an XLA FFI custom call (built on first use by jaxrl_llm/engine/cpu_kernel.py).
//
//   q           [S, H, hd]            float32 (the activations), rounded to bfloat16 first under a bfloat16 pool
//   k, v        [KVH, N, page_size, hd] the pool as stored: bfloat16 bits (uint16) or float32
//   page_table  [S, M]                int32: position p of row r lives in page page_table[r, p / page_size]
//   lengths     [S]                   int32: row r reads positions max(0, length - window) .. length - 1
//   out         [S, H, hd]            float32 (zeros for a row of length 0)
//   attributes  window (0: none), scale, softcap (0: none)
//
//   out[r, h] = sum_p softmax_p(softcap(scale * q[r, h] . k[h / G, p])) v[h / G, p]
//
// (G = H / KVH query heads share a KV head). Under a bfloat16 pool the probabilities are rounded to bfloat16 before
// the second contraction, as `jaxrl_llm.models.precision` rounds the XLA path's dot operands; both contractions
// accumulate in float32.
//
// Why a kernel: XLA:CPU has no paged attention. Its path gathers every slot's pages into contiguous caches once per
// decode call and runs the contraction as one [G x hd] x [hd x C] dot per row and KV head at ~13 GFLOP/s, 7.6x the
// time it takes to read the cache once (bench/README.md, decode_phases.py). Here each (row, KV head) is one task
// that streams its pages once; the G samples of a GRPO group read their prompt's shared pages, which the tasks of
// neighbouring rows find in cache. Tasks are spread over XLA's intra-op thread pool. At the RL shape the kernel is
// bound by memory: it prefetches across page boundaries (`Prefetcher`), and on CPUs with AVX512-BF16 a bfloat16
// pool's products run on VDPBF16PS (`PagedBf16`) instead of being widened to float32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "task_pool.h"
#include "vector16.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

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

// `x` as the policy rounds an operand next to a `T` cache: to bfloat16 beside bfloat16 bits, else as it is.
template <typename T>
inline float Rounded(float x) {
  return std::is_same_v<T, float> ? x : RoundToBf16(x);
}

// RoundToBf16 on 16 lanes (finite values: probabilities).
inline F32x16 RoundToBf16x16(F32x16 x) {
  U32x16 u;
  std::memcpy(&u, &x, sizeof(u));
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// scores [G, stride] (stride >= n rounded up to 16; lanes past n are ignored) -> probabilities in place: scale, soft
// cap, softmax over the first n, rounded as `T`'s policy asks; lanes n .. n rounded up to 16 get 0.
template <typename T>
void Softmax(float* scores, int64_t g_count, int64_t n, int64_t stride, float scale, float softcap) {
  const int64_t n16 = (n + kLanes - 1) / kLanes * kLanes;
  const F32x16 neg_inf = Splat(-INFINITY);
  const I32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t g = 0; g < g_count; ++g) {
    float* sg = scores + g * stride;
    if (softcap > 0.0f) {
      for (int64_t i = 0; i < n; ++i) sg[i] = softcap * std::tanh(sg[i] * scale / softcap);
    }
    const float pre = softcap > 0.0f ? 1.0f : scale;
    F32x16 peak = neg_inf;
    for (int64_t i0 = 0; i0 < n16; i0 += kLanes) {
      F32x16 x;
      std::memcpy(&x, sg + i0, sizeof(x));
      x = lane + static_cast<int32_t>(i0) < static_cast<int32_t>(n) ? x * pre : neg_inf;
      std::memcpy(sg + i0, &x, sizeof(x));
      peak = Max16(peak, x);
    }
    const float top = HorizontalMax(peak);
    F32x16 total{};
    for (int64_t i0 = 0; i0 < n16; i0 += kLanes) {
      F32x16 x;
      std::memcpy(&x, sg + i0, sizeof(x));
      const F32x16 e = lane + static_cast<int32_t>(i0) < static_cast<int32_t>(n) ? Exp16(x - top) : F32x16{};
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

// Each level's two lane selections of the pair (x, y) (lanes 16-31 are y's), summed. `__builtin_shufflevector`, which
// GCC (12 and later) and clang both have, takes its lane indices as constants: spelled out per level.
#define JAXRL_FOLD(x, y, A, B) (__builtin_shufflevector(x, y, A) + __builtin_shufflevector(x, y, B))
#define JAXRL_A1 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define JAXRL_B1 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define JAXRL_A2 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define JAXRL_B2 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define JAXRL_A3 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define JAXRL_B3 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define JAXRL_A4 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define JAXRL_B4 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31

// v[16] -> one vector whose lane j is the sum of v[bitrev4(j)]'s lanes: a transpose-and-add tree (4 levels of two
// shuffles and an add), so 16 dot products cost one reduction. Callers store dot product l at v[bitrev4(l)].
inline F32x16 Reduce16(const F32x16* v) {
  F32x16 l1[8], l2[4], l3[2];
  for (int k = 0; k < 8; ++k) l1[k] = JAXRL_FOLD(v[2 * k], v[2 * k + 1], JAXRL_A1, JAXRL_B1);
  for (int k = 0; k < 4; ++k) l2[k] = JAXRL_FOLD(l1[2 * k], l1[2 * k + 1], JAXRL_A2, JAXRL_B2);
  for (int k = 0; k < 2; ++k) l3[k] = JAXRL_FOLD(l2[2 * k], l2[2 * k + 1], JAXRL_A3, JAXRL_B3);
  return JAXRL_FOLD(l3[0], l3[1], JAXRL_A4, JAXRL_B4);
}

constexpr int kBitReverse4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

struct PagedShape {
  int64_t rows, heads, kv_heads, head_dim, num_pages, page_size, table_width;
};

// Offsets (in elements of a [num_pages, page_size, hd] pool) of consecutive positions from `start` through `table`:
// a page lookup per page, not a division per position.
struct PageWalk {
  const int32_t* table;
  int64_t page_size, hd, page, offset;
  PageWalk(const int32_t* table, int64_t page_size, int64_t start, int64_t hd)
      : table(table), page_size(page_size), hd(hd), page(start / page_size), offset(start % page_size) {}
  int64_t Next() {
    const int64_t at = (static_cast<int64_t>(table[page]) * page_size + offset) * hd;
    if (++offset == page_size) offset = 0, ++page;
    return at;
  }
};

// The first pass's walk asks for the key and the value `kAhead` positions ahead of the one it reads: the hardware
// prefetcher loses the stream at every page boundary (the next page is anywhere in the pool), and fetching the
// values beside the keys doubles the lines in flight and leaves them in L2 for the second pass (with VDPBF16PS, a
// layer at 128 slots x 384 positions, pages of 16: 2.66 -> 1.67 ms; bench/README.md, decode_phases.py).
constexpr int64_t kAhead = 32;

template <typename T>
struct Prefetcher {
  const T* k_pool;
  const T* v_pool;
  int64_t remaining;
  PageWalk ahead;
  Prefetcher(const T* k_pool, const T* v_pool, const int32_t* table, int64_t page_size, int64_t start, int64_t n,
             int64_t hd)
      : k_pool(k_pool), v_pool(v_pool), remaining(n), ahead(table, page_size, start, hd) {
    for (int64_t i = 0; i < kAhead && remaining > 0; ++i, --remaining) ahead.Next();
  }
  // Called once per position of the first pass, in order.
  void Step() {
    if (remaining <= 0) return;
    --remaining;
    const int64_t at = ahead.Next();
    const char* key = reinterpret_cast<const char*>(k_pool + at);
    const char* value = reinterpret_cast<const char*>(v_pool + at);
    for (int64_t b = 0; b < ahead.hd * static_cast<int64_t>(sizeof(T)); b += 64) {
      __builtin_prefetch(key + b, 0, 3);
      __builtin_prefetch(value + b, 0, 2);
    }
  }
};

// The first pass of PagedBlocked and PagedBf16: the scores of positions start .. start + n - 1 (through `table`,
// prefetching ahead) into `scores + g * stride` for each query head g, 16 keys at a time: `dot(key, dots, slot)`
// writes each head's 16 partial sums of one key's dot product into dots[g][slot], and Reduce16 turns 16 keys' partial
// sums into their 16 scores (the slots bit-reversed for it). The positions after n up to the next 16 score 0.
template <int G, typename T, typename Dot>
inline void ScoreKeys(const T* k_pool, const T* v_pool, const int32_t* table, int64_t page_size, int64_t start,
                      int64_t n, int64_t hd, float* scores, int64_t stride, Dot&& dot) {
  const int64_t n16 = (n + kLanes - 1) / kLanes * kLanes;
  PageWalk keys(table, page_size, start, hd);
  Prefetcher fetch(k_pool, v_pool, table, page_size, start, n, hd);
  for (int64_t i0 = 0; i0 < n16; i0 += kLanes) {
    F32x16 dots[G][kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const int slot = kBitReverse4[l];
      if (i0 + l >= n) {
        for (int g = 0; g < G; ++g) dots[g][slot] = F32x16{};
        continue;
      }
      fetch.Step();
      dot(k_pool + keys.Next(), dots, slot);
    }
    for (int g = 0; g < G; ++g) {
      const F32x16 sums = Reduce16(dots[g]);
      std::memcpy(scores + g * stride + i0, &sums, sizeof(sums));
    }
  }
}

// One (row, KV head) over its pages: positions start .. start + n - 1 through `table`; the pool of this KV head is
// `k_pool, v_pool [num_pages, page_size, hd]`. Keys are position-major here, so each score is a dot product over
// hd (HC vectors), 16 of them reduced at once.
template <typename T, int G, int HC>
void PagedBlocked(const float* q_rows, const T* k_pool, const T* v_pool, const int32_t* table, int64_t page_size,
                  int64_t start, int64_t n, float* out_rows, float scale, float softcap,
                  std::vector<float>& scratch) {
  constexpr int64_t hd = HC * kLanes;
  const int64_t n16 = (n + kLanes - 1) / kLanes * kLanes;
  scratch.resize(G * n16);
  float* scores = scratch.data();
  F32x16 qv[G][HC];
  for (int g = 0; g < G; ++g) {
    for (int h = 0; h < HC; ++h) {
      float lanes[kLanes];
      for (int l = 0; l < kLanes; ++l) lanes[l] = Rounded<T>(q_rows[g * hd + h * kLanes + l]);
      std::memcpy(&qv[g][h], lanes, sizeof(lanes));
    }
  }
  ScoreKeys<G>(k_pool, v_pool, table, page_size, start, n, hd, scores, n16,
               [&](const T* key, F32x16 (&dots)[G][kLanes], int slot) {
                 F32x16 kr[HC];
                 for (int h = 0; h < HC; ++h) kr[h] = Load16(key + h * kLanes);
                 for (int g = 0; g < G; ++g) {
                   F32x16 acc = qv[g][0] * kr[0];
                   for (int h = 1; h < HC; ++h) acc += qv[g][h] * kr[h];
                   dots[g][slot] = acc;
                 }
               });
  Softmax<T>(scores, G, n, n16, scale, softcap);
  F32x16 out[G][HC] = {};
  PageWalk values(table, page_size, start, hd);
  for (int64_t i = 0; i < n; ++i) {
    const T* value = v_pool + values.Next();
    F32x16 row[HC];
    for (int h = 0; h < HC; ++h) row[h] = Load16(value + h * kLanes);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * n16 + i];
      for (int h = 0; h < HC; ++h) out[g][h] += p * row[h];
    }
  }
  for (int g = 0; g < G; ++g) std::memcpy(out_rows + g * hd, out[g], hd * sizeof(float));
}

#if defined(__AVX512BF16__)
// A bfloat16 pool on a CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later): PagedBlocked's
// arithmetic on VDPBF16PS, which multiplies pairs of bfloat16 exactly and adds them into float32: the same products
// and float32 sums in another order, without widening each key and value to float32 first (that widening and its
// FMAs were most of the kernel's time: bench/README.md). Scores: each key's hd / 32 pair-products per query head,
// 16 keys reduced at once. Output: the values of two consecutive positions interleaved (VPUNPCK{L,H}WD) against
// their two probabilities as one bfloat16 pair, so accumulator lane 4k + j of 128-bit lane k holds head dimension
// 8k + j (low half) or 8k + 4 + j (high half) of each 32.
template <int G, int Z>
void PagedBf16(const float* q_rows, const uint16_t* k_pool, const uint16_t* v_pool, const int32_t* table,
               int64_t page_size, int64_t start, int64_t n, float* out_rows, float scale, float softcap,
               std::vector<float>& scratch) {
  constexpr int64_t hd = Z * 32;
  const int64_t n32 = (n + 31) / 32 * 32;
  scratch.assign(G * n32 + G * n32 / 2, 0.0f);
  float* scores = scratch.data();
  uint32_t* pairs = reinterpret_cast<uint32_t*>(scores + G * n32);
  __m512bh qb[G][Z];
  for (int g = 0; g < G; ++g) {
    for (int z = 0; z < Z; ++z) {
      const float* qz = q_rows + g * hd + 32 * z;
      qb[g][z] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qz + 16), _mm512_loadu_ps(qz));  // rounded to nearest even
    }
  }
  ScoreKeys<G>(k_pool, v_pool, table, page_size, start, n, hd, scores, n32,
               [&](const uint16_t* key, F32x16 (&dots)[G][kLanes], int slot) {
                 __m512bh kz[Z];
                 for (int z = 0; z < Z; ++z) kz[z] = (__m512bh)_mm512_loadu_si512(key + 32 * z);
                 for (int g = 0; g < G; ++g) {
                   __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kz[0]);
                   for (int z = 1; z < Z; ++z) acc = _mm512_dpbf16_ps(acc, qb[g][z], kz[z]);
                   dots[g][slot] = (F32x16)acc;
                 }
               });
  Softmax<uint16_t>(scores, G, n, n32, scale, softcap);  // lanes past ScoreKeys' 16s stay 0 from `assign`
  for (int g = 0; g < G; ++g) {
    for (int64_t i0 = 0; i0 < n32; i0 += 32) {
      const float* sg = scores + g * n32 + i0;  // already bfloat16 values: the conversion is exact
      _mm512_storeu_si512(pairs + (g * n32 + i0) / 2,
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sg + 16), _mm512_loadu_ps(sg)));
    }
  }
  __m512 lo[G][Z], hi[G][Z];
  for (int g = 0; g < G; ++g) {
    for (int z = 0; z < Z; ++z) lo[g][z] = hi[g][z] = _mm512_setzero_ps();
  }
  PageWalk values(table, page_size, start, hd);
  for (int64_t i = 0; i < n; i += 2) {
    const uint16_t* first = v_pool + values.Next();
    const uint16_t* second = i + 1 < n ? v_pool + values.Next() : nullptr;  // past the end: probability 0
    __m512i even[Z], odd[Z];
    for (int z = 0; z < Z; ++z) {
      const __m512i a = _mm512_loadu_si512(first + 32 * z);
      const __m512i b = second ? _mm512_loadu_si512(second + 32 * z) : _mm512_setzero_si512();
      even[z] = _mm512_unpacklo_epi16(a, b);
      odd[z] = _mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pairs[(g * n32 + i) / 2]));
      for (int z = 0; z < Z; ++z) {
        lo[g][z] = _mm512_dpbf16_ps(lo[g][z], p, (__m512bh)even[z]);
        hi[g][z] = _mm512_dpbf16_ps(hi[g][z], p, (__m512bh)odd[z]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int z = 0; z < Z; ++z) {
      float l[kLanes], h[kLanes];
      _mm512_storeu_ps(l, lo[g][z]);
      _mm512_storeu_ps(h, hi[g][z]);
      float* o = out_rows + g * hd + 32 * z;
      for (int k = 0; k < 4; ++k) {
        for (int j = 0; j < 4; ++j) o[8 * k + j] = l[4 * k + j], o[8 * k + 4 + j] = h[4 * k + j];
      }
    }
  }
}
#endif

// Any G and hd: the same arithmetic in plain loops.
template <typename T>
void PagedGeneric(const float* q_rows, const T* k_pool, const T* v_pool, const int32_t* table, int64_t page_size,
                  int64_t g_count, int64_t hd, int64_t start, int64_t n, float* out_rows, float scale,
                  float softcap, std::vector<float>& scratch) {
  const int64_t n16 = (n + kLanes - 1) / kLanes * kLanes;
  scratch.resize(g_count * hd + g_count * n16 + hd);
  float* qs = scratch.data();
  float* scores = qs + g_count * hd;
  float* row = scores + g_count * n16;
  for (int64_t i = 0; i < g_count * hd; ++i) qs[i] = Rounded<T>(q_rows[i]);
  auto row_of = [&](const T* pool, int64_t position) {
    return pool + (static_cast<int64_t>(table[position / page_size]) * page_size + position % page_size) * hd;
  };
  for (int64_t i = 0; i < n; ++i) {
    ToFloat(row_of(k_pool, start + i), row, hd);
    for (int64_t g = 0; g < g_count; ++g) {
      float dot = 0.0f;
      for (int64_t d = 0; d < hd; ++d) dot += qs[g * hd + d] * row[d];
      scores[g * n16 + i] = dot;
    }
  }
  Softmax<T>(scores, g_count, n, n16, scale, softcap);
  std::fill(out_rows, out_rows + g_count * hd, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    ToFloat(row_of(v_pool, start + i), row, hd);
    for (int64_t g = 0; g < g_count; ++g) {
      const float p = scores[g * n16 + i];
      for (int64_t d = 0; d < hd; ++d) out_rows[g * hd + d] += p * row[d];
    }
  }
}

// Calls `run(G, HD)` (std::integral_constant values) for the query heads per KV head and the head dimension the
// specialised kernels are compiled for (G 1 .. 8, HD 32, 64 or 128) and returns true; false for any other shape
// (PagedGeneric's).
template <int G = 1, typename Run>
bool WithStaticShape(int64_t g_count, int64_t hd, Run&& run) {
  if constexpr (G > 8) {
    return false;
  } else {
    if (g_count != G) return WithStaticShape<G + 1>(g_count, hd, run);
    switch (hd) {
      case 32: run(std::integral_constant<int, G>{}, std::integral_constant<int, 32>{}); return true;
      case 64: run(std::integral_constant<int, G>{}, std::integral_constant<int, 64>{}); return true;
      case 128: run(std::integral_constant<int, G>{}, std::integral_constant<int, 128>{}); return true;
      default: return false;
    }
  }
}

template <typename T>
void PagedOne(const float* q, const T* k, const T* v, const int32_t* tables, const int32_t* lengths, float* out,
              const PagedShape& s, int64_t window, float scale, float softcap, int64_t row, int64_t kv_head,
              std::vector<float>& scratch) {
  const int64_t g_count = s.heads / s.kv_heads, hd = s.head_dim;
  float* out_rows = out + (row * s.heads + kv_head * g_count) * hd;
  const int64_t length = std::min<int64_t>(lengths[row], s.table_width * s.page_size);
  if (length <= 0) {
    std::fill(out_rows, out_rows + g_count * hd, 0.0f);
    return;
  }
  const int64_t start = window > 0 ? std::max<int64_t>(0, length - window) : 0;
  const int64_t n = length - start;
  const float* q_rows = q + (row * s.heads + kv_head * g_count) * hd;
  const int64_t pool = s.num_pages * s.page_size * hd;
  const T* k_pool = k + kv_head * pool;
  const T* v_pool = v + kv_head * pool;
  const int32_t* table = tables + row * s.table_width;
  const bool specialised = WithStaticShape(g_count, hd, [&](auto g, auto d) {
    constexpr int G = decltype(g)::value, HD = decltype(d)::value;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, uint16_t>) {  // a bfloat16 pool: its products on VDPBF16PS
      PagedBf16<G, HD / 32>(q_rows, k_pool, v_pool, table, s.page_size, start, n, out_rows, scale, softcap, scratch);
    } else
#endif
    {
      PagedBlocked<T, G, HD / kLanes>(q_rows, k_pool, v_pool, table, s.page_size, start, n, out_rows, scale, softcap,
                                      scratch);
    }
  });
  if (specialised) return;
  PagedGeneric(q_rows, k_pool, v_pool, table, s.page_size, g_count, hd, start, n, out_rows, scale, softcap, scratch);
}

// One task per (row, KV head), spread over the pool (task_pool.h).
template <typename T>
struct Work : SharedTasks {
  const float* q;
  const T* k;
  const T* v;
  const int32_t* tables;
  const int32_t* lengths;
  float* out;
  PagedShape shape;
  int64_t window;
  float scale, softcap;

  void Drain() {
    std::vector<float> scratch;
    Take([&](int64_t t) {
      PagedOne<T>(q, k, v, tables, lengths, out, shape, window, scale, softcap, t / shape.kv_heads,
                  t % shape.kv_heads, scratch);
    });
  }
};

template <typename T>
void Run(ffi::ThreadPool pool, const float* q, const void* k, const void* v, const int32_t* tables,
         const int32_t* lengths, float* out, const PagedShape& shape, int64_t window, float scale, float softcap) {
  auto work = std::make_shared<Work<T>>();
  work->q = q, work->k = static_cast<const T*>(k), work->v = static_cast<const T*>(v);
  work->tables = tables, work->lengths = lengths, work->out = out;
  work->shape = shape, work->window = window, work->scale = scale, work->softcap = softcap;
  work->tasks = shape.rows * shape.kv_heads;
  RunOnPool(pool, work);
}

ffi::Error PagedDecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                                    ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t window, float scale,
                                    float softcap) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 || lengths.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("paged_decode_attention: q [S, H, hd], k and v [KVH, N, page_size, hd], "
                                       "page_table [S, M], lengths [S]");
  }
  const PagedShape shape{qd[0], qd[1], kd[0], qd[2], kd[1], kd[2], td[1]};
  for (int i = 0; i < 4; ++i) {
    if (vd[i] != kd[i]) return ffi::Error::InvalidArgument("paged_decode_attention: k and v differ in shape");
  }
  if (kd[3] != shape.head_dim || td[0] != shape.rows || lengths.dimensions()[0] != shape.rows ||
      shape.heads % shape.kv_heads != 0) {
    return ffi::Error::InvalidArgument("paged_decode_attention: mismatched shapes of q, k, v, page_table, lengths");
  }
  const auto type = k.element_type();
  if (v.element_type() != type) {
    return ffi::Error::InvalidArgument("paged_decode_attention: k and v must share a dtype");
  }
  if (type == ffi::U16 || type == ffi::BF16) {
    Run<uint16_t>(pool, q.typed_data(), k.untyped_data(), v.untyped_data(), tables.typed_data(),
                       lengths.typed_data(), out->typed_data(), shape, window, scale, softcap);
  } else if (type == ffi::F32) {
    Run<float>(pool, q.typed_data(), k.untyped_data(), v.untyped_data(), tables.typed_data(),
                    lengths.typed_data(), out->typed_data(), shape, window, scale, softcap);
  } else {
    return ffi::Error::InvalidArgument("paged_decode_attention: the pool must be bfloat16 bits (uint16) or float32");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecodeAttention, PagedDecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));
