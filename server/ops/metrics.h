// Metrics: the daemon's instruments for operators — counters, histograms and per-worker figures
// that the request paths record into, and the step-rate history the status page draws. Rendered
// in Prometheus' text exposition format by ops/text_format.h and as JSON by the ops service.
//
// Thread-safety: every method may be called from any thread. Counters and histogram buckets are
// relaxed atomics (the hot path never takes a lock for them); the per-worker table and the step
// history each have one small mutex, taken once per push / per sample.
#ifndef PSD_SERVER_OPS_METRICS_H_
#define PSD_SERVER_OPS_METRICS_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "base/mutex.h"

namespace psd::server::ops {

// A fixed-bucket histogram (Prometheus semantics: `bounds` are the inclusive upper bounds of the
// buckets, in increasing order; an implicit +Inf bucket follows).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  void Observe(double value);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // bounds.size() + 1 entries; the last is the +Inf bucket = count
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Read() const;

 private:
  const std::vector<double> bounds_;
  std::vector<std::atomic<uint64_t>> counts_;  // per bucket (not cumulative), bounds_.size() + 1
  std::atomic<double> sum_{0};
};

// Latency buckets in seconds, 100 µs .. 60 s.
std::vector<double> SecondsBuckets();

// What one worker did, by its index in the worker registry (stable per name).
struct WorkerFigures {
  uint64_t pushes_accepted = 0;  // gradients accepted (one per variable of a push)
  uint64_t pushes_stale = 0;     // gradients dropped as stale
  int64_t last_local_step = -1;  // the local step of its newest push (-1: none yet)
  int64_t last_staleness = 0;    // global step - local step at its newest push
  int64_t max_staleness = 0;
  double last_seen_unix_s = 0;  // its newest request (0: none)
  uint64_t requests = 0;
};

class Metrics {
 public:
  Metrics();

  // --- recorded by the request paths ------------------------------------------------------
  void OnBytesIn(uint64_t n) { bytes_in_.fetch_add(n, std::memory_order_relaxed); }
  void OnBytesOut(uint64_t n) { bytes_out_.fetch_add(n, std::memory_order_relaxed); }
  // Tensor bytes read from or written to workers' shared memory (README "Same-host shared memory").
  void OnShmBytes(uint64_t n) { shm_bytes_.fetch_add(n, std::memory_order_relaxed); }
  // A same-host worker's connection moved its frames to a shared-memory lane (Request.useLane).
  void OnLaneUsed() { lanes_.fetch_add(1, std::memory_order_relaxed); }
  // Value bytes pulled by same-host workers straight from the values segment (nothing written).
  void OnValuesInPlaceBytes(uint64_t n) { values_in_place_bytes_.fetch_add(n, std::memory_order_relaxed); }
  // Replication (README "Shard replicas"): copies of shard state sent to and taken from other
  // shards (serialized bytes), and what this shard keeps in memory: its own copies and its
  // predecessor's (the newest own copy shares its buffers with the engine).
  void OnReplicaSent(uint64_t n) { replica_sent_.fetch_add(n, std::memory_order_relaxed); }
  void OnReplicaReceived(uint64_t n) { replica_received_.fetch_add(n, std::memory_order_relaxed); }
  // A copy that came as a difference, rebuilt here: replayed in place over the storage of a copy
  // let go, or (no chain of differences from that copy) from a copy of its base.
  void OnReplicaRebuilt(bool replayed) {
    (replayed ? replica_replayed_ : replica_from_base_).fetch_add(1, std::memory_order_relaxed);
  }
  // An own copy's block hashes made from the lists of changes, checked against its bytes' own
  // (every 16th copy): `unlisted`, a write no list named (a bug; the copy went whole).
  void OnReplicaAudit(bool unlisted) {
    replica_audits_.fetch_add(1, std::memory_order_relaxed);
    if (unlisted) replica_unlisted_.fetch_add(1, std::memory_order_relaxed);
  }
  void SetReplicaKept(uint64_t own, uint64_t held) {
    replica_own_.store(own, std::memory_order_relaxed);
    replica_held_.store(held, std::memory_order_relaxed);
  }
  // Takeover (README "Shard replicas"): stand-ins this shard started for its predecessor, and
  // whether one runs now.
  void OnStandInStarted() {
    stand_ins_started_.fetch_add(1, std::memory_order_relaxed);
    stand_in_running_.store(true, std::memory_order_relaxed);
  }
  void OnStandInStopped() { stand_in_running_.store(false, std::memory_order_relaxed); }
  void OnConnectionAccepted() { connections_accepted_.fetch_add(1, std::memory_order_relaxed); }
  void OnConnectionRefused() { connections_refused_.fetch_add(1, std::memory_order_relaxed); }
  // A connection closed because its frame did not arrive within --frame-timeout-ms.
  void OnFrameTimeout() { frame_timeouts_.fetch_add(1, std::memory_order_relaxed); }
  void OnReadsPaused() { reads_paused_.fetch_add(1, std::memory_order_relaxed); }
  // A request from worker `worker` (its registry index).
  void OnWorkerRequest(uint32_t worker);
  // Another worker took index `worker` (the one before was lost): its figures start over.
  void ResetWorker(uint32_t worker);
  // A push of `accepted` + `stale` gradients tagged `local_step`; `staleness` = global - local.
  void OnPush(uint32_t worker, int64_t local_step, int accepted, int stale, int64_t staleness);
  // A committed global step that used min..max gradients per variable.
  void OnStepCommitted(int64_t step, int min_gradients, int max_gradients, bool forced);
  void OnTokenWait(double seconds) { token_wait_seconds_.Observe(seconds); }
  void OnApply(double seconds) { apply_seconds_.Observe(seconds); }
  void OnCheckpointWritten(int64_t step, double seconds, uint64_t bytes);
  void OnCheckpointFailed() { checkpoints_failed_.fetch_add(1, std::memory_order_relaxed); }
  void OnRestored(int64_t step, double seconds, uint64_t bytes);

