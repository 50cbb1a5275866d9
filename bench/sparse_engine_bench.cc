// psd_bench --sparse --engine-only: a sparse step in the daemon's training engine alone.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "base/scope_exit.h"
#include "bench_util.h"
#include "config/server_config.h"
#include "core/optimizer.h"
#include "core/sparse_accumulator.h"
#include "core/training_engine.h"
#include "psd/cores.h"
#include "workloads.h"

namespace psd_bench {

// Each step, every worker's sparse gradient (--batch-rows distinct rows of the --embedding-rows x
// --embedding-dim float32 table, sampled as --sparse's workers sample them) is pushed into a sync
// engine (R = N = --workers) by --threads pushing threads (as psd's I/O threads push what they
// received; worker i from thread i mod T, one after the other); the last push takes the step and
// the optimizer applies it. No network, no client: what a sparse step costs the daemon itself, and
// how that grows with the number of workers whose rows it accumulates. The rows are sampled before
// the step's clock starts.
namespace {

// The engine both benches push into (R = N = --workers, --threads as psd's I/O threads), with the
// --embedding-rows x --embedding-dim table and, in async, a small dense "probe" variable of
// `probe_elements`; null, said on stderr, when the flags do not make one.
std::unique_ptr<psd::server::TrainingEngine> MakeBenchEngine(const Options& opt, psd::server::Mode mode,
                                                             int64_t probe_elements) {
  namespace srv = psd::server;
  if (opt.batch_rows > opt.embedding_rows) {
    std::fprintf(stderr, "psd_bench: --batch-rows is more than --embedding-rows\n");
    return nullptr;
  }
  srv::ServerConfig config;
  config.mode = mode;
  config.replicas_to_aggregate = opt.workers;
  config.total_replicas = opt.workers;
  if (mode == srv::Mode::kSync) config.init_tokens = 0;
  config.io_threads = opt.io_threads;  // the pushing threads, as psd's I/O threads
  config.optimizer.name = opt.optimizer;
  config.optimizer.learning_rate = opt.learning_rate;
  if (Status s = config.Validate(); !s.ok()) {
    std::fprintf(stderr, "psd_bench: %s\n", s.message().c_str());
    return nullptr;
  }
  auto optimizer = srv::MakeOptimizer(config.optimizer);
  if (!optimizer.ok()) {
    std::fprintf(stderr, "psd_bench: --optimizer: %s\n", optimizer.status().message().c_str());
    return nullptr;
  }
  auto engine = std::make_unique<srv::TrainingEngine>(config, std::move(*optimizer));
  std::vector<srv::VariableDef> defs(probe_elements > 0 ? 2 : 1);
  defs[0].name = kEmbeddingName;
  defs[0].shape = {opt.embedding_rows, opt.embedding_dim};
  if (probe_elements > 0) {
    defs[1].name = "probe";
    defs[1].shape = {probe_elements};
  }
  for (const srv::VariableDef& def : defs) {
    if (auto made = engine->CreateVariable(def); !made.ok()) {
      std::fprintf(stderr, "psd_bench: %s\n", made.status().message().c_str());
      return nullptr;
    }
  }
  return engine;
}

}  // namespace

int RunSparseEngineBench(const Options& opt) {
  namespace srv = psd::server;
  const int workers = opt.workers;
  std::unique_ptr<srv::TrainingEngine> made = MakeBenchEngine(opt, srv::Mode::kSync, 0);
  if (!made) return 1;
  srv::TrainingEngine& engine = *made;
  struct Worker {
    RowSampler sampler;
    std::vector<int64_t> rows;
    std::vector<float> grad;
  };
  std::vector<Worker> w;
  w.reserve(static_cast<size_t>(workers));
  for (int i = 0; i < workers; ++i) {
    w.push_back(
        {RowSampler(opt.embedding_rows, opt.batch_rows, opt.zipf, opt.seed + static_cast<uint64_t>(i)), {}, {}});
    w[i].grad.assign(static_cast<size_t>(opt.batch_rows * opt.embedding_dim), 1e-3f * static_cast<float>(i + 1));
  }
  std::vector<double> step_ms;
  const int threads = std::min(workers, psd::ThreadsOrCores(opt.io_threads));
  int step = 0;
  std::mutex failed_mu;
  std::string failed;  // the first push that failed, guarded by failed_mu
  // Each step: the pushing threads and this one meet at `begin` once the rows are sampled, and at
  // `end` once every push returned.
  std::barrier begin(threads + 1), end(threads + 1);
  std::atomic<bool> stop{false};
  auto push_some = [&](int t) {
    std::vector<srv::GradOutcome> out;
    for (;;) {
      begin.arrive_and_wait();
      if (stop.load()) return;
      for (int i = t; i < workers; i += threads) {
        srv::GradRef g{kEmbeddingName,
                       psd::DType::kFloat32,
                       {opt.batch_rows, opt.embedding_dim},
                       w[i].grad.data(),
                       w[i].grad.size() * sizeof(float)};
        g.indices = w[i].rows.data();
        g.nnz = opt.batch_rows;
        Status s = engine.Push(step, {g}, &out);
        if (!s.ok() || out.empty() || !out[0].accepted) {
          std::lock_guard<std::mutex> lock(failed_mu);
          if (failed.empty()) failed = s.ok() ? "not accepted (stale)" : s.ToString();
        }
      }
      end.arrive_and_wait();
    }
  };
  // How evenly a push's rows spread over the accumulator's stripes (each with its own lock: the
  // rows of one stripe are added one push at a time): the largest stripe's share of each push's
  // rows, with the rows dealt in coarse and in fine granules (the daemon deals the next step's
  // rows in fine ones once a step's crowd a coarse stripe), and, for comparison, in contiguous
  // index ranges of as many stripes.
  const int64_t stripes =
      srv::SparseAccumulator(psd::DType::kFloat32, {opt.embedding_rows, 1}, srv::Reduction::kSum, 0).num_stripes();
  const int64_t range_rows = (opt.embedding_rows + stripes - 1) / stripes;
  std::array<double, 3> largest{};  // coarse granules, fine ones, ranges: the shares summed
  std::vector<int64_t> in(static_cast<size_t>(stripes));
  auto count_shares = [&](const std::vector<int64_t>& rows) {
    for (size_t layout = 0; layout < largest.size(); ++layout) {
      std::fill(in.begin(), in.end(), 0);
      for (int64_t r : rows) {
        const int64_t s =
            layout == 2 ? r / range_rows
                        : srv::SparseAccumulator::StripeOf(r, stripes,
                                                           layout == 0 ? srv::SparseAccumulator::kCoarseGranuleRows
                                                                       : srv::SparseAccumulator::kFineGranuleRows);
        ++in[static_cast<size_t>(s)];
      }
      largest[layout] +=
          static_cast<double>(*std::max_element(in.begin(), in.end())) / static_cast<double>(rows.size());
    }
  };
  std::vector<std::thread> pushers;
  for (int t = 0; t < threads; ++t) pushers.emplace_back(push_some, t);
  const auto start = Clock::now();
  double measured_ms = 0;
  int rc = 0;
  for (; step < opt.warmup + opt.steps; ++step) {
    for (Worker& each : w) {
      each.sampler.Next(&each.rows);
      if (step >= opt.warmup) count_shares(each.rows);
    }
    const auto t0 = Clock::now();
    begin.arrive_and_wait();
    end.arrive_and_wait();
    const double ms = Ms(Clock::now() - t0);
    if (!failed.empty()) {  // the pushers are waiting at `begin`: failed_mu is not needed
      std::fprintf(stderr, "psd_bench: push at step %d: %s\n", step, failed.c_str());
      rc = 1;
      break;
    }
    if (step >= opt.warmup) {
      step_ms.push_back(ms);
      measured_ms += ms;
    }
  }
  stop.store(true);
  begin.arrive_and_wait();
  for (std::thread& t : pushers) t.join();
  if (rc != 0) return rc;
  if (engine.global_step() != opt.warmup + opt.steps) {
    std::fprintf(stderr, "psd_bench: the engine is at step %" PRId64 " after %d steps\n", engine.global_step(),
                 opt.warmup + opt.steps);
    return 1;
  }
  const double rows = static_cast<double>(workers) * static_cast<double>(opt.batch_rows) * opt.steps;
  const double p50 = Percentile(step_ms, 50), p99 = Percentile(step_ms, 99);
  std::printf("psd_bench  build %s, engine only (no network), %d pushing thread(s)\n", PSD_BUILD_TYPE, threads);
  std::printf("workload   sparse: float32 embedding %" PRId64 " x %" PRId64 ", %d workers x %" PRId64
              " distinct rows a step (%s), sync R=N=%d, optimizer %s\n",
              opt.embedding_rows, opt.embedding_dim, workers, opt.batch_rows, RowsDrawn(opt.zipf).c_str(), workers,
              opt.optimizer.c_str());
  std::printf(
      "step       p50 %.3f ms, p99 %.3f ms (%d pushes, the take and the apply; %d measured of %d, %.1f s "
      "in all)\n",
      p50, p99, workers, opt.steps, opt.warmup + opt.steps, Ms(Clock::now() - start) / 1e3);
  std::printf("rows/s     %.0f accumulated and applied\n", rows / (measured_ms / 1e3));
  const double pushes = static_cast<double>(workers) * opt.steps;
  int64_t uniform_rows = 0;
  for (const Worker& each : w) uniform_rows += each.sampler.filled_uniformly();
  if (uniform_rows > 0) {
    std::printf("rows       %" PRId64 " drawn uniformly: --zipf %g gave too few distinct rows in %" PRId64
                " draws a batch\n",
                uniform_rows, opt.zipf, 64 * opt.batch_rows);
  }
  std::printf("stripes    %" PRId64 ": the largest one held %.1f%% of a push's rows on average dealt %" PRId64
              " rows at a time, %.1f%% dealt %" PRId64 " at a time (%.1f%% were they contiguous index ranges)\n",
              stripes, 100 * largest[0] / pushes, srv::SparseAccumulator::kCoarseGranuleRows, 100 * largest[1] / pushes,
              srv::SparseAccumulator::kFineGranuleRows, 100 * largest[2] / pushes);
  return 0;
}

}  // namespace psd_bench

