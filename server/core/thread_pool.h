// ThreadPool: a few threads that run ParallelFor ranges for big optimizer applies, so a large
// variable's update uses every core instead of one I/O thread.
//
// Thread-safety: ParallelFor may be called from any thread; calls are independent.
#ifndef PSD_SERVER_CORE_THREAD_POOL_H_
#define PSD_SERVER_CORE_THREAD_POOL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "base/mutex.h"

namespace psd::server {

class ThreadPool {
 public:
  // `threads` helpers; 0 runs everything on the caller.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Splits [0, n) into chunks of at least `grain` and runs fn(begin, end) on them, the caller
  // included; returns when all are done.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) EXCLUDES(mu_);

 private:
  void Run() EXCLUDES(mu_);
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> tasks_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_THREAD_POOL_H_
