#include "ops/metrics.h"

#include <algorithm>

namespace psd::server::ops {

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1) {}

void Histogram::Observe(double value) {
  // Buckets are few (≈ 20): a linear scan beats a binary search's branches here.
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.bounds = bounds_;
  s.cumulative.resize(counts_.size());
  uint64_t running = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    s.cumulative[i] = running;
  }
  s.count = running;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

std::vector<double> SecondsBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

double UnixNow() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

Metrics::Metrics()
    : step_seconds_(SecondsBuckets()),
      token_wait_seconds_(SecondsBuckets()),
      apply_seconds_(SecondsBuckets()),
      checkpoint_write_seconds_({0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}) {}

WorkerFigures& Metrics::WorkerLocked(uint32_t worker) {
  // Indices are dense (the registry hands them out in hello order), so a vector suffices.
  if (worker >= workers_.size()) workers_.resize(worker + 1);
  return workers_[worker];
}

void Metrics::OnWorkerRequest(uint32_t worker) {
  double now = UnixNow();
  MutexLock lock(&mu_);
  WorkerFigures& w = WorkerLocked(worker);
  w.last_seen_unix_s = now;
  ++w.requests;
}

void Metrics::ResetWorker(uint32_t worker) {
  MutexLock lock(&mu_);
  WorkerLocked(worker) = WorkerFigures{};
}

void Metrics::OnPush(uint32_t worker, int64_t local_step, int accepted, int stale, int64_t staleness) {
  MutexLock lock(&mu_);
  WorkerFigures& w = WorkerLocked(worker);
  w.pushes_accepted += static_cast<uint64_t>(accepted);
  w.pushes_stale += static_cast<uint64_t>(stale);
  w.last_local_step = local_step;
  w.last_staleness = staleness;
  w.max_staleness = std::max(w.max_staleness, staleness);
}

void Metrics::OnStepCommitted(int64_t /*step*/, int min_gradients, int max_gradients, bool forced) {
  auto now = std::chrono::steady_clock::now();
  last_min_gradients_.store(min_gradients, std::memory_order_relaxed);
  last_max_gradients_.store(max_gradients, std::memory_order_relaxed);
  gradients_used_.fetch_add(static_cast<uint64_t>(std::max(0, min_gradients)), std::memory_order_relaxed);
  if (forced) steps_forced_.fetch_add(1, std::memory_order_relaxed);
  double seconds = -1;
  {
    MutexLock lock(&mu_);
    if (committed_once_) seconds = std::chrono::duration<double>(now - last_commit_).count();
    committed_once_ = true;
    last_commit_ = now;
  }
  // The first commit has no previous one to measure from.
  if (seconds >= 0) step_seconds_.Observe(seconds);
}

void Metrics::OnCheckpointWritten(int64_t step, double seconds, uint64_t bytes) {
  checkpoint_write_seconds_.Observe(seconds);
  MutexLock lock(&mu_);
  checkpoints_.last_step = step;
  checkpoints_.last_seconds = seconds;
  checkpoints_.last_bytes = bytes;
  checkpoints_.last_unix_s = UnixNow();
  ++checkpoints_.written;
}

void Metrics::OnRestored(int64_t step, double seconds, uint64_t bytes) {
  MutexLock lock(&mu_);
  checkpoints_.restored_step = step;
  checkpoints_.restore_seconds = seconds;
  checkpoints_.restore_bytes = bytes;
}

Metrics::CheckpointFigures Metrics::Checkpoints() const {
  MutexLock lock(&mu_);
  CheckpointFigures c = checkpoints_;
  c.failed = checkpoints_failed_.load(std::memory_order_relaxed);
  return c;
}

std::vector<WorkerFigures> Metrics::Workers() const {
  MutexLock lock(&mu_);
  return workers_;
}

void Metrics::AddSample(double unix_s, int64_t step) {
  MutexLock lock(&mu_);
  history_.push_back({unix_s, step});
  while (history_.size() > kHistory) history_.pop_front();
}

std::vector<Metrics::Sample> Metrics::History() const {
  MutexLock lock(&mu_);
  return {history_.begin(), history_.end()};
}

double Metrics::StepRate(double window_s) const {
  MutexLock lock(&mu_);
  if (history_.size() < 2) return 0;
  const Sample& last = history_.back();
  const Sample* first = &history_.front();
  for (auto it = history_.rbegin(); it != history_.rend(); ++it) {
    if (last.unix_s - it->unix_s > window_s) break;
    first = &*it;
  }
  double dt = last.unix_s - first->unix_s;
  if (dt <= 0) return 0;
  // A restore can move the step back: the rate is then 0, not negative.
  return std::max(0.0, static_cast<double>(last.step - first->step) / dt);
}

}  // namespace psd::server::ops
