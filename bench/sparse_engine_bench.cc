// psd_bench --sparse --engine-only: a sparse step in the daemon's training engine alone.
#include <spdlog/spdlog.h>

#include <cinttypes>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

#include "bench_util.h"
#include "config/server_config.h"
#include "core/optimizer.h"
#include "core/training_engine.h"
#include "workloads.h"

namespace psd_bench {

// Each step, every worker's sparse gradient (--batch-rows distinct rows of the --embedding-rows x
// --embedding-dim float32 table, sampled as --sparse's workers sample them) is pushed into a sync
// engine (R = N = --workers) in turn from this one thread; the last push takes the step and the
// optimizer applies it. No network, no client: what a sparse step costs the daemon itself, and
// how that grows with the number of workers whose rows it accumulates. The rows are sampled
// before the step's clock starts.
int RunSparseEngineBench(const Options& opt) {
  namespace srv = psd::server;
  const int workers = opt.workers;
  if (opt.batch_rows > opt.embedding_rows) {
    std::fprintf(stderr, "psd_bench: --batch-rows is more than --embedding-rows\n");
    return 1;
  }
  srv::ServerConfig config;
  config.replicas_to_aggregate = workers;
  config.total_replicas = workers;
  config.init_tokens = 0;
  config.optimizer.name = opt.optimizer;
  config.optimizer.learning_rate = opt.learning_rate;
  if (Status s = config.Validate(); !s.ok()) {
    std::fprintf(stderr, "psd_bench: %s\n", s.message().c_str());
    return 1;
  }
  auto optimizer = srv::MakeOptimizer(config.optimizer);
  if (!optimizer.ok()) {
    std::fprintf(stderr, "psd_bench: --optimizer: %s\n", optimizer.status().message().c_str());
    return 1;
  }
  srv::TrainingEngine engine(config, std::move(*optimizer));
  srv::VariableDef def;
  def.name = kEmbeddingName;
  def.shape = {opt.embedding_rows, opt.embedding_dim};
  if (auto made = engine.CreateVariable(def); !made.ok()) {
    std::fprintf(stderr, "psd_bench: %s\n", made.status().message().c_str());
    return 1;
  }
  struct Worker {
    std::mt19937_64 rng;
    std::vector<int64_t> rows;
    std::vector<float> grad;
  };
  std::vector<Worker> w(static_cast<size_t>(workers));
  for (int i = 0; i < workers; ++i) {
    w[i].rng.seed(opt.seed + static_cast<uint64_t>(i));
    w[i].grad.assign(static_cast<size_t>(opt.batch_rows * opt.embedding_dim), 1e-3f * static_cast<float>(i + 1));
  }
  std::unordered_set<int64_t> chosen;
  std::vector<double> step_ms;
  std::vector<srv::GradOutcome> out;
  const auto start = Clock::now();
  double measured_ms = 0;
  for (int step = 0; step < opt.warmup + opt.steps; ++step) {
    for (Worker& each : w) SampleRows(opt.embedding_rows, opt.batch_rows, each.rng, &chosen, &each.rows);
    const auto t0 = Clock::now();
    for (Worker& each : w) {
      srv::GradRef g{kEmbeddingName,
                     psd::DType::kFloat32,
                     {opt.batch_rows, opt.embedding_dim},
                     each.grad.data(),
                     each.grad.size() * sizeof(float)};
      g.indices = each.rows.data();
      g.nnz = opt.batch_rows;
      Status s = engine.Push(step, {g}, &out);
      if (!s.ok() || out.empty() || !out[0].accepted) {
        std::fprintf(stderr, "psd_bench: push at step %d: %s\n", step,
                     s.ok() ? "not accepted (stale)" : s.ToString().c_str());
        return 1;
      }
    }
    const double ms = Ms(Clock::now() - t0);
    if (step >= opt.warmup) {
      step_ms.push_back(ms);
      measured_ms += ms;
    }
  }
  if (engine.global_step() != opt.warmup + opt.steps) {
    std::fprintf(stderr, "psd_bench: the engine is at step %" PRId64 " after %d steps\n", engine.global_step(),
                 opt.warmup + opt.steps);
    return 1;
  }
  const double rows = static_cast<double>(workers) * static_cast<double>(opt.batch_rows) * opt.steps;
  const double p50 = Percentile(step_ms, 50), p99 = Percentile(step_ms, 99);
  std::printf("psd_bench  build %s, engine only (no network, one thread)\n", PSD_BUILD_TYPE);
  std::printf("workload   sparse: float32 embedding %" PRId64 " x %" PRId64 ", %d workers x %" PRId64
              " distinct rows a step, sync R=N=%d, optimizer %s\n",
              opt.embedding_rows, opt.embedding_dim, workers, opt.batch_rows, workers, opt.optimizer.c_str());
  std::printf(
      "step       p50 %.3f ms, p99 %.3f ms (%d pushes, the take and the apply; %d measured of %d, %.1f s "
      "in all)\n",
      p50, p99, workers, opt.steps, opt.warmup + opt.steps, Ms(Clock::now() - start) / 1e3);
  std::printf("rows/s     %.0f accumulated and applied\n", rows / (measured_ms / 1e3));
  return 0;
}

}  // namespace psd_bench
