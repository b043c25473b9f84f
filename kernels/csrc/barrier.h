// A spinning barrier for the threads of one OpenMP region (kernels/csrc/layer.cpp's decode layer,
// which meets at a dozen barriers a layer, 30 layers a token).
//
// Why not `#pragma omp barrier`: libgomp gives every thread that starts a parallel region a team of
// its own, and once the teams' threads outnumber the CPUs (the engine's scheduler thread has one,
// and so does any other thread that ran one parallel torch op: the main thread loading weights,
// transformers in a benchmark) its barriers stop spinning after ~1000 pauses and put the waiting
// threads to sleep: each barrier becomes a futex wake-up of tens of microseconds. On a 2-core VM
// that took the default model's decode from 54 to 36 tokens/s. This barrier spins; after a few
// thousand pauses (~0.2-1 ms) each wait also yields the core, so that an oversubscribed host still
// makes progress. The region's threads themselves stay OpenMP's, the same ones torch's own ops use:
// a second pool of spinning threads would take the core from them.
#pragma once

#include <immintrin.h>
#include <sched.h>

#include <atomic>
#include <cstdint>

namespace preload {

class Barrier {
 public:
  // Every thread of the region says how many it has (omp_get_num_threads(), which may be fewer than
  // asked for) before its first wait.
  void join(int threads) { threads_.store(threads, std::memory_order_relaxed); }

  // Returns once every thread of the region has arrived.
  void wait() {
    const int threads = threads_.load(std::memory_order_relaxed);
    if (threads <= 1) return;
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads) {
      arrived_.store(0, std::memory_order_relaxed);  // before the release below: the next wait sees it
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < 4096)
        _mm_pause();
      else
        sched_yield();
    }
  }

 private:
  std::atomic<int> threads_{1};
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> generation_{0};
};

}  // namespace preload
