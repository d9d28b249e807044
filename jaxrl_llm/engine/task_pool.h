// Spreading a kernel's independent tasks over XLA's intra-op thread pool, shared by the engine's CPU kernels
// (decode_attention.cc, inverse_cdf.cc, packed_matmul.cc).
//
// The tasks are handed out one at a time from a shared counter: the calling thread and up to `threads - 1` pool
// tasks take them until none is left, and the call returns once every task taken has finished. A pool task that
// starts late finds no work (it holds the kernel's state through its shared_ptr), so a busy pool never blocks the
// call.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

// The task counter a kernel's state derives from: `tasks` to run, the next one to hand out, the ones finished.
struct SharedTasks {
  int64_t tasks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Runs `one(t)` on the tasks this thread takes until none is left; they count as done once all have run.
  template <typename F>
  void Take(F&& one) {
    int64_t finished = 0;
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      one(t);
      ++finished;
    }
    done.fetch_add(finished);
  }
};

// `work->Drain()` (a `SharedTasks` whose Drain takes its tasks) on this thread and as many pool tasks as help,
// returning when every one of `work->tasks` has finished.
template <typename Work>
void RunOnPool(xla::ffi::ThreadPool pool, const std::shared_ptr<Work>& work) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load() < work->tasks) std::this_thread::yield();
}
