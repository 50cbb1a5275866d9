#include "core/worker_registry.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace psd::server {

WorkerRegistry::WorkerRegistry(int replicas_to_aggregate, int total_replicas)
    : replicas_to_aggregate_(replicas_to_aggregate),
      backups_(std::max(0, total_replicas - replicas_to_aggregate)),
      total_(std::max(total_replicas, replicas_to_aggregate)),
      job_(total_replicas > 0 ? total_replicas : std::max(total_replicas, replicas_to_aggregate)) {}

Result<uint32_t> WorkerRegistry::Hello(uint64_t conn, const std::string& name, uint64_t incarnation, uint64_t* replaced,
                                       bool* took_slot) {
  MutexLock lock(&mu_);
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = workers_[i];
    if (w.name != name) continue;
    if (w.conn != 0 && w.conn != conn) {
      if (incarnation != 0 && w.incarnation != 0 && incarnation < w.incarnation) {
        return FailedPrecondition("worker '" + name + "' is connected from a newer process (incarnation " +
                                  std::to_string(w.incarnation) + " > " + std::to_string(incarnation) +
                                  "): two trainers share this name; give each its own "
                                  "(ClientOptions::worker_name, default worker-<pid>)");
      }
      spdlog::warn("worker '{}' reconnected (incarnation {} -> {}); closing its old connection", name, w.incarnation,
                   incarnation);
      if (replaced != nullptr) *replaced = w.conn;
    }
    if (w.lost) spdlog::info("worker '{}' is back", name);
    // A new process of a finished worker joins again; the same one (a client reconnecting to read
    // values, say) stays finished: the others do not wait for its gradients.
    if (incarnation != w.incarnation) w.finished = false;
    w.conn = conn;
    w.incarnation = incarnation;
    w.lost = false;
    return static_cast<uint32_t>(i);
  }
  if (static_cast<int>(workers_.size()) < total_) {
    workers_.push_back({name, incarnation, conn, false, false, 0});
    return static_cast<uint32_t>(workers_.size() - 1);
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = workers_[i];
    if (!w.lost) continue;
    spdlog::warn("worker '{}' takes the slot of worker '{}', lost (gone past --worker-grace-s)", name, w.name);
    w = Worker{name, incarnation, conn, false, false, 0};
    if (took_slot != nullptr) *took_slot = true;
    return static_cast<uint32_t>(i);
  }
  int connected = 0, finished = 0;
  std::string names;
  for (const Worker& w : workers_) {
    connected += w.conn != 0 ? 1 : 0;
    finished += w.finished ? 1 : 0;
    names += (names.empty() ? "" : ", ") + w.name;
  }
  int gone = static_cast<int>(workers_.size()) - connected - finished;
  return ResourceExhausted("psd runs a job of N=" + std::to_string(total_) + " workers (-R " +
                           std::to_string(replicas_to_aggregate_) + " -B " + std::to_string(backups_) + ") and all " +
                           std::to_string(total_) + " slots are taken (" + names + ": " + std::to_string(connected) +
                           " connected, " + std::to_string(finished) + " finished, " + std::to_string(gone) +
                           " disconnected within --worker-grace-s): worker '" + name +
                           "' is refused; raise --total-replicas/-B (on every shard) or stop a worker");
}

std::optional<std::pair<uint32_t, uint64_t>> WorkerRegistry::Disconnected(uint64_t conn) {
  MutexLock lock(&mu_);
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = workers_[i];
    if (w.conn != conn) continue;
    w.conn = 0;
    ++w.disconnects;
    if (w.finished) return std::nullopt;
    spdlog::warn("worker '{}' disconnected without finishing", w.name);
    return std::make_pair(static_cast<uint32_t>(i), w.disconnects);
  }
  return std::nullopt;
}

std::optional<std::string> WorkerRegistry::MarkLostIfStillGone(uint32_t index, uint64_t generation) {
  MutexLock lock(&mu_);
  if (index >= workers_.size()) return std::nullopt;
  Worker& w = workers_[index];
  if (w.conn != 0 || w.finished || w.lost || w.disconnects != generation) return std::nullopt;
  w.lost = true;
  return w.name;
}

bool WorkerRegistry::Finished(uint64_t conn) {
  MutexLock lock(&mu_);
  for (Worker& w : workers_) {
    if (w.conn == conn) w.finished = true;
  }
  return AllFinishedLocked();
}

bool WorkerRegistry::AllFinishedLocked() const {
  // Not before all N workers have said hello: a slow starter would find the job over. (N, not the
  // slots: with -R above -N, N workers finish the job.)
  if (static_cast<int>(workers_.size()) < job_) return false;
  bool any_finished = false;
  for (const Worker& w : workers_) {
    if (!w.finished && !w.lost) return false;
    any_finished = any_finished || w.finished;
  }
  return any_finished;
}

const WorkerRegistry::Worker* WorkerRegistry::ChiefLocked() const {
  for (const Worker& w : workers_) {
    if (w.conn != 0 && !w.finished) return &w;
  }
  return nullptr;
}

bool WorkerRegistry::IsChief(uint64_t conn) const {
  MutexLock lock(&mu_);
  const Worker* chief = ChiefLocked();
  return chief != nullptr && chief->conn == conn;
}

int64_t WorkerRegistry::IndexOf(uint64_t conn) const {
  MutexLock lock(&mu_);
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (workers_[i].conn == conn) return static_cast<int64_t>(i);
  }
  return -1;
}

std::vector<std::string> WorkerRegistry::Names() const {
  MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const Worker& w : workers_) out.push_back(w.name);
  return out;
}

bool WorkerRegistry::AllFinished() const {
  MutexLock lock(&mu_);
  return AllFinishedLocked();
}

bool WorkerRegistry::AllGone() const {
  MutexLock lock(&mu_);
  return static_cast<int>(workers_.size()) >= job_ && !workers_.empty() &&
         std::all_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.finished || w.lost; });
}

bool WorkerRegistry::IsFinished(uint32_t index) const {
  MutexLock lock(&mu_);
  return index < workers_.size() && workers_[index].finished;
}

bool WorkerRegistry::AnyLost() const {
  MutexLock lock(&mu_);
  return std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.lost; });
}

int WorkerRegistry::RequiredReplicas() const {
  MutexLock lock(&mu_);
  int finished = static_cast<int>(
      std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) { return w.finished || w.lost; }));
  return std::max(1, replicas_to_aggregate_ - std::max(0, finished - backups_));
}

WorkerCounts WorkerRegistry::Counts() const {
  MutexLock lock(&mu_);
  WorkerCounts c;
  for (const Worker& w : workers_) {
    if (w.conn != 0) ++c.connected;
    if (w.finished) ++c.finished;
    if (w.lost) ++c.lost;
  }
  return c;
}

std::vector<WorkerInfo> WorkerRegistry::Snapshot() const {
  MutexLock lock(&mu_);
  const Worker* chief = ChiefLocked();
  std::vector<WorkerInfo> out;
  out.reserve(workers_.size());
  for (const Worker& w : workers_) out.push_back({w.name, w.conn != 0, w.finished, w.lost, &w == chief});
  return out;
}

}  // namespace psd::server
