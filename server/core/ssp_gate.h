// SspGate: bounded staleness (stale synchronous parallel, as in Bosen/Angel). Every worker has a
// clock that advances by one at each of its barrier calls; a worker whose clock would be more than
// `bound` ahead of the slowest live worker waits (a parked callback, never a thread) until the
// slowest catches up. Finished or disconnected workers do not hold anyone back.
//
// Thread-safety: one internal mutex; callbacks run outside it, on the thread that released them.
#ifndef PSD_SERVER_CORE_SSP_GATE_H_
#define PSD_SERVER_CORE_SSP_GATE_H_

#include <cstdint>
#include <functional>
#include <list>
#include <map>

#include "base/mutex.h"
#include "core/parked_waits.h"
#include "psd/status.h"

namespace psd::server {

class SspGate {
 public:
  using Callback = std::function<void(Status status, int64_t clock)>;
  using WaitId = uint64_t;

  explicit SspGate(int64_t bound) : bound_(bound) {}

  // Adds a live worker (or revives one) at clock max(current, slowest live clock).
  void Join(uint32_t worker) EXCLUDES(mu_);
  // The worker is finished or gone: it no longer holds others back.
  void Leave(uint32_t worker) EXCLUDES(mu_);

  // Advances `worker`'s clock and calls back with the new clock once it is within the bound
  // (at once, returning 0, or later, returning an id for Cancel).
  WaitId Advance(uint32_t worker, Callback cb) EXCLUDES(mu_);
  bool Cancel(WaitId id, const Status& why) EXCLUDES(mu_);
  // Fails every parked wait with `why` (each clock step given back, as Cancel does), leaving the
  // gate open: a cluster that stopped serving answers its waiters now, not at their deadlines.
  void FailWaiters(const Status& why) EXCLUDES(mu_);
  void Close(Status why) EXCLUDES(mu_);

  int64_t MinClock() const EXCLUDES(mu_);
  int64_t Clock(uint32_t worker) const EXCLUDES(mu_);

 private:
  int64_t MinClockLocked() const REQUIRES(mu_);
  // Releases the waits now within the bound, unlocks, then runs their callbacks.
  void ReleaseLocked(MutexLock& lock) RELEASE(mu_);

  const int64_t bound_;
  mutable Mutex mu_;
  std::map<uint32_t, int64_t> clocks_ GUARDED_BY(mu_);  // live workers only
  std::map<uint32_t, int64_t> left_ GUARDED_BY(mu_);    // clocks of workers that left
  ParkedWaits<uint32_t> parked_ GUARDED_BY(mu_);        // keyed by worker
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_SSP_GATE_H_
