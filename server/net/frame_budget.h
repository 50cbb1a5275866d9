// FrameBudget: the daemon-wide bound on memory held by incoming frames (--max-inflight-bytes).
//
// A connection acquires a frame's body size before it allocates the body and releases it once
// the request has been handled. When the budget is spent the connection waits (its socket is not
// read, so TCP pushes back on the sender) instead of failing: real workers see backpressure, not
// errors. Waiters are granted strictly first come, first served, so a big frame is never starved
// by a stream of small ones. A frame bigger than the whole budget (up to --max-frame-bytes, which
// may exceed it) is granted alone: once it is first in line and nothing else is held. So the
// daemon holds at most max(budget, one frame) for frames, and every waiter is eventually granted
// once the frames ahead of it have been handled or their connections closed (--frame-timeout-ms
// bounds how long a slow sender may hold its share).
//
// Thread-safety: every method may be called from any thread (one mutex). Grants run their
// callback outside the lock, on the thread that released the bytes or on the caller's thread;
// callers post to their own executor from the callback.
#ifndef PSD_SERVER_NET_FRAME_BUDGET_H_
#define PSD_SERVER_NET_FRAME_BUDGET_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>

#include "base/mutex.h"

namespace psd::server {

class FrameBudget {
 public:
  explicit FrameBudget(uint64_t limit_bytes) : limit_(limit_bytes) {}
  FrameBudget(const FrameBudget&) = delete;
  FrameBudget& operator=(const FrameBudget&) = delete;

  // Takes `bytes` and calls `granted` once they are held: at once when they fit (or, more than
  // limit(), when nothing is held) and nobody waits ahead, otherwise when enough has been released. The caller owns the
  // bytes from then on and must Release() them exactly once, even if it no longer needs them.
  void Acquire(uint64_t bytes, std::function<void()> granted) EXCLUDES(mu_);
  void Release(uint64_t bytes) EXCLUDES(mu_);

  // Bytes held but idle (a connection's buffer kept for its next frame) are offered back: when an
  // Acquire has to wait, every offer's `reclaim` runs once (outside the lock) and its holder
  // releases what it still does not use. Without this, workers whose pushes are in and who wait
  // for a token would keep the budget the last worker's push needs to complete the step. Returns
  // false (nothing registered) when someone waits already: release now instead. `holder` is
  // unique per holder; an offer is replaced by the holder's next one and ended by Withdraw.
  bool OfferIdle(uint64_t holder, std::function<void()> reclaim) EXCLUDES(mu_);
  void Withdraw(uint64_t holder) EXCLUDES(mu_);

  uint64_t limit() const { return limit_; }
  uint64_t in_use() const;
  uint64_t peak() const;   // the most ever held at once (above limit() only by one frame held alone)
  uint64_t waits() const;  // acquisitions that had to wait
  size_t waiting() const;  // acquisitions waiting now

 private:
  struct Waiter {
    uint64_t bytes;
    std::function<void()> granted;
  };
  // Moves the waiters that now fit (in order) to `ready`.
  void GrantLocked(std::deque<Waiter>* ready) REQUIRES(mu_);
  // `bytes` may be granted now: they fit, or, more than the limit, nothing else is held.
  bool FitsLocked(uint64_t bytes) const REQUIRES(mu_) {
    return in_use_ + bytes <= limit_ || (bytes > limit_ && in_use_ == 0);
  }

  const uint64_t limit_;
  mutable Mutex mu_;
  uint64_t in_use_ GUARDED_BY(mu_) = 0;
  uint64_t peak_ GUARDED_BY(mu_) = 0;
  uint64_t waits_ GUARDED_BY(mu_) = 0;
  std::deque<Waiter> waiters_ GUARDED_BY(mu_);                      // first come, first served
  std::map<uint64_t, std::function<void()>> idle_ GUARDED_BY(mu_);  // OfferIdle's, by holder
};

}  // namespace psd::server

#endif  // PSD_SERVER_NET_FRAME_BUDGET_H_
