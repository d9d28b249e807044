// A bfloat16 matmul on Intel AMX for the rollout engine's decode step on the CPU, as an XLA FFI custom call (built
// on first use by jaxrl_llm/engine/cpu_kernel.py where the CPU has AMX).
//
//   x       [M, K]                  bfloat16 (as uint16 bits or bf16), or float32 rounded to bfloat16 here: the
//                                   step's activations, one row per slot
//   norm    [K] or [0]              float32: where given (x float32), each row of x is first RMS-normalized as
//                                   `models/layers.py: rms_norm`: x / sqrt(mean(x^2) + eps) * norm (* (1 + norm)
//                                   with `unit_offset`), in float32, then rounded: the block's pre-norm and the
//                                   matmul's cast in the kernel, not three small XLA ops before it
//   w       [N / 16, Kp / 32, 16, 32] bfloat16: the weight [K, N] packed once per generate call
//                                   (`cpu_kernel.pack_weight`): tile (nb, kb) holds, in row p and column 2n + e,
//                                   w[32 kb + 2p + e, 16 nb + n] (zero where 32 kb + 2p + e >= K); AMX's pair layout
//   out     [M, N]                  float32: out = x @ w, products of bfloat16 summed in float32 (TDPBF16PS)
//
// With `activation` (1: silu, 2: gelu_pytorch_tanh) the weight is a gated MLP's gate|up with their 16-column blocks
// interleaved (`cpu_kernel.pack_gated_weight`: block 2j is the gate's columns 16j .. 16j + 15, block 2j + 1 the up
// projection's), and the kernel returns the MLP's inner activation instead of the product:
//
//   out     [M, N / 2]              bfloat16: round(act(x @ gate) * (x @ up)), the product's float32 sums, the
//                                   activation in float32, rounded to nearest even: the down projection's operand
//
// so the step neither writes the [M, 2I] float32 product nor reads it back for XLA's act(gate) * up and the cast
// (about 0.6 s of the RL-shaped rollout's trace, bench/README.md).
//
// Why a kernel: at a decode step's few rows the matmuls stream the weights and XLA:CPU's bfloat16 GEMM re-packs each
// weight on every call, so the step reads every weight about twice and the 32-row decode step of SmolLM2 ran its
// matmuls at ~11 GB/s of weights (bench/README.md, the engine's section). Packing once per generate call and
// streaming the packed tiles halves the time of a 32-row step's matmuls. The output equals XLA's (the same
// bfloat16 products and float32 sums; tests/test_cpu_kernel.py).
//
// Work: a block is 32 rows of x times a pair of 16-column blocks of N, 2 x 2 accumulator tiles (rows x columns)
// over the K blocks; a task is a contiguous range of column pairs over all rows (`Range`). Tasks are spread over
// XLA's intra-op thread pool.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "task_pool.h"
#include "vector16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask Linux for an extended state component
constexpr long kXfeatureXtiledata = 18;     // AMX's tile data

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes: 16 x 32 bfloat16 (x, packed w) or 16 x 16 float32 (accumulators).
void ConfigureTiles() {
  TileConfig config{};
  config.palette = 1;
  for (int i = 0; i < 8; ++i) {
    config.rows[i] = 16;
    config.colsb[i] = 64;
  }
  // GCC does not see the intrinsic read the whole struct and drops the zeroing of the unused tiles' entries
  // (LDTILECFG then faults): make every store happen first.
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// A range's column pairs are taken this many bytes of weight tiles at a time (within L2 beside x's rows): the LM
// head's range is megabytes, which the later rows would otherwise read from memory again.
constexpr int64_t kChunkBytes = 256 << 10;

enum Activation : int64_t { kNone = 0, kSilu = 1, kGeluTanh = 2 };

// act(g) * u on 16 lanes, in float32: g sigmoid(z) u with z = g (silu) or z = 2a, a = sqrt(2 / pi) (g + 0.044715
// g^3) (gelu_pytorch_tanh: 0.5 g (1 + tanh a) = g sigmoid(2a)). sigmoid(z) from e = exp(-|z|) in (0, 1] (Exp16 takes
// x <= 0): 1 / (1 + e) for z >= 0, e / (1 + e) below, finite for every z.
inline F32x16 Gated(F32x16 g, F32x16 u, int64_t activation) {
  const F32x16 z = activation == kSilu ? g : 0.7978845608028654f * (g + 0.044715f * g * g * g) * 2.0f;
  const auto negative = z < Splat(0.0f);
  const F32x16 e = Exp16(negative ? z : -z);  // exp(-|z|) in (0, 1]
  const F32x16 sigmoid = negative ? e / (1.0f + e) : 1.0f / (1.0f + e);
  return g * sigmoid * u;
}

// Row `x [k]` (float32) as bfloat16 bits into `dst`: x * r * s rounded, r = 1 / sqrt(mean(x^2) + eps) and
// s = scale (1 + scale with `unit_offset`) where `scale` is given, else x rounded: XLA's rms_norm and convert,
// the same float32 products (the sum of squares in another order).
void PrepareRow(const float* x, int64_t k, const float* scale, float eps, bool unit_offset, uint16_t* dst) {
  float r = 1.0f;
  int64_t i = 0;
  if (scale != nullptr) {
    F32x16 acc{};
    for (; i + kLanes <= k; i += kLanes) {
      const F32x16 v = Load16(x + i);
      acc += v * v;
    }
    float squares = HorizontalSum(acc);
    for (; i < k; ++i) squares += x[i] * x[i];
    r = 1.0f / std::sqrt(squares / static_cast<float>(k) + eps);
  }
  const float offset = unit_offset ? 1.0f : 0.0f;
  for (i = 0; i + kLanes <= k; i += kLanes) {
    F32x16 v = Load16(x + i) * r;
    if (scale != nullptr) v = v * (Load16(scale + i) + offset);
    StoreBf16(dst + i, v);
  }
  for (; i < k; ++i) dst[i] = Bf16Bits(scale != nullptr ? x[i] * r * (scale[i] + offset) : x[i]);
}

// Task t: a range of column pairs (`Range`), spread over the pool (task_pool.h).
struct Work : SharedTasks {
  const uint16_t* x;  // [mp, kp], zero padded
  const uint16_t* w;
  float* out;
  uint16_t* gated_out;  // with an activation: [m, n / 2] bfloat16 bits
  int64_t m, n, mp, kp, n_blocks, k_blocks, activation = kNone;
  std::vector<uint16_t> padded;

  // Rows m0 .. m0 + 31 of column blocks nb and nb + 1 (nb alone where it is the last); `ahead` lines of 64 bytes
  // from `prefetch` asked into L2 on the way (the next chunk's weights, `Range`).
  void Block(int64_t nb, int64_t m0, float* scratch, const char* prefetch, int64_t ahead) const {
    const bool two = nb + 1 < n_blocks;
    const uint16_t* b0 = w + nb * k_blocks * 512;
    const uint16_t* b1 = two ? b0 + k_blocks * 512 : b0;
    const int64_t x_stride = kp * 2, cols = two ? 32 : 16;
    const uint16_t* a0 = x + m0 * kp;
    const uint16_t* a1 = m0 + 16 < mp ? a0 + 16 * kp : a0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t per_kb = (ahead + k_blocks - 1) / k_blocks;
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      for (int64_t i = 0; i < per_kb && ahead > 0; ++i, --ahead, prefetch += 64) {
        _mm_prefetch(prefetch, _MM_HINT_T1);
      }
      _tile_loadd(4, a0 + kb * 32, x_stride);
      _tile_loadd(5, a1 + kb * 32, x_stride);
      _tile_loadd(6, b0 + kb * 512, 64);
      _tile_loadd(7, b1 + kb * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    const int64_t rows = std::min<int64_t>(32, m - m0);
    if (activation != kNone) {  // blocks nb, nb + 1: the gate's and the up projection's same 16 columns
      _tile_stored(0, scratch, 128);
      _tile_stored(1, scratch + 16, 128);
      _tile_stored(2, scratch + 512, 128);
      _tile_stored(3, scratch + 528, 128);
      const int64_t half = n / 2;
      for (int64_t r = 0; r < rows; ++r) {
        const F32x16 g = Load16(scratch + r * 32), u = Load16(scratch + r * 32 + 16);
        StoreBf16(gated_out + (m0 + r) * half + nb * 8, Gated(g, u, activation));
      }
    } else if (rows == 32 && cols == 32) {  // straight into the output
      float* o = out + m0 * n + nb * 16;
      _tile_stored(0, o, n * 4);
      _tile_stored(1, o + 16, n * 4);
      _tile_stored(2, o + 16 * n, n * 4);
      _tile_stored(3, o + 16 * n + 16, n * 4);
    } else {  // the last rows, or a last single column block: through scratch
      _tile_stored(0, scratch, 128);
      _tile_stored(1, scratch + 16, 128);
      _tile_stored(2, scratch + 512, 128);
      _tile_stored(3, scratch + 528, 128);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(out + (m0 + r) * n + nb * 16, scratch + r * 32, cols * 4);
    }
  }

  // Task t: a contiguous range of column pairs, every 32 rows of x over the whole range before the next 32. Each
  // thread streams its part of the weight in order (the hardware prefetcher follows), and a range's weight tiles
  // are read from memory once and from cache for the later rows, while the 32 rows of x stay in L1 across the range
  // (the RL-shaped rollout 14.80 -> 14.06 s against one column pair per task over all rows, bench/README.md).
  // While a chunk's later rows compute from L2, the next chunk is asked into L2, so its first rows do not wait on
  // memory: the reads of memory overlap the tiles' arithmetic instead of alternating with it.
  void Range(int64_t t, float* scratch) const {
    const int64_t pairs = (n_blocks + 1) / 2;
    const int64_t lo = t * pairs / tasks, hi = (t + 1) * pairs / tasks;
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (k_blocks * 2048));
    const int64_t block_bytes = k_blocks * 1024, end_bytes = n_blocks * block_bytes;
    const char* base = reinterpret_cast<const char*>(w);
    for (int64_t c = lo; c < hi; c += chunk) {
      const int64_t stop = std::min(hi, c + chunk);
      const int64_t from = 2 * stop * block_bytes;
      const int64_t lines =
          std::max<int64_t>(0, std::min(2 * std::min(hi, stop + chunk) * block_bytes, end_bytes) - from) / 64;
      const int64_t calls = (mp + 31) / 32 * (stop - c), per_call = (lines + calls - 1) / calls;
      int64_t issued = 0;
      for (int64_t m0 = 0; m0 < mp; m0 += 32) {
        for (int64_t p = c; p < stop; ++p) {
          const int64_t ahead = std::min(per_call, lines - issued);
          Block(2 * p, m0, scratch, base + from + issued * 64, ahead);
          issued += ahead;
        }
      }
    }
  }

  void Drain() {
    ConfigureTiles();
    alignas(64) float scratch[32 * 32];
    Take([&](int64_t t) { Range(t, scratch); });
    _tile_release();
  }
};

bool AmxPermitted() {
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer norm,
                            ffi::Result<ffi::AnyBuffer> out, int64_t activation, float eps, int64_t unit_offset) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || od.size() != 2 || wd[2] != 16 || wd[3] != 32) {
    return ffi::Error::InvalidArgument("packed_matmul: x [M, K], w [N / 16, Kp / 32, 16, 32], out [M, N]");
  }
  const bool x32 = x.element_type() == ffi::F32;
  if (x.element_type() != ffi::U16 && x.element_type() != ffi::BF16 && !x32) {
    return ffi::Error::InvalidArgument("packed_matmul: x must be bfloat16 (or its uint16 bits) or float32");
  }
  const bool normed = norm.element_count() > 0;
  if (normed && (!x32 || norm.element_type() != ffi::F32 || norm.element_count() != xd[1])) {
    return ffi::Error::InvalidArgument("packed_matmul: a norm is float32 [K] over a float32 x");
  }
  if (w.element_type() != ffi::U16 && w.element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument("packed_matmul: w must be bfloat16 (or its uint16 bits)");
  }
  const int64_t m = xd[0], k = xd[1];
  if (activation < kNone || activation > kGeluTanh) {
    return ffi::Error::InvalidArgument("packed_matmul: activation must be 0 (none), 1 (silu) or 2 (gelu_tanh)");
  }
  const bool gated = activation != kNone;
  if (gated ? (wd[0] % 2 != 0 || od[1] * 2 != wd[0] * 16) : od[1] != wd[0] * 16) {
    return ffi::Error::InvalidArgument("packed_matmul: mismatched shapes of w and out");
  }
  if (od[0] != m || k > wd[1] * 32) {
    return ffi::Error::InvalidArgument("packed_matmul: mismatched shapes of x, w and out");
  }
  if (out->element_type() != (gated ? ffi::BF16 : ffi::F32)) {
    return ffi::Error::InvalidArgument("packed_matmul: out is float32, or bfloat16 with an activation");
  }
  if (!AmxPermitted()) return ffi::Error::Internal("packed_matmul: Linux did not grant this process AMX's tiles");
  if (m == 0) return ffi::Error::Success();
  auto work = std::make_shared<Work>();
  work->m = m, work->n = wd[0] * 16, work->n_blocks = wd[0], work->k_blocks = wd[1], work->activation = activation;
  work->kp = wd[1] * 32, work->mp = (m + 15) / 16 * 16;
  const auto* xs = static_cast<const uint16_t*>(x.untyped_data());
  if (x32) {  // rounded (normalized first where asked) into rows of kp, zeros after k and below m
    work->padded.assign(work->mp * work->kp, 0);
    const float* rows = static_cast<const float*>(x.untyped_data());
    const float* scale = normed ? static_cast<const float*>(norm.untyped_data()) : nullptr;
    for (int64_t r = 0; r < m; ++r) {
      PrepareRow(rows + r * k, k, scale, eps, unit_offset != 0, work->padded.data() + r * work->kp);
    }
    work->x = work->padded.data();
  } else if (work->mp == m && work->kp == k) {
    work->x = xs;
  } else {  // rows to a multiple of 16 and K to the packed blocks, with zeros
    work->padded.assign(work->mp * work->kp, 0);
    for (int64_t r = 0; r < m; ++r) std::memcpy(work->padded.data() + r * work->kp, xs + r * k, k * 2);
    work->x = work->padded.data();
  }
  work->w = static_cast<const uint16_t*>(w.untyped_data());
  work->out = gated ? nullptr : static_cast<float*>(out->untyped_data());
  work->gated_out = gated ? static_cast<uint16_t*>(out->untyped_data()) : nullptr;
  // Two ranges per thread: a pool thread that starts late leaves its ranges to the others.
  work->tasks = std::min<int64_t>((work->n_blocks + 1) / 2, 2 * std::max<int64_t>(1, pool.num_threads()));
  RunOnPool(pool, work);
  return ffi::Error::Success();
}

}  // namespace

// 1 when this process may use AMX's tiles (Linux grants them on request), else 0: checked once before registering.
extern "C" int JaxrlAmxPermitted() { return AmxPermitted() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("activation")
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("unit_offset"));
