// The rollout engine's sampling step on the CPU, as an XLA FFI custom call (built on first use by
// jaxrl_llm/engine/cpu_kernel.py): each row's next token drawn from softmax(logits / T) by the inverse CDF of the
// row's own uniform, and the token's log-probability.
//
//   logits       [B, V]  float32
//   uniform      [B]     float32 in [0, 1)
//   temperature  []      float32 (> 0)
//   token        [B]     int32
//   logprob      [B]     float32: log softmax(logits / T)[token]
//   attribute    block   the entries per block of the two-level search
//
// The draw of `jaxrl_llm.sampling.logits.inverse_cdf_sample` over the weights w = exp(s - max s), s = logits / T:
// the first block whose cumulative mass passes u * total (u the row's uniform), then the first entry within it
// (a count of cumulative sums <= the target, capped at the entries below the block's total so a rounded-up target
// never lands on trailing zero weights); logprob = s[token] - max s - log(total). Only the order of the float32
// sums and the exponential (a polynomial, relative error ~2e-7) differ from XLA's, so a token differs only where
// the target lies within rounding of a cumulative sum.
//
// Why a kernel: XLA:CPU runs that math as four passes over the [B, V] logits, each from memory (the logits divided
// by T and stored, their exponentials stored, the block sums, the total): 5.4 ms of a 128-row SmolLM2 decode step
// (docs/engine.md). Here a row's logits are read once from memory; its second pass and the chosen block's are in
// L2. Rows are spread over XLA's intra-op thread pool.

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

// exp(s - peak) of entries lo .. hi - 1 of `s` into `w` (when given) and their sum; `s` already divided by T.
float Weights(const float* s, int64_t lo, int64_t hi, float peak, float* w) {
  F32x16 total{};
  int64_t i = lo;
  for (; i + kLanes <= hi; i += kLanes) {
    const F32x16 e = Exp16(Load16(s + i) - peak);
    if (w) std::memcpy(w + (i - lo), &e, sizeof(e));
    total += e;
  }
  float rest = 0.0f;
  for (; i < hi; ++i) {
    float lanes[kLanes] = {s[i] - peak};
    F32x16 x;
    std::memcpy(&x, lanes, sizeof(x));
    const float e = Exp16(x)[0];
    if (w) w[i - lo] = e;
    rest += e;
  }
  return HorizontalSum(total) + rest;
}

// The count of `cumulative[0 .. n)` <= target, capped at the count below the last (the total).
int64_t FirstCrossing(const float* cumulative, int64_t n, float target) {
  int64_t passed = 0, below_total = 0;
  for (int64_t i = 0; i < n; ++i) {
    passed += cumulative[i] <= target;
    below_total += cumulative[i] < cumulative[n - 1];
  }
  return std::min(passed, below_total);
}

// One task per row, spread over the pool (task_pool.h).
struct Work : SharedTasks {
  const float* logits;
  const float* uniform;
  float temperature;
  int32_t* token;
  float* logprob;
  int64_t vocab, block;

  void Row(int64_t r, std::vector<float>& scratch) const {
    const int64_t blocks = (vocab + block - 1) / block;
    scratch.resize(vocab + 2 * blocks + block);
    float* s = scratch.data();
    float* mass = s + vocab;
    float* cumulative = mass + blocks;
    float* inside = cumulative + blocks;
    const float* l = logits + r * vocab;
    F32x16 peak16 = Splat(-INFINITY);
    int64_t i = 0;
    for (; i + kLanes <= vocab; i += kLanes) {
      const F32x16 x = Load16(l + i) / temperature;  // a division, as XLA's `logits / T`
      std::memcpy(s + i, &x, sizeof(x));
      peak16 = Max16(peak16, x);
    }
    float peak = HorizontalMax(peak16);
    for (; i < vocab; ++i) peak = std::max(peak, s[i] = l[i] / temperature);
    float running = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      mass[b] = Weights(s, b * block, std::min(vocab, (b + 1) * block), peak, nullptr);
      cumulative[b] = running += mass[b];
    }
    const float total = cumulative[blocks - 1];
    const float target = uniform[r] * total;
    const int64_t chosen = std::min(FirstCrossing(cumulative, blocks, target), blocks - 1);
    const int64_t lo = chosen * block, hi = std::min(vocab, lo + block);
    Weights(s, lo, hi, peak, inside);
    std::fill(inside + (hi - lo), inside + block, 0.0f);  // the last block's padding: zero weights
    for (int64_t j = 1; j < block; ++j) inside[j] += inside[j - 1];
    const float before = cumulative[chosen] - mass[chosen];
    const int64_t offset = FirstCrossing(inside, block, std::max(target - before, 0.0f));
    const int64_t picked = std::min(lo + offset, vocab - 1);
    token[r] = static_cast<int32_t>(picked);
    logprob[r] = (s[picked] - peak) - std::log(total);
  }

  void Drain() {
    std::vector<float> scratch;
    Take([&](int64_t r) { Row(r, scratch); });
  }
};

ffi::Error InverseCdfSampleImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> uniform,
                                ffi::Buffer<ffi::F32> temperature, ffi::Result<ffi::Buffer<ffi::S32>> token,
                                ffi::Result<ffi::Buffer<ffi::F32>> logprob, int64_t block) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2 || uniform.dimensions().size() != 1 || uniform.dimensions()[0] != ld[0] ||
      temperature.element_count() != 1 || token->element_count() != ld[0] || logprob->element_count() != ld[0]) {
    return ffi::Error::InvalidArgument("inverse_cdf_sample: logits [B, V], uniform [B], temperature [], "
                                       "token and logprob [B]");
  }
  if (ld[1] < 1 || block < 1) return ffi::Error::InvalidArgument("inverse_cdf_sample: empty vocabulary or block");
  if (ld[0] == 0) return ffi::Error::Success();
  auto work = std::make_shared<Work>();
  work->logits = logits.typed_data(), work->uniform = uniform.typed_data();
  work->temperature = temperature.typed_data()[0];
  work->token = token->typed_data(), work->logprob = logprob->typed_data();
  work->tasks = ld[0], work->vocab = ld[1], work->block = block;
  RunOnPool(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(InverseCdfSample, InverseCdfSampleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block"));
