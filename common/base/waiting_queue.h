// WaitingQueue: connections that wait for their first message, oldest first, so that a server at
// its limit closes the one that has waited longest instead of turning a newcomer away — a liveness
// probe or a worker is not kept out by clients that connect and send nothing (the ops HTTP port,
// the shared-memory socket).
//
// T provides `bool waiting() const` (still waiting for its message) and `bool Evict()` (closes it
// if it still waits; false once it no longer does: being served, or closed). Thread-safe.
#ifndef PSD_COMMON_BASE_WAITING_QUEUE_H_
#define PSD_COMMON_BASE_WAITING_QUEUE_H_

#include <cstddef>
#include <deque>
#include <memory>

#include "base/mutex.h"

namespace psd {

template <typename T>
class WaitingQueue {
 public:
  // Queues `t` (the newest); entries no longer waiting leave the queue.
  void Add(const std::shared_ptr<T>& t) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    Prune();
    queue_.push_back(t);
  }
  // Closes the one that has waited longest; false if none waits.
  bool EvictOldest() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    while (!queue_.empty()) {
      auto oldest = queue_.front().lock();
      queue_.pop_front();
      if (oldest && oldest->Evict()) return true;
    }
    return false;
  }
  // Add, after closing the oldest while `max` or more wait.
  void Admit(const std::shared_ptr<T>& t, size_t max) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    Prune();
    size_t live = 0;
    for (const auto& weak : queue_) {
      auto other = weak.lock();
      live += other && other->waiting() ? 1 : 0;
    }
    while (live >= max && !queue_.empty()) {
      auto oldest = queue_.front().lock();
      queue_.pop_front();
      if (oldest && oldest->Evict()) --live;
    }
    queue_.push_back(t);
  }

 private:
  void Prune() REQUIRES(mu_) {
    while (!queue_.empty()) {
      auto front = queue_.front().lock();
      if (front && front->waiting()) break;
      queue_.pop_front();
    }
  }

  Mutex mu_;
  std::deque<std::weak_ptr<T>> queue_ GUARDED_BY(mu_);
};

}  // namespace psd

#endif  // PSD_COMMON_BASE_WAITING_QUEUE_H_
