#include "base/thread_pool.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>

namespace psd {

ThreadPool::ThreadPool(int threads) : owner_pid_(static_cast<int>(::getpid())) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  for (auto& t : threads_) t.join();
}

void ThreadPool::Run() {
  for (;;) {
    std::function<void()> task;
    {
      MutexLock lock(&mu_);
      while (!stop_ && tasks_.empty()) cv_.Wait(&mu_);
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
    MutexLock lock(&mu_);
    --busy_;
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  int64_t parts = std::min<int64_t>(static_cast<int64_t>(threads_.size()) + 1, std::max<int64_t>(1, n / grain));
  if (parts > 1 && static_cast<int>(::getpid()) != owner_pid_) parts = 1;
  if (parts > 1) {
    MutexLock lock(&mu_);
    parts = std::min<int64_t>(parts, static_cast<int64_t>(threads_.size()) - busy_ + 1);
    if (parts > 1) busy_ += static_cast<int>(parts - 1);
  }
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  Mutex done_mu;
  CondVar done_cv;
  int64_t remaining = parts - 1;  // guarded by done_mu: chunks for helpers not done
  std::exception_ptr failed;      // guarded by done_mu: the first exception a chunk threw
  // A chunk that throws (out of memory) does not end the process on a helper, nor unwind this
  // frame while other chunks still use it: its exception is kept and thrown here once all are done.
  auto run = [&](int64_t p) {
    try {
      fn(n * p / parts, n * (p + 1) / parts);
    } catch (...) {
      MutexLock l(&done_mu);
      if (!failed) failed = std::current_exception();
    }
  };
  int64_t queued = 0;
  {
    MutexLock lock(&mu_);
    try {
      for (int64_t p = 1; p < parts; ++p) {
        tasks_.push_back([&, p] {
          run(p);
          MutexLock l(&done_mu);
          if (--remaining == 0) done_cv.NotifyOne();
        });
        ++queued;
      }
    } catch (...) {  // out of memory queueing them: the chunks not queued run here
      busy_ -= static_cast<int>(parts - 1 - queued);
    }
  }
  cv_.NotifyAll();
  run(0);
  for (int64_t p = queued + 1; p < parts; ++p) run(p);
  MutexLock lock(&done_mu);
  remaining -= parts - 1 - queued;  // those ran here
  while (remaining != 0) done_cv.Wait(&done_mu);
  if (failed) std::rethrow_exception(failed);
}

void ThreadPool::ParallelCopy(void* dst, const void* src, size_t bytes) {
  const int copies = copies_.fetch_add(1, std::memory_order_relaxed) + 1;
  struct Leave {
    std::atomic<int>& n;
    ~Leave() { n.fetch_sub(1, std::memory_order_relaxed); }
  } leave{copies_};
  if (threads_.empty() || bytes < 2 * kCopyGrain || copies > kHelpedCopies) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return;
  }
  // Parts of whole cache lines: no two threads write one line.
  const int64_t lines = static_cast<int64_t>((bytes + 63) / 64);
  ParallelFor(lines, static_cast<int64_t>(kCopyGrain / 64), [&](int64_t b, int64_t e) {
    const size_t from = static_cast<size_t>(b) * 64, to = std::min(bytes, static_cast<size_t>(e) * 64);
    std::memcpy(static_cast<char*>(dst) + from, static_cast<const char*>(src) + from, to - from);
  });
}

}  // namespace psd
