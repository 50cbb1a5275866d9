#include "sync/worker_registry.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace psd::server {

WorkerRegistry::WorkerRegistry(int replicas_to_aggregate, int total_replicas)
    : replicas_to_aggregate_(replicas_to_aggregate), backups_(std::max(0, total_replicas - replicas_to_aggregate)) {}

uint32_t WorkerRegistry::Hello(uint64_t conn, const std::string& name, uint64_t incarnation) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = workers_[i];
    if (w.name != name) continue;
    if (w.conn != 0 && w.conn != conn) {
      spdlog::warn("worker '{}' reconnected (incarnation {} -> {}); dropping its old connection", name, w.incarnation,
                   incarnation);
    }
    w.conn = conn;
    w.incarnation = incarnation;
    w.finished = false;
    return static_cast<uint32_t>(i);
  }
  workers_.push_back({name, incarnation, conn, false});
  return static_cast<uint32_t>(workers_.size() - 1);
}

void WorkerRegistry::Disconnected(uint64_t conn) {
  std::lock_guard<std::mutex> lock(mu_);
  for (Worker& w : workers_) {
    if (w.conn == conn) {
      w.conn = 0;
      if (!w.finished) spdlog::warn("worker '{}' disconnected without finishing", w.name);
    }
  }
}

bool WorkerRegistry::Finished(uint64_t conn) {
  std::lock_guard<std::mutex> lock(mu_);
  for (Worker& w : workers_) {
    if (w.conn == conn) w.finished = true;
  }
  return std::all_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.finished; });
}

const WorkerRegistry::Worker* WorkerRegistry::ChiefLocked() const {
  for (const Worker& w : workers_) {
    if (w.conn != 0 && !w.finished) return &w;
  }
  return nullptr;
}

bool WorkerRegistry::IsChief(uint64_t conn) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Worker* chief = ChiefLocked();
  return chief != nullptr && chief->conn == conn;
}

int64_t WorkerRegistry::IndexOf(uint64_t conn) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (workers_[i].conn == conn) return static_cast<int64_t>(i);
  }
  return -1;
}

bool WorkerRegistry::AllFinished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !workers_.empty() && std::all_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.finished; });
}

int WorkerRegistry::RequiredReplicas() const {
  std::lock_guard<std::mutex> lock(mu_);
  int finished =
      static_cast<int>(std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) { return w.finished; }));
  return std::max(1, replicas_to_aggregate_ - std::max(0, finished - backups_));
}

WorkerCounts WorkerRegistry::Counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  WorkerCounts c;
  c.known = static_cast<int>(workers_.size());
  for (const Worker& w : workers_) {
    if (w.conn != 0) ++c.connected;
    if (w.finished) ++c.finished;
  }
  return c;
}

}  // namespace psd::server
