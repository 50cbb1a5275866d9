#include "bench_report.h"

#include <cinttypes>
#include <cmath>
#include <cstdio>

namespace psd_bench {

bool IsSync(const std::string& mode) { return mode.empty() || mode == "sync"; }

Report Summarize(const Options& opt, const Window& window, std::vector<WorkerStats>& stats) {
  Report r;
  WorkerStats& w0 = stats[0];
  r.workers = opt.workers;
  for (const WorkerStats& w : stats) {
    r.shm_workers += w.shared_memory ? 1 : 0;
    r.lane_workers += w.shared_memory && w.lane ? 1 : 0;
  }
  r.sparse = opt.sparse;
  r.model_bytes = opt.sparse ? 0 : opt.model_bytes;
  r.variables = opt.sparse ? 1 : opt.variables;
  r.embedding_rows = opt.embedding_rows;
  r.embedding_dim = opt.embedding_dim;
  r.batch_rows = opt.batch_rows;
  r.zipf = opt.zipf;
  r.warmup = opt.warmup;
  r.steps = opt.steps;
  r.fused = opt.fused;
  r.shared_buffers = opt.shared_buffers;
  r.pull_in_push = opt.pull_in_push;
  r.grad_dtype = opt.grad_dtype;
  r.mode = w0.job.mode.empty() ? "sync" : w0.job.mode;
  r.staleness_bound = r.mode == "ssp" ? w0.job.staleness_bound : -1;
  r.optimizer = w0.job.optimizer;
  r.learning_rate = w0.job.learning_rate;
  r.slots = static_cast<int>(w0.job.slot_names.size());
  r.replicas_to_aggregate = w0.job.replicas_to_aggregate;
  r.total_replicas = w0.job.total_replicas;
  if (IsSync(r.mode)) {
    r.wall_s = w0.measured_s;
    r.global_steps = w0.last_step - w0.first_step;
  } else {
    r.wall_s = std::chrono::duration<double>(window.end - window.start).count();
    r.global_steps = window.last_step - window.first_step;
  }
  r.steps_per_s = r.wall_s > 0 ? static_cast<double>(r.global_steps) / r.wall_s : NAN;
  std::vector<double> step = w0.step_ms;
  r.step_p50 = Percentile(step, 50);
  r.step_p99 = Percentile(step, 99);
  std::vector<double> push, wait, pull;
  uint64_t pushed = 0, pulled = 0;
  int64_t pushed_rows = 0, pulled_rows = 0, pushes = 0, staleness_sum = 0;
  for (const WorkerStats& s : stats) {
    push.insert(push.end(), s.push_ms.begin(), s.push_ms.end());
    wait.insert(wait.end(), s.wait_ms.begin(), s.wait_ms.end());
    pull.insert(pull.end(), s.pull_ms.begin(), s.pull_ms.end());
    pushed += s.pushed_bytes;
    pulled += s.pulled_bytes;
    pushed_rows += s.pushed_rows;
    pulled_rows += s.pulled_rows;
    r.accepted += s.accepted;
    r.stale += s.stale;
    r.warmup_stale += s.warmup_stale;
    pushes += s.pushes;
    staleness_sum += s.staleness_sum;
    r.staleness_max = std::max(r.staleness_max, s.staleness_max);
    r.retries += s.retries;
    r.longest_stall_ms = std::max(r.longest_stall_ms, s.longest_stall_ms);
  }
  r.staleness_mean = pushes > 0 ? static_cast<double>(staleness_sum) / static_cast<double>(pushes) : NAN;
  r.push_gbps = r.wall_s > 0 ? static_cast<double>(pushed) / r.wall_s / 1e9 : NAN;
  r.pull_gbps = r.wall_s > 0 ? static_cast<double>(pulled) / r.wall_s / 1e9 : NAN;
  r.push_rows_per_s = r.wall_s > 0 ? static_cast<double>(pushed_rows) / r.wall_s : NAN;
  r.pull_rows_per_s = r.wall_s > 0 ? static_cast<double>(pulled_rows) / r.wall_s : NAN;
  r.push_p50 = Percentile(push, 50);
  r.push_p99 = Percentile(push, 99);
  r.wait_p50 = Percentile(wait, 50);
  r.wait_p99 = Percentile(wait, 99);
  r.pull_p50 = Percentile(pull, 50);
  r.pull_p99 = Percentile(pull, 99);
  return r;
}

void PrintJson(const Report& r) {
  std::string o = "{";
  auto field = [&o](const char* name, const std::string& value) {
    if (o.size() > 1) o += ", ";
    o += "\"";
    o += name;
    o += "\": ";
    o += value;
  };
  auto integer = [](int64_t v) { return std::to_string(v); };
  auto boolean = [](bool v) { return std::string(v ? "true" : "false"); };
  const std::string null = "null";
  const bool sync = IsSync(r.mode);
  field("tool", JsonString("psd_bench"));
  field("build_type", JsonString(r.build_type));
  field("ndebug", boolean(r.ndebug));
  field("build_warning", boolean(r.build_warning));
  field("daemon", JsonString(r.daemon));
  field("endpoint", JsonString(r.endpoint));
  field("io_threads", r.io_threads < 0 ? null : integer(r.io_threads));
  field("mode", JsonString(r.mode));
  field("staleness_bound", r.staleness_bound < 0 ? null : integer(r.staleness_bound));
  field("optimizer", JsonString(r.optimizer));
  field("learning_rate", JsonNumber(r.learning_rate));
  field("optimizer_slots", integer(r.slots));
  field("replicas_to_aggregate", sync ? integer(r.replicas_to_aggregate) : null);
  field("total_replicas", sync ? integer(r.total_replicas) : null);
  field("workers", integer(r.workers));
  field("workload", JsonString(r.sparse ? "sparse" : "dense"));
  field("model_bytes", r.sparse ? null : std::to_string(r.model_bytes));
  field("variables", integer(r.variables));
  field("embedding_rows", r.sparse ? integer(r.embedding_rows) : null);
  field("embedding_dim", r.sparse ? integer(r.embedding_dim) : null);
  field("batch_rows", r.sparse ? integer(r.batch_rows) : null);
  field("zipf", r.sparse ? JsonNumber(r.zipf) : null);
  field("warmup", integer(r.warmup));
  field("steps", integer(r.steps));
  field("stop_rule", JsonString(sync ? "global_steps" : "iterations_per_worker"));
  field("fused", boolean(r.fused));
  field("pull_in_push", boolean(r.pull_in_push));
  field("wall_s", JsonNumber(r.wall_s));
  field("global_steps", integer(r.global_steps));
  field("steps_per_s", JsonNumber(r.steps_per_s));
  field("step_ms_p50", JsonNumber(r.step_p50));
  field("step_ms_p99", JsonNumber(r.step_p99));
  field("shards", std::to_string(r.shards));
  field("shared_memory_workers", integer(r.shm_workers));
  field("shared_memory_lane_workers", integer(r.lane_workers));
  field("shared_buffers", boolean(r.shared_buffers));
  field("grad_dtype", JsonString(psd::DTypeName(r.grad_dtype)));
  field("push_gb_per_s", JsonNumber(r.push_gbps));
  field("pull_gb_per_s", JsonNumber(r.pull_gbps));
  field("process_cpu_s", JsonNumber(ProcessCpuSeconds()));
  field("push_rows_per_s", r.sparse ? JsonNumber(r.push_rows_per_s) : null);
  field("pull_rows_per_s", r.sparse ? JsonNumber(r.pull_rows_per_s) : null);
  if (r.fused) {
    field("push_token_ms_p50", JsonNumber(r.push_p50));
    field("push_token_ms_p99", JsonNumber(r.push_p99));
  } else {
    field("push_ms_p50", JsonNumber(r.push_p50));
    field("push_ms_p99", JsonNumber(r.push_p99));
    field("token_wait_ms_p50", JsonNumber(r.wait_p50));
    field("token_wait_ms_p99", JsonNumber(r.wait_p99));
  }
  field("pull_ms_p50", JsonNumber(r.pull_p50));
  field("pull_ms_p99", JsonNumber(r.pull_p99));
  field("accepted", integer(r.accepted));
  field("stale", integer(r.stale));
  field("warmup_stale", integer(r.warmup_stale));
  field("staleness_mean", JsonNumber(r.staleness_mean));
  field("staleness_max", integer(r.staleness_max));
  field("retries", integer(r.retries));
  field("longest_stall_ms", JsonNumber(r.longest_stall_ms));
  o += "}";
  std::printf("%s\n", o.c_str());
}

void PrintTable(const Report& r, const std::string& build_warning_line) {
  const bool sync = IsSync(r.mode);
  if (!build_warning_line.empty()) std::printf("%s\n", build_warning_line.c_str());
  std::printf("psd_bench  build %s%s\n", r.build_type.empty() ? "(unknown)" : r.build_type.c_str(),
              r.ndebug ? " (NDEBUG)" : " (assertions on)");
  std::printf("psd        %s %s", r.daemon.c_str(), r.endpoint.c_str());
  if (r.io_threads >= 0) std::printf(", %d I/O threads", r.io_threads);
  std::printf("\n");
  std::printf("mode       %s", r.mode.c_str());
  if (sync) {
    std::printf(" (R=%d of N=%d; the barrier is the token queue)\n", r.replicas_to_aggregate, r.total_replicas);
  } else if (r.mode == "ssp") {
    std::printf(" (staleness bound %" PRId64 "; the barrier waits for the slowest worker)\n", r.staleness_bound);
  } else {
    std::printf(" (every push applied on arrival; the token wait returns at once)\n");
  }
  std::printf("optimizer  %s, learning rate %g, %d slot(s) per variable on the daemon\n", r.optimizer.c_str(),
              r.learning_rate, r.slots);
  if (r.sparse) {
    const double var_mib = static_cast<double>(r.embedding_rows) * static_cast<double>(r.embedding_dim) * 4 / (1 << 20);
    std::printf(
        "workload   sparse: float32 embedding %" PRId64 " x %" PRId64 " (%.1f MiB, %.1f MiB with slots), %" PRId64
        " distinct rows per batch (%s): PullRows, gradient, SparseGradient push\n",
        r.embedding_rows, r.embedding_dim, var_mib, var_mib * (1 + r.slots), r.batch_rows, RowsDrawn(r.zipf).c_str());
  } else {
    std::printf("workload   dense: model %" PRIu64 " bytes (%.2f MiB) in %d float32 variable(s)%s\n", r.model_bytes,
                static_cast<double>(r.model_bytes) / (1 << 20), r.variables,
                r.grad_dtype == psd::DType::kFloat32
                    ? ""
                    : (std::string(", gradients pushed and values pulled as ") + psd::DTypeName(r.grad_dtype)).c_str());
  }
  std::printf("run        %d workers, %d warmup + %d measured %s, %s\n", r.workers, r.warmup, r.steps,
              sync ? "global steps" : "iterations per worker",
              r.pull_in_push ? "push+token+next pull fused (1 round trip per step)"
              : r.fused      ? "fused push+token (1 round trip)"
                             : "push then token wait (2 round trips)");
  // The control path: every worker's frames in a shared-memory lane, or over TCP.
  const char* control = r.lane_workers == r.workers ? "frames in a shared-memory lane, TCP open beside it"
                        : r.lane_workers == 0       ? "TCP (control)"
                                                    : "frames in a lane for some workers, over TCP for others";
  std::printf("transport  %s%s\n",
              r.shm_workers == r.workers && r.shared_buffers
                  ? "same-host shared buffers (tensors read and written in place), "
              : r.shm_workers == r.workers ? "same-host shared memory (tensors), "
              : r.shm_workers == 0         ? "TCP"
                                           : "mixed: some workers on shared memory, some on TCP",
              r.shm_workers == r.workers ? control : "");
  std::printf("\n");
  std::printf("  %-22s %12s %12s %14s\n", "", "p50 ms", "p99 ms", "GB/s");
  std::printf("  %-22s %12.3f %12.3f %14s\n", "step (worker 0)", r.step_p50, r.step_p99, "");
  std::printf("  %-22s %12.3f %12.3f %14.3f\n", r.sparse ? "pull rows" : "pull", r.pull_p50, r.pull_p99, r.pull_gbps);
  if (r.fused) {
    std::printf("  %-22s %12.3f %12.3f %14.3f\n", "push+token (fused)", r.push_p50, r.push_p99, r.push_gbps);
  } else {
    std::printf("  %-22s %12.3f %12.3f %14.3f\n", "push", r.push_p50, r.push_p99, r.push_gbps);
    std::printf("  %-22s %12.3f %12.3f %14s\n", "token wait", r.wait_p50, r.wait_p99, "");
  }
  std::printf("\n");
  if (sync) {
    std::printf("  steps/s                %.2f  (%" PRId64 " global steps in %.4g s, worker 0)\n", r.steps_per_s,
                r.global_steps, r.wall_s);
  } else {
    std::printf("  steps/s                %.2f  (%" PRId64 " global steps = applied pushes, all workers, in %.4g s)\n",
                r.steps_per_s, r.global_steps, r.wall_s);
  }
  if (r.sparse) {
    std::printf("  rows/s                 %.0f pushed, %.0f pulled (all workers)\n", r.push_rows_per_s,
                r.pull_rows_per_s);
  }
  std::printf("  cpu                    %.3f s user+system, this process (warmup and setup included)\n",
              ProcessCpuSeconds());
  std::printf("  gradients              %" PRId64 " accepted, %" PRId64 " stale (measured; %" PRId64
              " stale in warmup)\n",
              r.accepted, r.stale, r.warmup_stale);
  std::printf("  staleness              mean %.2f, max %" PRId64 " (global step - local step at each push)\n",
              r.staleness_mean, r.staleness_max);
  if (r.retries > 0) {
    std::printf("  retries                %" PRId64
                " steps retried while psd was unavailable (a shard lost, re-forming); "
                "longest stall %.1f ms\n",
                r.retries, r.longest_stall_ms);
  }
  std::printf("  latencies are over all workers' calls; GB/s = bytes moved by all workers / %s (GB = 1e9 B%s)\n",
              sync ? "worker 0's wall time" : "the measured window", r.sparse ? "; values + int64 indices" : "");
}

}  // namespace psd_bench