  // --- step-rate history (sampled once a second by the ops service) -----------------------
  struct Sample {
    double unix_s;
    int64_t step;
  };
  void AddSample(double unix_s, int64_t step);
  // Oldest first; at most kHistory samples.
  std::vector<Sample> History() const;
  // Steps per second over the last `window_s` seconds of samples (0 with fewer than two).
  double StepRate(double window_s) const;
  static constexpr size_t kHistory = 600;

  // --- read by the renderers ---------------------------------------------------------------
  uint64_t bytes_in() const { return bytes_in_.load(std::memory_order_relaxed); }
  uint64_t bytes_out() const { return bytes_out_.load(std::memory_order_relaxed); }
  uint64_t shm_bytes() const { return shm_bytes_.load(std::memory_order_relaxed); }
  uint64_t lanes() const { return lanes_.load(std::memory_order_relaxed); }
  uint64_t values_in_place_bytes() const { return values_in_place_bytes_.load(std::memory_order_relaxed); }
  uint64_t replica_sent() const { return replica_sent_.load(std::memory_order_relaxed); }
  uint64_t replica_received() const { return replica_received_.load(std::memory_order_relaxed); }
  uint64_t replica_replayed() const { return replica_replayed_.load(std::memory_order_relaxed); }
  uint64_t replica_from_base() const { return replica_from_base_.load(std::memory_order_relaxed); }
  uint64_t replica_audits() const { return replica_audits_.load(std::memory_order_relaxed); }
  uint64_t replica_unlisted() const { return replica_unlisted_.load(std::memory_order_relaxed); }
  uint64_t replica_own() const { return replica_own_.load(std::memory_order_relaxed); }
  uint64_t replica_held() const { return replica_held_.load(std::memory_order_relaxed); }
  uint64_t stand_ins_started() const { return stand_ins_started_.load(std::memory_order_relaxed); }
  bool stand_in_running() const { return stand_in_running_.load(std::memory_order_relaxed); }
  uint64_t connections_accepted() const { return connections_accepted_.load(std::memory_order_relaxed); }
  uint64_t connections_refused() const { return connections_refused_.load(std::memory_order_relaxed); }
  uint64_t frame_timeouts() const { return frame_timeouts_.load(std::memory_order_relaxed); }
  uint64_t reads_paused() const { return reads_paused_.load(std::memory_order_relaxed); }
  uint64_t steps_forced() const { return steps_forced_.load(std::memory_order_relaxed); }
  int last_step_min_gradients() const { return last_min_gradients_.load(std::memory_order_relaxed); }
  int last_step_max_gradients() const { return last_max_gradients_.load(std::memory_order_relaxed); }
  uint64_t gradients_used() const { return gradients_used_.load(std::memory_order_relaxed); }
  const Histogram& step_seconds() const { return step_seconds_; }
  const Histogram& token_wait_seconds() const { return token_wait_seconds_; }
  const Histogram& apply_seconds() const { return apply_seconds_; }
  const Histogram& checkpoint_write_seconds() const { return checkpoint_write_seconds_; }

  struct CheckpointFigures {
    int64_t last_step = -1;
    double last_seconds = 0;
    uint64_t last_bytes = 0;
    double last_unix_s = 0;
    uint64_t written = 0;
    uint64_t failed = 0;
    int64_t restored_step = -1;  // -1: started without a restore
    double restore_seconds = 0;
    uint64_t restore_bytes = 0;
  };
  CheckpointFigures Checkpoints() const;
  // Indexed by worker registry index; workers never seen have default figures.
  std::vector<WorkerFigures> Workers() const;

 private:
  WorkerFigures& WorkerLocked(uint32_t worker) REQUIRES(mu_);

  std::atomic<uint64_t> bytes_in_{0}, bytes_out_{0}, shm_bytes_{0}, values_in_place_bytes_{0}, lanes_{0};
  std::atomic<uint64_t> replica_sent_{0}, replica_received_{0}, replica_own_{0}, replica_held_{0};
  std::atomic<uint64_t> replica_replayed_{0}, replica_from_base_{0};
  std::atomic<uint64_t> replica_audits_{0}, replica_unlisted_{0};
  std::atomic<uint64_t> stand_ins_started_{0};
  std::atomic<bool> stand_in_running_{false};
  std::atomic<uint64_t> connections_accepted_{0}, connections_refused_{0}, frame_timeouts_{0}, reads_paused_{0};
  std::atomic<uint64_t> steps_forced_{0}, gradients_used_{0};
  std::atomic<int> last_min_gradients_{0}, last_max_gradients_{0};
  std::atomic<uint64_t> checkpoints_failed_{0};
  Histogram step_seconds_;
  Histogram token_wait_seconds_;
  Histogram apply_seconds_;
  Histogram checkpoint_write_seconds_;

  mutable Mutex mu_;
  std::vector<WorkerFigures> workers_ GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point last_commit_ GUARDED_BY(mu_);
  bool committed_once_ GUARDED_BY(mu_) = false;
  CheckpointFigures checkpoints_ GUARDED_BY(mu_);
  std::deque<Sample> history_ GUARDED_BY(mu_);
};

// Seconds since the Unix epoch (wall clock), for "last seen" and the history's time axis.
double UnixNow();

}  // namespace psd::server::ops

#endif  // PSD_SERVER_OPS_METRICS_H_
