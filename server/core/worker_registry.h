// WorkerRegistry: which workers are connected, which one is the chief, which have finished.
//
// The chief is the connected, unfinished worker that said hello first; when it disconnects or
// finishes, the next one in hello order becomes chief (workers learn it from the isChief field
// of their next reply). A worker is identified by name; a reconnect with the same name
// replaces the old connection (its incarnation is logged).
//
// Slots: the job has N = total_replicas workers (README "Worker limit"). A known name is always
// admitted (a reconnect or a restart). A new name gets a free slot while fewer than N workers are
// known; otherwise it takes over the slot of a lost worker (gone past the grace period: a
// replacement); otherwise it is refused with RESOURCE_EXHAUSTED naming -N/-B. A finished
// worker keeps its slot (it declared its part of the job done), so the registry never holds more
// than N workers.
//
// Finishing: when a worker declares itself finished, the number of fresh gradients a step
// needs shrinks once the backups are used up: required = max(1, R - max(0, finished - B)), so
// the remaining workers never wait for gradients that cannot come (TF hung here, #20342).
// A worker that disconnected without finishing and did not come back within the server's grace
// period is "lost": it counts like a finished one for the requirement (the others stop waiting
// for its gradients; TF hung here, #5022) and for the end of the job, until it comes back.
// When every known worker has finished (or is lost, with at least one finished), training is over.
//
// Thread-safety: all methods lock one internal mutex.
#ifndef PSD_SERVER_CORE_WORKER_REGISTRY_H_
#define PSD_SERVER_CORE_WORKER_REGISTRY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "psd/status.h"

namespace psd::server {

struct WorkerCounts {
  int connected = 0;
  int finished = 0;
  int lost = 0;
};

// One worker as operators see it (WorkerRegistry::Snapshot).
struct WorkerInfo {
  std::string name;
  bool connected = false;
  bool finished = false;
  bool lost = false;
  bool chief = false;
};

class WorkerRegistry {
 public:
  WorkerRegistry(int replicas_to_aggregate, int total_replicas);

  // Registers `conn` as worker `name`. Returns the worker's index (stable per name; a replacement
  // takes the lost worker's index), or RESOURCE_EXHAUSTED when the job's N slots are taken. A name
  // whose connection is still open is taken over by the same process or a newer one (a greater
  // incarnation): *replaced is then the old connection, which the caller closes (two connections
  // never count as one worker); an older process is refused (FAILED_PRECONDITION: two trainers
  // share a name). A worker that finished stays finished when its own process says hello again.
  // *took_slot: a new name took the slot of a lost worker (what was recorded of that index was
  // the other worker's).
  Result<uint32_t> Hello(uint64_t conn, const std::string& name, uint64_t incarnation, uint64_t* replaced = nullptr,
                         bool* took_slot = nullptr);
  // Returns the worker's index and disconnect generation if it left without finishing.
  std::optional<std::pair<uint32_t, uint64_t>> Disconnected(uint64_t conn);
  // Marks worker `index` lost if it is still gone since disconnect `generation`. Returns its name
  // when it did.
  std::optional<std::string> MarkLostIfStillGone(uint32_t index, uint64_t generation);
  // Marks the worker on `conn` finished. Returns true when every known worker has finished.
  bool Finished(uint64_t conn);

  bool IsChief(uint64_t conn) const;
  // The index of the worker on `conn`, or -1.
  int64_t IndexOf(uint64_t conn) const;
  bool AllFinished() const;
  // All N workers said hello, and each finished or was lost (gone past the grace period): a job
  // whose workers all gave up (--exit-when-done ends it too).
  bool AllGone() const;
  // Some worker is lost (gone past the grace period, and may yet come back).
  bool AnyLost() const;
  // Worker `index` has finished (and, saying hello again from its own process, stays so).
  bool IsFinished(uint32_t index) const;
  // Workers' names in first-hello order (the index is the worker's id).
  std::vector<std::string> Names() const;
  // Fresh gradients a step needs given how many workers have finished.
  int RequiredReplicas() const;
  WorkerCounts Counts() const;
  // Every worker ever seen, by index (first-hello order).
  std::vector<WorkerInfo> Snapshot() const;

 private:
  struct Worker {
    std::string name;
    uint64_t incarnation = 0;
    uint64_t conn = 0;  // 0: not connected
    bool finished = false;
    bool lost = false;
    uint64_t disconnects = 0;
  };
  const Worker* ChiefLocked() const REQUIRES(mu_);
  bool AllFinishedLocked() const REQUIRES(mu_);

  const int replicas_to_aggregate_;
  const int backups_;
  const int total_;  // slots: the larger of N and R
  const int job_;    // N: the workers that say hello before the job can be over
  mutable Mutex mu_;
  std::vector<Worker> workers_ GUARDED_BY(mu_);  // in first-hello order
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_WORKER_REGISTRY_H_
