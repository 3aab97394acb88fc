// Helper threads for the fused decode step that never make the caller wait for a thread that is
// not running.
//
// An OpenMP region splits work statically and ends every phase in a barrier: when another process
// takes a core, the barrier waits for the descheduled thread for a scheduler time slice
// (milliseconds), and a decode step has hundreds of phases. Here the caller publishes a job of N
// chunks and claims chunks itself; helpers that are awake claim the rest. The caller then waits only
// for chunks a helper has actually started, so a helper that is not running costs nothing.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace rebar_cpu_quant {

class WorkerPool {
 public:
  // The process-wide pool; grows to `num_threads - 1` helpers on demand (never shrinks).
  static WorkerPool& shared(int num_threads);

  // Runs chunk(i) for every i in [0, num_chunks) on the caller and up to `num_threads - 1` helpers;
  // returns when all are done. Thread-safe: while one caller has the helpers, others compute alone.
  void run(int64_t num_chunks, int num_threads, const std::function<void(int64_t)>& chunk);

 private:
  void grow(int num_helpers);
  void helper_loop(int index);
  // Claims the next chunk of job `generation`; false when it is finished or superseded.
  bool claim(uint64_t generation, int64_t* index);
  void work(uint64_t generation);

  // job_ packs (generation, chunk count, next chunk index) so one compare-and-swap validates all
  // three: a helper can never claim a chunk of a job other than the one it read.
  static constexpr int kCountBits = 22, kIndexBits = 22;
  std::atomic<uint64_t> job_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> active_helpers_{0};  // helpers allowed to join the current job
  const std::function<void(int64_t)>* chunk_ = nullptr;
  uint64_t generation_ = 0;

  std::mutex busy_;  // held by the caller that owns the current job
  std::vector<std::thread> helpers_;  // only touched by grow(), under shared()'s lock
  std::atomic<int> num_helpers_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleeping_{0};
};

}  // namespace rebar_cpu_quant
