// psd_bench's measurements and report: what each worker measured (WorkerStats), the async/ssp
// measured window, and the report made of them — summarized (Summarize), printed as a table or
// as one JSON object. psd_bench.cc runs the workers and fills these.
#ifndef PSD_BENCH_BENCH_REPORT_H_
#define PSD_BENCH_BENCH_REPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "bench_util.h"
#include "psclient/client.h"

namespace psd_bench {

// What one worker measured (the measured phase only, unless named warmup_*).
struct WorkerStats {
  std::vector<double> step_ms;
  std::vector<double> pull_ms;
  std::vector<double> push_ms;  // with --fused: push + token wait, one round trip
  std::vector<double> wait_ms;  // token waits (empty with --fused)
  uint64_t pushed_bytes = 0;
  uint64_t pulled_bytes = 0;
  int64_t pushed_rows = 0;  // --sparse
  int64_t pulled_rows = 0;  // --sparse
  int64_t accepted = 0;
  int64_t stale = 0;
  int64_t warmup_stale = 0;
  int64_t pushes = 0;         // measured pushes (one per iteration)
  int64_t staleness_sum = 0;  // over measured pushes: the largest staleness of the push's results
  int64_t staleness_max = 0;
  int64_t retries = 0;          // --retry-s: steps retried after psd was unavailable (measured or not)
  double longest_stall_ms = 0;  // from a step's first such failure to its completion
  double measured_s = 0;
  bool shared_memory = false;  // every shard's connection moved tensors through shared memory
  bool lane = false;           // ... and its frames through a shared-memory lane
  int64_t first_step = 0;      // sync: global step when the measured phase began (worker 0 only)
  int64_t last_step = 0;       // sync: global step when it ended (worker 0 only)
  psclient::JobConfig job;
};

// Async/ssp: the measured window shared by all workers. Written by the worker that completes the
// start rendezvous (before anyone is released) and by the last worker to finish; read by main
// after the threads are joined.
struct Window {
  Clock::time_point start;
  Clock::time_point end;
  int64_t first_step = 0;
  int64_t last_step = 0;
};

struct Report {
  std::string build_type;
  bool ndebug = false;
  bool build_warning = false;
  std::string daemon;  // in-process, connect
  std::string endpoint;
  int io_threads = -1;           // unknown with --connect
  std::string mode;              // sync, async, ssp (as the daemon announced it)
  int64_t staleness_bound = -1;  // ssp only
  std::string optimizer;
  double learning_rate = 0;
  int slots = 0;  // optimizer slots per variable on the daemon
  int replicas_to_aggregate = 0;
  int total_replicas = 0;
  int workers = 0;
  bool sparse = false;
  uint64_t model_bytes = 0;
  int variables = 0;
  int64_t embedding_rows = 0, embedding_dim = 0, batch_rows = 0;
  double zipf = 0;  // the rows' Zipf exponent (0: uniform)
  int warmup = 0;
  int steps = 0;
  bool fused = false;
  bool pull_in_push = false;
  psd::DType grad_dtype = psd::DType::kFloat32;
  int shards = 1;
  int shm_workers = 0;          // workers whose every connection used shared memory
  int lane_workers = 0;         // ... and a shared-memory lane for its frames
  bool shared_buffers = false;  // ... with their tensors in shared buffers (--shared-buffers)
  double wall_s = 0;
  int64_t global_steps = 0;
  double steps_per_s = 0;
  double step_p50 = 0, step_p99 = 0;
  double push_gbps = 0, pull_gbps = 0;
  double push_rows_per_s = 0, pull_rows_per_s = 0;
  double push_p50 = 0, push_p99 = 0;
  double wait_p50 = 0, wait_p99 = 0;
  double pull_p50 = 0, pull_p99 = 0;
  int64_t accepted = 0, stale = 0, warmup_stale = 0;
  double staleness_mean = 0;
  int64_t staleness_max = 0;
  int64_t retries = 0;          // --retry-s: steps retried, all workers
  double longest_stall_ms = 0;  // the longest of them, first failure to completion
};

// True for sync (or a daemon that announced no mode).
bool IsSync(const std::string& mode);
// The report of a run of `opt`: worker 0's steps (sync) or the shared window (async/ssp), every
// worker's latencies and bytes. Sorts the workers' samples in place.
Report Summarize(const Options& opt, const Window& window, std::vector<WorkerStats>& stats);
// One JSON object on stdout (--json).
void PrintJson(const Report& r);
// The human table on stdout, after `build_warning_line` if any.
void PrintTable(const Report& r, const std::string& build_warning_line);

}  // namespace psd_bench

#endif  // PSD_BENCH_BENCH_REPORT_H_