namespace psd_bench {

// --engine-only --mode async: the workers' sparse pushes applied on arrival by --threads pushing
// threads (worker i's from thread i mod T; each worker cycles through 8 batches sampled before the
// clock starts), while one more thread stands for the other requests psd serves meanwhile: every
// 100 us it pulls a small dense variable ("probe", 1024 float32) and pushes a gradient to it,
// each timed. What the table's updates cost the daemon, and whether requests for other variables
// wait for them (an update that held the engine's lock made every such request wait for it).
int RunSparseEngineAsyncBench(const Options& opt) {
  namespace srv = psd::server;
  const int workers = opt.workers;
  constexpr int64_t kProbeElements = 1024;
  std::unique_ptr<srv::TrainingEngine> made = MakeBenchEngine(opt, srv::Mode::kAsync, kProbeElements);
  if (!made) return 1;
  srv::TrainingEngine& engine = *made;
  constexpr int kBatches = 8;
  struct Worker {
    std::vector<std::vector<int64_t>> rows;
    std::vector<float> grad;
  };
  std::vector<Worker> w(static_cast<size_t>(workers));
  for (int i = 0; i < workers; ++i) {
    RowSampler sampler(opt.embedding_rows, opt.batch_rows, opt.zipf, opt.seed + static_cast<uint64_t>(i));
    w[i].rows.resize(kBatches);
    for (auto& batch : w[i].rows) sampler.Next(&batch);
    w[i].grad.assign(static_cast<size_t>(opt.batch_rows * opt.embedding_dim), 1e-3f * static_cast<float>(i + 1));
  }
  const int threads = std::min(workers, psd::ThreadsOrCores(opt.io_threads));
  const int pushes_each = opt.warmup + opt.steps;  // per worker
  std::mutex failed_mu;
  std::string failed;  // the first push or pull that failed, guarded by failed_mu
  auto fail = [&](const std::string& what) {
    std::lock_guard<std::mutex> lock(failed_mu);
    if (failed.empty()) failed = what;
  };
  std::atomic<int> warm{0};  // pushing threads past their warmup
  std::atomic<bool> done{false};
  std::atomic<int> finished{0};  // pushing threads done (or failed)
  auto push_some = [&](int t) {
    std::vector<srv::GradOutcome> out;
    psd::ScopeExit count_finished([&finished] { finished.fetch_add(1); });
    for (int k = 0; k < pushes_each; ++k) {
      if (k == opt.warmup) warm.fetch_add(1);
      for (int i = t; i < workers; i += threads) {
        const std::vector<int64_t>& rows = w[i].rows[static_cast<size_t>(k % kBatches)];
        srv::GradRef g{kEmbeddingName,
                       psd::DType::kFloat32,
                       {opt.batch_rows, opt.embedding_dim},
                       w[i].grad.data(),
                       w[i].grad.size() * sizeof(float)};
        g.indices = rows.data();
        g.nnz = opt.batch_rows;
        Status s = engine.Push(k, {g}, &out);
        if (!s.ok()) return fail("push: " + s.ToString());
      }
    }
  };
  std::vector<double> pull_us, push_us;
  auto probe_loop = [&] {
    std::vector<float> grad(kProbeElements, 1e-3f);
    std::vector<srv::PulledValue> got;
    std::vector<srv::GradOutcome> out;
    int64_t step = 0;
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      const bool measured = warm.load() == threads;
      auto t0 = Clock::now();
      Status s = engine.Pull({"probe"}, &got, &step);
      auto t1 = Clock::now();
      if (s.ok())
        s = engine.Push(
            step, {{"probe", psd::DType::kFloat32, {kProbeElements}, grad.data(), grad.size() * sizeof(float)}}, &out);
      auto t2 = Clock::now();
      got.clear();
      if (!s.ok()) return fail("probe: " + s.ToString());
      if (measured) {
        pull_us.push_back(Ms(t1 - t0) * 1e3);
        push_us.push_back(Ms(t2 - t1) * 1e3);
      }
    }
  };
  const auto start = Clock::now();
  std::thread prober(probe_loop);
  std::vector<std::thread> pushers;
  for (int t = 0; t < threads; ++t) pushers.emplace_back(push_some, t);
  // The measured part: from the last pushing thread's warmup to the last push.
  while (warm.load() < threads && finished.load() < threads) std::this_thread::sleep_for(std::chrono::microseconds(50));
  const auto measured_from = Clock::now();
  for (std::thread& t : pushers) t.join();
  const double measured_ms = Ms(Clock::now() - measured_from);
  done.store(true);
  prober.join();
  if (!failed.empty()) {
    std::fprintf(stderr, "psd_bench: %s\n", failed.c_str());
    return 1;
  }
  const double rows = static_cast<double>(workers) * static_cast<double>(opt.batch_rows) * opt.steps;
  std::printf("psd_bench  build %s, engine only (no network), %d pushing thread(s) + 1 probing\n", PSD_BUILD_TYPE,
              threads);
  std::printf("workload   sparse: float32 embedding %" PRId64 " x %" PRId64 ", %d workers x %" PRId64
              " distinct rows a push (%s), async, optimizer %s, %d pushes each\n",
              opt.embedding_rows, opt.embedding_dim, workers, opt.batch_rows, RowsDrawn(opt.zipf).c_str(),
              opt.optimizer.c_str(), pushes_each);
  std::printf("rows/s     %.0f applied (%d measured pushes each, %.1f s in all)\n", rows / (measured_ms / 1e3),
              opt.steps, Ms(Clock::now() - start) / 1e3);
  const size_t probes = pull_us.size();
  const double pull50 = Percentile(pull_us, 50), pull99 = Percentile(pull_us, 99);
  const double push50 = Percentile(push_us, 50), push99 = Percentile(push_us, 99);
  const double pull_max = pull_us.empty() ? 0 : pull_us.back(), push_max = push_us.empty() ? 0 : push_us.back();
  std::printf("probe      %zu pulls of another variable (4 KiB): p50 %.1f us, p99 %.1f us, max %.1f us\n", probes,
              pull50, pull99, pull_max);
  std::printf("probe      %zu pushes to it (applied): p50 %.1f us, p99 %.1f us, max %.1f us\n", probes, push50, push99,
              push_max);
  return 0;
}

}  // namespace psd_bench
