#include "worker_pool.h"

#include <immintrin.h>

#include <chrono>

namespace rebar_cpu_quant {
namespace {

constexpr int kGenerationShift = 44;  // 64 - kCountBits - kIndexBits
constexpr uint64_t kFieldMask = (uint64_t{1} << 22) - 1;
constexpr uint64_t kGenerationMask = (uint64_t{1} << 20) - 1;

uint64_t generation_of(uint64_t job) { return job >> kGenerationShift; }
int64_t count_of(uint64_t job) { return static_cast<int64_t>((job >> 22) & kFieldMask); }
int64_t index_of(uint64_t job) { return static_cast<int64_t>(job & kFieldMask); }

// How long an idle helper keeps polling for the next job before it sleeps. The gaps between the jobs
// of one decode step are microseconds; between steps the engine spends a millisecond or so in Python,
// and a helper asleep then costs only a wake-up at the next step's first job.
constexpr auto kSpinTime = std::chrono::microseconds(300);

}  // namespace

WorkerPool& WorkerPool::shared(int num_threads) {
  static std::mutex creation;
  // Never destroyed: helpers may still be polling while the process exits.
  static WorkerPool* pool = new WorkerPool();
  std::lock_guard<std::mutex> lock(creation);
  pool->grow(num_threads - 1);
  return *pool;
}

void WorkerPool::grow(int num_helpers) {
  while (static_cast<int>(helpers_.size()) < num_helpers) {
    const int index = static_cast<int>(helpers_.size());
    helpers_.emplace_back([this, index] { helper_loop(index); });
    num_helpers_.store(index + 1);
  }
}

bool WorkerPool::claim(uint64_t generation, int64_t* index) {
  uint64_t job = job_.load(std::memory_order_acquire);
  while (generation_of(job) == generation && index_of(job) < count_of(job)) {
    if (job_.compare_exchange_weak(job, job + 1, std::memory_order_acq_rel)) {
      *index = index_of(job);
      return true;
    }
  }
  return false;
}

void WorkerPool::work(uint64_t generation) {
  int64_t index;
  while (claim(generation, &index)) {
    (*chunk_)(index);  // chunk_ is not replaced before every claimed chunk is done
    done_.fetch_add(1, std::memory_order_release);
  }
}

void WorkerPool::run(int64_t num_chunks, int num_threads, const std::function<void(int64_t)>& chunk) {
  if (num_chunks <= 0) return;
  const int num_helpers = std::min<int>(num_threads - 1, num_helpers_.load());
  // A second caller (another thread calling in while the pool is busy) computes on its own thread.
  std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
  if (!busy.owns_lock() || num_helpers <= 0 || num_chunks == 1 || num_chunks > static_cast<int64_t>(kFieldMask)) {
    for (int64_t i = 0; i < num_chunks; ++i) chunk(i);
    return;
  }
  chunk_ = &chunk;
  done_.store(0, std::memory_order_relaxed);
  active_helpers_.store(num_helpers, std::memory_order_relaxed);
  generation_ = (generation_ + 1) & kGenerationMask;
  if (generation_ == 0) generation_ = 1;  // 0 is "no job yet"
  job_.store((generation_ << kGenerationShift) | (static_cast<uint64_t>(num_chunks) << 22));  // seq_cst: see helper_loop
  if (sleeping_.load() > 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_.notify_all();
  }
  work(generation_);
  while (done_.load(std::memory_order_acquire) < num_chunks) _mm_pause();
}

void WorkerPool::helper_loop(int index) {
  uint64_t seen = 0;
  while (true) {  // the pool lives as long as the process
    uint64_t generation = generation_of(job_.load(std::memory_order_acquire));
    const auto spin_until = std::chrono::steady_clock::now() + kSpinTime;
    for (int polls = 0; generation == seen; ++polls) {
      _mm_pause();
      generation = generation_of(job_.load(std::memory_order_acquire));
      if (polls % 256 == 255 && std::chrono::steady_clock::now() > spin_until) break;
    }
    if (generation == seen) {
      // Announce the sleep before checking for a job (both seq_cst): either run() sees the sleeper
      // and notifies, or this check sees run()'s job; a wake-up is never lost.
      sleeping_.fetch_add(1);
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_of(job_.load()) != seen; });
      sleeping_.fetch_sub(1);
      continue;
    }
    seen = generation;
    if (index < active_helpers_.load(std::memory_order_relaxed)) work(generation);
  }
}

}  // namespace rebar_cpu_quant
