// ThreadPool: a few threads that run ParallelFor ranges, so one big pass over memory uses several
// cores instead of the one thread that asked: the daemon's optimizer applies, adds of big gradient
// pieces and writes of values into a worker's shared memory (its apply threads), and the client's
// copies into and out of that shared memory (ClientOptions::copy_threads).
//
// Thread-safety: ParallelFor and ParallelCopy may be called from any thread; calls are
// independent. A task must not call ParallelFor on its own pool.
#ifndef PSD_BASE_THREAD_POOL_H_
#define PSD_BASE_THREAD_POOL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "base/mutex.h"

namespace psd {

class ThreadPool {
 public:
  // `threads` helpers; 0 runs everything on the caller.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Splits [0, n) into chunks of at least `grain` and runs fn(begin, end) on them, the caller
  // included; returns when all are done. Only helpers that are idle now take a chunk (a busy pool
  // leaves more to the caller rather than queue it behind other callers' chunks). In a process
  // forked after the pool started (no helpers there) the caller runs it all.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) EXCLUDES(mu_);

  // std::memcpy(dst, src, bytes) (no overlap), in parts of at least kCopyGrain bytes over the pool
  // while at most kHelpedCopies copies run at once (more at once: each on its caller alone, as
  // they already keep that many cores and the memory busy).
  void ParallelCopy(void* dst, const void* src, size_t bytes) EXCLUDES(mu_);
  static constexpr size_t kCopyGrain = 512 << 10;
  static constexpr int kHelpedCopies = 2;

 private:
  void Run() EXCLUDES(mu_);
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> tasks_ GUARDED_BY(mu_);
  int busy_ GUARDED_BY(mu_) = 0;  // helpers running a chunk, or about to (chunks queued)
  // The process the helpers run in: a child forked since has none (its calls run on the caller).
  const int owner_pid_;
  std::atomic<int> copies_{0};  // ParallelCopy calls in flight
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace psd

#endif  // PSD_BASE_THREAD_POOL_H_
