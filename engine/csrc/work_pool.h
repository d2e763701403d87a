// The work pool the kernels' loops run on (torch's thread count), and parallel_for over it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

// A work pool whose caller never waits for a thread that has not started.
// ATen's parallel_for (OpenMP fork-join) ends each region at a barrier that every thread must reach. When another
// process holds one of the cores (the load generator beside the engine, a test run), each of a step's ~150 regions
// waits for the descheduled thread's next time slice, several times slower than one thread alone. Here the caller
// claims chunks alongside the workers and waits only for chunks a worker has claimed; a worker that wakes late
// finds nothing left. So a step runs at two threads' speed when both cores are free and at one thread's when not.
// The loop bodies given to it must not throw (they validate their input before the loop).
class WorkPool {
 public:
  static WorkPool& instance() {
    static WorkPool* pool = new WorkPool();  // never destroyed: its threads sleep until the process exits
    return *pool;
  }

  template <typename F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& body) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    const int64_t threads = at::get_num_threads();
    std::unique_lock<std::mutex> one_region_at_a_time(caller_, std::try_to_lock);
    if (threads <= 1 || n <= grain || !one_region_at_a_time.owns_lock()) {
      body(begin, end);
      return;
    }
    grow(threads - 1);
    // two chunks per thread: a late thread's share is picked up by the others (more, smaller chunks, or guided
    // ones shrinking towards the end, were no faster: each claim is a contended atomic, and each new chunk
    // restarts the hardware prefetchers: BENCHMARKS.md, "The kernels' design measurements")
    const int64_t chunk = std::max({grain, (n + 2 * threads - 1) / (2 * threads), (n + kMaxChunks - 1) / kMaxChunks});
    const uint64_t chunks = static_cast<uint64_t>((n + chunk - 1) / chunk);
    const std::function<void(int64_t, int64_t)> task = [&](int64_t b, int64_t e) { body(b, e); };
    task_ = &task;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t epoch = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(epoch << 32 | chunks << 16, std::memory_order_seq_cst);  // publishes the fields above
    if (sleeping_.load(std::memory_order_seq_cst) > 0) state_.notify_all();  // seq_cst pairs with work()'s check
    while (run_chunk(static_cast<uint32_t>(epoch))) {
    }
    while (done_.load(std::memory_order_acquire) < chunks) spin_pause();  // chunks a worker claimed
  }

 private:
  // state_: the region's number (high 32 bits), its chunk count (bits 16-31) and the next unclaimed chunk (0-15)
  static constexpr int64_t kMaxChunks = 1 << 15;

  static void spin_pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // Claims the next chunk of region `epoch` and runs it; false when the region has none left (or is over).
  bool run_chunk(uint32_t epoch) {
    uint64_t s = state_.load(std::memory_order_acquire);
    do {
      if ((s >> 32) != epoch || (s & 0xffff) >= ((s >> 16) & 0xffff)) return false;
    } while (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire));
    // a claimed chunk keeps the caller inside parallel_for, so the region's fields stay valid until done_ counts it
    const int64_t b = begin_ + static_cast<int64_t>(s & 0xffff) * chunk_;
    (*task_)(b, std::min(end_, b + chunk_));
    done_.fetch_add(1, std::memory_order_release);
    return true;
  }

  void grow(int64_t workers) {
    while (static_cast<int64_t>(threads_) < workers) {
      std::thread(&WorkPool::work, this).detach();
      ++threads_;
    }
  }

  void work() {
    uint32_t seen = static_cast<uint32_t>(state_.load(std::memory_order_acquire) >> 32);
    while (true) {
      uint64_t s = state_.load(std::memory_order_acquire);
      // spin for a while (a step's regions follow each other within microseconds), then sleep until notified
      for (int i = 0; static_cast<uint32_t>(s >> 32) == seen; ++i) {
        if (i < kSpins) {
          spin_pause();
        } else {
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          if (static_cast<uint32_t>(state_.load(std::memory_order_seq_cst) >> 32) == seen) state_.wait(s);
          sleeping_.fetch_sub(1, std::memory_order_seq_cst);
          i = 0;
        }
        s = state_.load(std::memory_order_acquire);
      }
      seen = static_cast<uint32_t>(s >> 32);
      while (run_chunk(seen)) {
      }
    }
  }

  static constexpr int kSpins = 1 << 14;  // ~100-300 us of pause instructions
  std::atomic<uint64_t> state_{0};
  std::atomic<uint64_t> done_{0};
  std::atomic<int> sleeping_{0};
  const std::function<void(int64_t, int64_t)>* task_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  size_t threads_ = 0;  // only the caller holding caller_ starts threads
  std::mutex caller_;
};

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& body) {
  WorkPool::instance().parallel_for(begin, end, grain, body);
}
