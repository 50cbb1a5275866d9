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
#include <mutex>

#include "psd/status.h"
#include "core/parked_waits.h"

namespace psd::server {

class SspGate {
 public:
  using Callback = std::function<void(Status status, int64_t clock)>;
  using WaitId = uint64_t;

  explicit SspGate(int64_t bound) : bound_(bound) {}

  // Adds a live worker (or revives one) at clock max(current, slowest live clock).
  void Join(uint32_t worker);
  // The worker is finished or gone: it no longer holds others back.
  void Leave(uint32_t worker);

  // Advances `worker`'s clock and calls back with the new clock once it is within the bound
  // (at once, returning 0, or later, returning an id for Cancel).
  WaitId Advance(uint32_t worker, Callback cb);
  bool Cancel(WaitId id, const Status& why);
  void Close(Status why);

  int64_t MinClock() const;
  int64_t Clock(uint32_t worker) const;

 private:
  int64_t MinClockLocked() const;
  void ReleaseLocked(std::unique_lock<std::mutex>& lock);

  const int64_t bound_;
  mutable std::mutex mu_;
  std::map<uint32_t, int64_t> clocks_;  // guarded by mu_: live workers only
  std::map<uint32_t, int64_t> left_;    // guarded by mu_: clocks of workers that left
  ParkedWaits<uint32_t> parked_;        // guarded by mu_: keyed by worker
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_SSP_GATE_H_
