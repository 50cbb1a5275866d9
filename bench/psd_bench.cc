// psd_bench: measures psd's training step on loopback, the way a trainer drives it.
//
// W worker threads, each with its own psclient::Client (one connection each, as real workers have),
// run the trainer loop: pull, push a gradient tagged with the local step, wait for a token (the
// barrier), take the token as the new local step. By default the push and the token wait are two
// calls so their latencies can be told apart; --fused asks for the token in the push (one round
// trip, what a tuned trainer does).
//
// Workloads:
//  - dense (default): --model-bytes split into --variables float32 variables; every step pulls all
//    of them in one call and pushes a gradient for each.
//  - --sparse: one float32 embedding of --embedding-rows x --embedding-dim. Every step a worker
//    draws --batch-rows distinct rows (sampled without replacement from a per-worker RNG seeded
//    with --seed + worker index, sorted; uniformly, or by --zipf S: row r drawn with probability
//    proportional to 1 / (r + 1)^S until the batch's rows are distinct), pulls them with PullRows, computes a small
//    gradient from the pulled values (c + 0.01 * value) and pushes it as a SparseGradient (indices + values [rows,
//    dim]). Drawing the batch is outside the timed step; the gradient computation is inside.
//
// Consistency modes (--mode, in-process daemon; with --connect the daemon's mode, announced in the
// handshake, decides):
//  - sync: the barrier is the token queue. --warmup and --steps count global steps: all workers
//    start together after the chief created the variables, and each stops once its token reaches
//    the last step. (A fixed iteration count per worker could hang: a worker may take a token left
//    over from an earlier commit and do an extra iteration, and the others would then wait at the
//    end for a step nobody pushes.) steps/s is measured on worker 0.
//  - async / ssp (--staleness N): every push is applied on arrival and is one global step; the
//    token wait returns the global step at once (async) or after the bounded-staleness barrier
//    (ssp). There is no shared token queue, so the stopping rule is a fixed iteration count: each
//    worker does --warmup unmeasured then --steps measured iterations. The measured phase starts
//    together (a bench-side rendezvous after every worker's warmup; safe in ssp because the
//    workers still in warmup are the slowest and never wait) and ends when the last worker is
//    done; steps/s = global steps (= applied pushes, W x --steps) / that window.
//
// Sparse engine only (--sparse --engine-only): every worker's rows pushed straight into the
// daemon's training engine from --threads threads (see RunSparseEngineBench).
//
// Checkpoints (--checkpoint-bytes SIZE [--checkpoint-dir DIR]): instead of training, writes and
// restores one checkpoint of a SIZE model (see RunCheckpointBench); bench/checkpoint_vs_dd.sh puts
// it next to dd on the same directory.
//
// Figures: steps/s and step time (worker 0), bytes moved by all workers per second of the
// measured window (dense: tensor bytes; sparse: values plus int64 row indices), for --sparse rows
// pushed/pulled per second, per-call latency percentiles over all workers, accepted/stale
// gradients and the staleness (global step - local step) the daemon reported for each push.
// Compare against the raw-socket floor (bench/compare_floor.sh) in the same run: absolute times
// drift on shared machines, ratios much less.
//
// Every wait is bounded: token waits by --token-timeout-ms, setup by the same deadline, and the
// whole run by --timeout-s (a watchdog ends the process, since a blocked client read cannot be
// interrupted from outside). Errors are printed and the exit status is 1.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "bench_report.h"
#include "bench_util.h"
#include "config/server_config.h"
#include "daemon/server.h"
#include "psclient/client.h"
#include "psd/allocator.h"
#include "psd/cores.h"
#include "psd/listen_socket.h"
#include "workloads.h"

#ifndef PSD_BUILD_TYPE
#define PSD_BUILD_TYPE ""
#endif

namespace psd_bench {

// Shared between the worker threads and main: the first error, and how many workers have exited.
class RunState {
 public:
  void Fail(std::string message) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.exchange(true)) error_ = std::move(message);
    cv_.notify_all();
  }
  void Exited() {
    std::lock_guard<std::mutex> lock(mu_);
    ++exited_;
    cv_.notify_all();
  }
  // Blocks until `parties` workers arrived, each with the global step it saw; returns the largest
  // (the step everyone counts from), or -1 if the run failed meanwhile. Used once.
  int64_t StartTogether(int parties, int64_t step) {
    std::unique_lock<std::mutex> lock(mu_);
    start_step_ = std::max(start_step_, step);
    if (++arrived_ == parties) {
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return arrived_ >= parties || failed_.load(); });
    }
    return failed_.load() ? -1 : start_step_;
  }
  // Async/ssp: blocks until `parties` workers finished their warmup; the last to arrive runs
  // `on_last` (which opens the measured window) before anyone is released. Returns false if the
  // run failed meanwhile. Used once.
  bool MeasureTogether(int parties, const std::function<void()>& on_last) {
    std::unique_lock<std::mutex> lock(mu_);
    if (++measure_arrived_ == parties) {
      lock.unlock();
      on_last();  // may call Fail(), which takes mu_
      lock.lock();
      measure_released_ = true;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return measure_released_ || failed_.load(); });
    }
    return !failed_.load();
  }
  // Async/ssp: a worker finished its measured iterations; true for the last one.
  bool MeasuredDone(int parties) {
    std::lock_guard<std::mutex> lock(mu_);
    return ++measure_done_ == parties;
  }
  bool failed() const { return failed_.load(); }
  std::string error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  // Waits until every worker exited or one failed (stop_on_failure) or the deadline passed.
  // Returns whether all workers exited.
  bool WaitForExit(int workers, Clock::time_point deadline, bool stop_on_failure) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return exited_ == workers || (stop_on_failure && failed_.load()); });
    return exited_ == workers;
  }

  Window window;  // async/ssp; see Window

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> failed_{false};
  std::string error_;              // guarded by mu_
  int exited_ = 0;                 // guarded by mu_
  int arrived_ = 0;                // guarded by mu_
  int64_t start_step_ = 0;         // guarded by mu_
  int measure_arrived_ = 0;        // guarded by mu_
  bool measure_released_ = false;  // guarded by mu_
  int measure_done_ = 0;           // guarded by mu_
};

// "4096", "4K", "4M", "64M", "1G" (binary multiples; "KiB"/"MB" spellings accepted too).

// One worker: connect, (chief) create the variables, then warmup + measured steps.
void RunWorker(int index, const Options& opt, const Endpoint& ep, uint64_t frame_limit,
               const std::vector<VarSpec>& vars, RunState* state, WorkerStats* stats) {
  const std::string who = "bench-" + std::to_string(index);
  auto fail = [&](const std::string& what, const Status& s) { state->Fail(who + ": " + what + ": " + s.ToString()); };

  psclient::ClientOptions co;
  co.host = ep.host;
  co.port = ep.port;
  co.cluster = ep.cluster;
  co.worker_name = who;
  co.max_frame_bytes = std::max<uint64_t>(co.max_frame_bytes, frame_limit);
  co.push_frame_bytes = opt.push_frame_bytes;
  co.pull_frame_bytes = opt.pull_frame_bytes;
  co.busy_poll_us = opt.busy_poll_us;
  co.shared_memory_bytes = opt.shared_memory_bytes;
  co.shm_lane = opt.shm_lane != 0;
  co.shm_piece_bytes = opt.shm_piece_bytes;
  co.copy_threads = opt.copy_threads;
  // Room for one worker's gradients and values, and slack for the allocator's rounding.
  if (opt.shared_buffers) {
    const uint64_t data = opt.sparse ? 2 * static_cast<uint64_t>(opt.batch_rows * opt.embedding_dim) * sizeof(float)
                                     : 2 * opt.model_bytes;
    co.shared_buffer_bytes = data + (4ull << 20);
  }
  ApplyTls(opt, co);
  auto connected = psclient::Client::Connect(co);
  if (!connected.ok()) return fail("connect to " + ep.host + ":" + std::to_string(ep.port), connected.status());
  psclient::Client& c = **connected;
  stats->job = c.config();
  // The daemon's mode decides the loop (with --connect it may differ from --mode).
  const bool sync = c.config().mode.empty() || c.config().mode == "sync";
  // Fewer workers than the daemon needs per step would only end in token-wait timeouts.
  if (sync && c.config().replicas_to_aggregate > opt.workers) {
    state->Fail(who + ": psd needs " + std::to_string(c.config().replicas_to_aggregate) +
                " fresh gradients per step but the bench runs only " + std::to_string(opt.workers) +
                " workers; pass --workers " + std::to_string(c.config().replicas_to_aggregate) + " or more");
    return;
  }

  std::unique_ptr<Workload> work;
  if (opt.sparse) {
    auto sparse = std::make_unique<SparseWorkload>(index, opt, opt.shared_buffers ? &c : nullptr);
    if (!sparse->status().ok()) return fail("allocating the rows' buffers", sparse->status());
    work = std::move(sparse);
  } else {
    auto dense = std::make_unique<DenseWorkload>(index, vars, opt.pull_in_push, opt.grad_dtype,
                                                 opt.shared_buffers ? &c : nullptr);
    if (!dense->status().ok()) return fail("allocating the model's buffers", dense->status());
    work = std::move(dense);
  }

  // TF's chief creates the variables; the others wait for them by pulling until they exist.
  if (c.is_chief()) {
    Status s = work->Create(c);
    if (!s.ok()) return state->Fail(who + ": " + s.ToString());
  }
  const auto setup_deadline = Clock::now() + std::chrono::milliseconds(opt.token_timeout_ms);
  int64_t local_step = 0;
  for (;;) {
    auto pulled = work->FirstPull(c);
    if (pulled.ok()) {
      local_step = *pulled;  // TF: a worker's local step starts at the global step
      break;
    }
    if (pulled.status().code() != psd::Code::kNotFound) return fail("first pull", pulled.status());
    if (state->failed()) return;
    if (Clock::now() >= setup_deadline) {
      return fail("the variables did not appear within --token-timeout-ms " + std::to_string(opt.token_timeout_ms) +
                      " ms (is the chief a worker of another process?)",
                  pulled.status());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // Everyone starts together. A worker that started alone would not wait for the others: in sync
  // mode psd queues N tokens per step, so one worker can take them all and fill the accumulator
  // with its own gradients (TF semantics), running steps ahead and skewing the whole measurement.
  const int64_t start_step = state->StartTogether(opt.workers, local_step);
  if (start_step < 0) return;

  // Stopping rules: see the header. Sync counts global steps (the token reaches end_step);
  // async/ssp count this worker's iterations.
  const int64_t measure_from = start_step + opt.warmup;
  const int64_t end_step = measure_from + opt.steps;
  const int64_t iterations = static_cast<int64_t>(opt.warmup) + opt.steps;
  for (auto* v : {&stats->step_ms, &stats->pull_ms, &stats->push_ms, &stats->wait_ms}) {
    v->reserve(static_cast<size_t>(opt.steps) + 8);
  }
  Clock::time_point measure_start = Clock::now();
  bool measuring = false;
  // --retry-s: psd re-forming (a shard lost, a new chief) answers UNAVAILABLE (or ABORTED, or a
  // token wait runs out meanwhile); the step is done again from its pull at the global step, as a
  // trainer would, until --retry-s has passed since its first failure. The client reconnects by
  // itself.
  Clock::time_point stalled_since = Clock::time_point::max();  // max: not stalled
  auto retry = [&](const Status& s) {
    const psd::Code code = s.code();
    if (opt.retry_s <= 0 ||
        (code != psd::Code::kUnavailable && code != psd::Code::kAborted && code != psd::Code::kDeadlineExceeded)) {
      return false;
    }
    const auto now = Clock::now();
    if (stalled_since == Clock::time_point::max()) stalled_since = now;
    if (std::chrono::duration<double>(now - stalled_since).count() >= opt.retry_s) return false;
    ++stats->retries;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    // TF's workers re-read the global step after a failure: a push tagged with the step before a
    // re-formation is stale, and a sync cluster's next step waits for fresh gradients (no token
    // comes for stale ones). Still unavailable: the next attempt fails and comes back here.
    if (auto step = c.GlobalStep(); step.ok()) local_step = *step;
    return !state->failed();
  };
  for (int64_t it = 0; sync ? local_step < end_step : it < iterations; ++it) {
    if (state->failed()) return;  // another worker failed: the run is over
    const bool measured = sync ? local_step >= measure_from : it >= opt.warmup;
    if (measured && !measuring) {
      measuring = true;
      if (sync) {
        // A token is not always the current global step (see above), so worker 0 counts steps
        // with the daemon's own figure, read outside the timed window.
        if (index == 0) {
          auto step = c.GlobalStep();
          if (!step.ok()) return fail("status at the start of the measured phase", step.status());
          stats->first_step = *step;
        }
      } else {
        bool together = state->MeasureTogether(opt.workers, [&] {
          auto step = c.GlobalStep();
          if (!step.ok()) return fail("status at the start of the measured phase", step.status());
          state->window.first_step = *step;
          state->window.start = Clock::now();
        });
        if (!together) return;
      }
      measure_start = Clock::now();
    }
    work->Next();
    const auto t0 = Clock::now();
    auto pulled = work->Pull(c);
    if (!pulled.ok()) {
      if (retry(pulled.status())) {
        --it;
        continue;
      }
      return fail("pull at local step " + std::to_string(local_step), pulled.status());
    }
    const auto t1 = Clock::now();
    work->Compute();
    if (opt.compute_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(opt.compute_us));
    const auto tc = Clock::now();
    int64_t token = 0;
    Clock::time_point t2;
    auto pushed = work->Push(c, local_step, /*wait_token=*/opt.fused, opt.token_timeout_ms);
    Status failed = pushed.ok() ? (opt.fused ? pushed->token_status : Status::Ok()) : pushed.status();
    if (failed.ok()) {
      t2 = Clock::now();
      if (opt.fused) {
        token = pushed->token;
      } else {
        auto waited = c.WaitToken(opt.token_timeout_ms);
        if (waited.ok()) token = *waited;
        failed = waited.status();
      }
    }
    if (!failed.ok()) {
      if (retry(failed)) {
        --it;
        continue;
      }
      return fail(std::string(pushed.ok() ? "token wait" : "push") + " at local step " + std::to_string(local_step),
                  failed);
    }
    const auto t3 = Clock::now();
    if (stalled_since != Clock::time_point::max()) {
      stats->longest_stall_ms = std::max(stats->longest_stall_ms, Ms(t3 - stalled_since));
      stalled_since = Clock::time_point::max();
    }
    const int accepted = pushed->accepted();
    const int stale = pushed->stale();
    int64_t staleness = 0;
    for (const psclient::PushResult& r : pushed->results) staleness = std::max(staleness, r.staleness);
    local_step = token;
    if (!measured) {
      stats->warmup_stale += stale;
      continue;
    }
    stats->step_ms.push_back(Ms(t3 - t0));
    stats->pull_ms.push_back(Ms(t1 - t0));
    stats->push_ms.push_back(Ms(t2 - tc));
    if (!opt.fused) stats->wait_ms.push_back(Ms(t3 - t2));
    stats->pulled_bytes += work->pull_bytes();
    stats->pushed_bytes += work->push_bytes();
    stats->pulled_rows += work->rows();
    stats->pushed_rows += work->rows();
    stats->accepted += accepted;
    stats->stale += stale;
    stats->pushes += 1;
    stats->staleness_sum += staleness;
    stats->staleness_max = std::max(stats->staleness_max, staleness);
  }
  const auto measure_end = Clock::now();
  stats->measured_s = std::chrono::duration<double>(measure_end - measure_start).count();
  stats->shared_memory = c.shared_memory_shards() == c.shards();
  stats->lane = c.shared_memory_lanes() == c.shards();
  if (sync) {
    if (index == 0) {
      auto step = c.GlobalStep();
      if (!step.ok()) return fail("status at the end of the measured phase", step.status());
      stats->last_step = *step;
    }
  } else if (state->MeasuredDone(opt.workers)) {
    // The last worker's last push has been applied: every measured push is in the global step.
    state->window.end = measure_end;
    auto step = c.GlobalStep();
    if (!step.ok()) return fail("status at the end of the measured phase", step.status());
    state->window.last_step = *step;
  }
  if (opt.finish) {
    // Sync: lets the remaining workers' last steps commit with fewer gradients; ssp: stops
    // holding the others back; and an --exit-when-done daemon exits, instead of logging
    // "disconnected without finishing".
    Status s = c.Finish();
    if (!s.ok()) return fail("finish", s);
  }
}

int Run(int argc, char** argv) {
  Options opt;
  CLI::App app{"psd_bench: training-step benchmark for psd (in-process daemon or --connect)"};
  auto* connect = app.add_option("--connect", opt.connect,
                                 "HOST:PORT of a running psd, or a cluster's shards HOST:PORT,HOST:PORT,... "
                                 "(default: start one here)");
  app.add_option("--replicas-per-shard", opt.replicas_per_shard,
                 "in-process cluster: psd's --replicas-per-shard (2: each shard's state copied to the next "
                 "one every step; the replication traffic and the copies' memory are reported)")
      ->capture_default_str();
  app.add_option("--shards", opt.shards,
                 "in-process: a psd cluster of this many shards (elected chief, sliced variables)")
      ->excludes(connect)
      ->capture_default_str();
  app.add_option("--slice-bytes", opt.slice_bytes_text,
                 "in-process cluster: psd's --slice-bytes (default: split each variable over every shard)")
      ->excludes(connect);
  app.add_option("--workers,-w", opt.workers, "worker threads, one client each")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--mode", opt.mode, "in-process psd: consistency mode")
      ->check(CLI::IsMember({"sync", "async", "ssp"}))
      ->excludes(connect)
      ->capture_default_str();
  auto* staleness =
      app.add_option("--staleness", opt.staleness, "in-process psd, --mode ssp: staleness bound (default: psd's, 3)")
          ->check(CLI::NonNegativeNumber)
          ->excludes(connect);
  app.add_option("--optimizer", opt.optimizer, "in-process psd: optimizer")
      ->check(CLI::IsMember({"sgd", "momentum", "adagrad", "adam", "rmsprop", "ftrl"}))
      ->excludes(connect)
      ->capture_default_str();
  auto* replicas = app.add_option("--replicas-to-aggregate,-R", opt.replicas_to_aggregate,
                                  "in-process psd, sync: gradients per step (default: --workers)")
                       ->excludes(connect);
  auto* backups =
      app.add_option("--backup-replicas,-B", opt.backup_replicas, "in-process psd, sync: backup replicas (default 0)")
          ->excludes(connect);
  auto* model_bytes_opt =
      app.add_option("--model-bytes", opt.model_bytes_text, "dense: model size: 4096, 4K, 4M, 64M, ...")
          ->capture_default_str();
  auto* variables_opt = app.add_option("--variables", opt.variables, "dense: float32 variables the model is split into")
                            ->check(CLI::PositiveNumber)
                            ->capture_default_str();
  std::string grad_dtype = "float32";
  app.add_option("--grad-dtype", grad_dtype,
                 "dense: the dtype gradients are pushed and values pulled in (the variables are float32): "
                 "float32, bfloat16 or float16")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}))
      ->capture_default_str();
  auto* sparse = app.add_flag("--sparse", opt.sparse,
                              "sparse workload: one embedding, PullRows + SparseGradient pushes of --batch-rows rows");
  sparse->excludes(model_bytes_opt)->excludes(variables_opt);
  app.add_option("--embedding-rows", opt.embedding_rows, "--sparse: rows of the embedding")
      ->check(CLI::PositiveNumber)
      ->needs(sparse)
      ->capture_default_str();
  app.add_option("--embedding-dim", opt.embedding_dim, "--sparse: float32 elements per row")
      ->check(CLI::PositiveNumber)
      ->needs(sparse)
      ->capture_default_str();
  app.add_option("--batch-rows", opt.batch_rows, "--sparse: distinct rows each worker pulls and pushes per step")
      ->check(CLI::PositiveNumber)
      ->needs(sparse)
      ->capture_default_str();
  auto* engine_only =
      app.add_flag(
             "--engine-only", opt.engine_only,
             "--sparse: push every worker's rows straight into the daemon's training engine from --threads threads "
             "(no network, no client): what a sparse step costs the daemon as workers are added; with --mode async, "
             "what the updates cost and how long a small pull and push of another variable take meanwhile")
          ->needs(sparse)
          ->excludes(connect);
  app.add_option("--seed", opt.seed, "--sparse: base seed of the workers' row samplers (worker i: seed + i)")
      ->needs(sparse)
      ->capture_default_str();
  app.add_option(
         "--zipf", opt.zipf,
         "--sparse: draw each batch's distinct rows Zipf(S) by row id (row 0 the most frequent, as a vocabulary "
         "sorted by frequency) instead of uniformly; S in (0, 1.5], 1.0 is the classic word frequency (0: uniform)")
      ->check(CLI::Range(0.0, 1.5))
      ->needs(sparse)
      ->capture_default_str();
  app.add_option("--warmup", opt.warmup, "unmeasured steps first (async/ssp: iterations per worker)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--steps", opt.steps, "measured steps (sync: global steps; async/ssp: iterations per worker)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  // The client's and the network's (--engine-only has neither): their flags are refused with it.
  std::vector<CLI::Option*> transport;
  transport.push_back(app.add_option("--push-frame-bytes", opt.push_frame_bytes_text,
                                     "frames a push is cut into (the client's push_frame_bytes; 0: one frame per push)")
                          ->capture_default_str());
  transport.push_back(
      app.add_option("--compute-us", opt.compute_us,
                     "each worker waits this long between its pull and its push, its CPU idle, as while a GPU "
                     "computes the gradient (in the step times; what psd does meanwhile shows in its CPU time)")
          ->check(CLI::Range(int64_t{0}, int64_t{10000000}))
          ->capture_default_str());
  transport.push_back(
      app.add_option("--busy-poll-us", opt.busy_poll_us,
                     "workers spin this long on a reply before sleeping (ClientOptions::busy_poll_us; pair with psd "
                     "--busy-poll)")
          ->check(CLI::Range(int64_t{0}, int64_t{1000000}))
          ->capture_default_str());
  transport.push_back(
      app.add_option("--shared-memory", opt.shared_memory_text,
                     "same-host workers' shared-memory segment (ClientOptions::shared_memory_bytes; 0: TCP only)")
          ->capture_default_str());
  transport.push_back(app.add_option("--shm-lane", opt.shm_lane,
                                     "with shared memory, the workers' frames too travel in a shared-memory lane "
                                     "(ClientOptions::shm_lane; 0: frames over TCP)")
                          ->check(CLI::Range(0, 1))
                          ->capture_default_str());
  transport.push_back(
      app.add_option("--shm-piece-bytes", opt.shm_piece_text,
                     "pushes and pulls through the segment move in pieces of this size, one side's copy overlapping "
                     "the other's work (ClientOptions::shm_piece_bytes; 0: one piece)")
          ->capture_default_str());
  transport.push_back(app.add_option("--copy-threads", opt.copy_threads,
                                     "threads that help each worker copy big tensors into and out of the segment "
                                     "(ClientOptions::copy_threads; 0: the worker's own thread alone)")
                          ->check(CLI::Range(0, 64))
                          ->capture_default_str());
  transport.push_back(
      app.add_flag("--shared-buffers", opt.shared_buffers,
                   "the workers' gradients and values (--sparse: the pulled rows and their gradient) live in shared "
                   "buffers (Client::AllocateShared): a same-host psd reads and writes them in place, no copy on "
                   "either side"));
  transport.push_back(
      app.add_option("--pull-frame-bytes", opt.pull_frame_bytes_text,
                     "replies a pull is cut into (the client's pull_frame_bytes; 0: one reply per pull)")
          ->capture_default_str());
  auto* fused_flag = app.add_flag("--fused", opt.fused, "ask for the token in the push (one round trip per push+wait)");
  transport.push_back(fused_flag);
  app.add_flag("--pull-in-push", opt.pull_in_push,
               "dense, with --fused: the next step's values come back with the token (one round trip per step)")
      ->needs(fused_flag)
      ->excludes(sparse);
  app.add_option("--threads", opt.io_threads,
                 "in-process psd: I/O threads (0: one per core, as psd's --threads); --engine-only: pushing threads")
      ->excludes(connect)
      ->capture_default_str();
  app.add_option("--learning-rate,--lr", opt.learning_rate, "in-process psd: the optimizer's learning rate")
      ->excludes(connect)
      ->capture_default_str();
  app.add_option("--token-timeout-ms", opt.token_timeout_ms, "deadline of every token wait (and of setup)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--retry-s", opt.retry_s,
                 "retry a step while psd is unavailable (a shard lost, the cluster re-forming) for up to this long, "
                 "as a trainer would; the report counts the retries and the longest stall (default 0: fail at once)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--timeout-s", opt.timeout_s, "the whole run is abandoned (exit 1) after this long")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--finish", opt.finish, "with --connect: declare the workers done at the end (always done in-process)");
  app.add_flag("--json", opt.json, "print one JSON object instead of the table");
  transport.push_back(
      app.add_option("--tls-dir", opt.tls_dir,
                     "TLS on every link: DIR holds ca.pem, server.pem and server.key (deploy/make_tls_certs.sh DIR)"));
  for (CLI::Option* o : transport) engine_only->excludes(o);
  app.add_option("--collectives", opt.collectives,
                 "compare one batch_reduce_to of N small tensors with N reduce_to calls per round (0: off)")
      ->capture_default_str();
  app.add_option("--collective-elements", opt.collective_elements, "--collectives: float32 elements per tensor")
      ->capture_default_str();
  app.add_option("--checkpoint-bytes", opt.checkpoint_bytes_text,
                 "bench a checkpoint write and restore of this much model state (1G, 256M, ...; --variables "
                 "splits it, --optimizer adds slots) instead of training")
      ->excludes(connect);
  app.add_option("--checkpoint-dir", opt.checkpoint_dir,
                 "--checkpoint-bytes: the directory to write into (a fresh subdirectory, removed after)")
      ->capture_default_str();
  app.add_flag("--keep-checkpoint", opt.keep_checkpoint, "--checkpoint-bytes: leave the checkpoint written on disk");
  app.add_option("--restore-after-s", opt.restore_after_s,
                 "--checkpoint-bytes: sync and wait this long between the write and the restore (lets a virtual "
                 "disk's own write-back finish first)")
      ->capture_default_str();
  app.add_flag("--drop-caches", opt.drop_caches,
               "--checkpoint-bytes: drop the page cache before the restore (needs root; else the restore is warm)");
  app.add_option("--log-level", opt.log_level, "in-process psd's log level")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help is a success; every usage error is status 1
  }
  opt.grad_dtype = *psd::ParseDType(grad_dtype);  // checked by IsMember above
  if (staleness->count() > 0 && opt.mode != "ssp") {
    std::fprintf(stderr, "psd_bench: --staleness needs --mode ssp\n");
    return 1;
  }
  if ((replicas->count() > 0 || backups->count() > 0) && opt.mode != "sync") {
    std::fprintf(stderr, "psd_bench: --replicas-to-aggregate and --backup-replicas need --mode sync\n");
    return 1;
  }

  if (opt.sparse && opt.zipf > 0 && opt.batch_rows > opt.embedding_rows / 2) {
    std::fprintf(stderr,
                 "psd_bench: --zipf needs --batch-rows at most half of --embedding-rows (a batch of distinct rows "
                 "drawn by frequency); give fewer --batch-rows or more --embedding-rows\n");
    return 1;
  }
  if (opt.engine_only) {
    if (opt.mode == "ssp") {
      std::fprintf(stderr, "psd_bench: --engine-only measures sync steps or async pushes (--mode sync or async)\n");
      return 1;
    }
    spdlog::set_default_logger(spdlog::stderr_color_mt("psd"));
    spdlog::set_level(spdlog::level::from_str(opt.log_level));
    return opt.mode == "async" ? RunSparseEngineAsyncBench(opt) : RunSparseEngineBench(opt);
  }
  if (!opt.checkpoint_bytes_text.empty()) {
    auto bytes = ParseBytes(opt.checkpoint_bytes_text);
    if (!bytes.ok()) {
      std::fprintf(stderr, "psd_bench: --checkpoint-bytes: %s\n", bytes.status().message().c_str());
      return 1;
    }
    spdlog::set_default_logger(spdlog::stderr_color_mt("psd"));
    spdlog::set_level(spdlog::level::from_str(opt.log_level));
    return RunCheckpointBench(opt, *bytes);
  }

  std::vector<VarSpec> vars;
  uint64_t frame_limit = 0;
  auto shm_bytes = ParseBytes(opt.shared_memory_text);
  if (!shm_bytes.ok()) {
    std::fprintf(stderr, "psd_bench: --shared-memory: %s\n", shm_bytes.status().message().c_str());
    return 1;
  }
  opt.shared_memory_bytes = *shm_bytes;
  auto shm_piece = ParseBytes(opt.shm_piece_text);
  if (!shm_piece.ok()) {
    std::fprintf(stderr, "psd_bench: --shm-piece-bytes: %s\n", shm_piece.status().message().c_str());
    return 1;
  }
  opt.shm_piece_bytes = *shm_piece;
  if (opt.sparse) {
    if (opt.batch_rows > opt.embedding_rows) {
      std::fprintf(stderr, "psd_bench: --batch-rows %" PRId64 " exceeds --embedding-rows %" PRId64 "\n", opt.batch_rows,
                   opt.embedding_rows);
      return 1;
    }
    if (static_cast<uint64_t>(opt.embedding_dim) > kMaxVariableBytes / sizeof(float) ||
        static_cast<uint64_t>(opt.batch_rows) > kMaxVariableBytes / (static_cast<uint64_t>(opt.embedding_dim) * 4)) {
      std::fprintf(stderr,
                   "psd_bench: a batch of --batch-rows x --embedding-dim float32 exceeds the wire limit of "
                   "512 MiB per tensor\n");
      return 1;
    }
    if (static_cast<uint64_t>(opt.embedding_rows) > (1ull << 40) / (static_cast<uint64_t>(opt.embedding_dim) * 4)) {
      std::fprintf(stderr, "psd_bench: --embedding-rows x --embedding-dim is unreasonably large\n");
      return 1;
    }
    frame_limit = static_cast<uint64_t>(opt.batch_rows) * (static_cast<uint64_t>(opt.embedding_dim) * 4 + 8) +
                  kFrameOverheadBytes + kFrameOverheadPerVariable;
  } else {
    auto push_frame = ParseBytes(opt.push_frame_bytes_text);
    if (!push_frame.ok()) {
      std::fprintf(stderr, "psd_bench: --push-frame-bytes: %s\n", push_frame.status().message().c_str());
      return 1;
    }
    opt.push_frame_bytes = *push_frame;
    auto pull_frame = ParseBytes(opt.pull_frame_bytes_text);
    if (!pull_frame.ok()) {
      std::fprintf(stderr, "psd_bench: --pull-frame-bytes: %s\n", pull_frame.status().message().c_str());
      return 1;
    }
    opt.pull_frame_bytes = *pull_frame;
    auto model_bytes = ParseBytes(opt.model_bytes_text);
    if (!model_bytes.ok()) {
      std::fprintf(stderr, "psd_bench: --model-bytes: %s\n", model_bytes.status().message().c_str());
      return 1;
    }
    opt.model_bytes = *model_bytes;
    auto made = MakeVariables(opt.model_bytes, opt.variables);
    if (!made.ok()) {
      std::fprintf(stderr, "psd_bench: %s\n", made.status().message().c_str());
      return 1;
    }
    vars = std::move(*made);
    frame_limit =
        opt.model_bytes + kFrameOverheadBytes + kFrameOverheadPerVariable * static_cast<uint64_t>(opt.variables);
  }
  const bool in_process = opt.connect.empty();
  if (in_process) opt.finish = true;

  // Figures from an unoptimized build are meaningless for comparisons; say so where it is seen.
  Report report;
  report.build_type = PSD_BUILD_TYPE;
#ifdef NDEBUG
  report.ndebug = true;
#endif
  const bool release_like = report.build_type == "Release" || report.build_type == "RelWithDebInfo";
  report.build_warning = !release_like || !report.ndebug;
  std::string warning_line;
  if (report.build_warning) {
    warning_line = "WARNING: psd_bench was built as '" + report.build_type + "'" +
                   (report.ndebug ? "" : " without NDEBUG") +
                   ": these figures do not describe a Release build (configure with "
                   "-DCMAKE_BUILD_TYPE=Release)";
    // The table carries it on stdout; with --json stdout is the object alone, so stderr.
    if (opt.json) std::fprintf(stderr, "%s\n", warning_line.c_str());
  }

  spdlog::set_default_logger(spdlog::stderr_color_mt("psd"));  // keeps stdout for the report
  spdlog::set_level(spdlog::level::from_str(opt.log_level));

  std::vector<std::unique_ptr<psd::server::Server>> servers;
  Endpoint ep;
  if (in_process) {
    psd::server::ServerConfig config;
    config.host = "127.0.0.1";
    config.port = 0;
    config.io_threads = opt.io_threads;
    if (!opt.tls_dir.empty()) {
      config.tls_cert_file = opt.tls_dir + "/server.pem";
      config.tls_key_file = opt.tls_dir + "/server.key";
      config.tls_ca_file = opt.tls_dir + "/ca.pem";
    }
    auto parsed_mode = psd::server::ParseMode(opt.mode);
    if (!parsed_mode.ok()) {
      std::fprintf(stderr, "psd_bench: %s\n", parsed_mode.status().message().c_str());
      return 1;
    }
    config.mode = *parsed_mode;
    if (opt.staleness >= 0) config.staleness_bound = opt.staleness;
    config.replicas_to_aggregate = opt.replicas_to_aggregate > 0 ? opt.replicas_to_aggregate : opt.workers;
    config.backup_replicas = opt.backup_replicas;
    config.init_tokens = -1;  // TF default: R tokens at start
    config.optimizer.name = opt.optimizer;
    config.optimizer.learning_rate = opt.learning_rate;
    config.max_frame_bytes = std::max<uint64_t>(config.max_frame_bytes, frame_limit);
    if (opt.sparse) {
      // psd checks a variable's shape against its frame limit even when it is created with zeros.
      const uint64_t var_bytes =
          static_cast<uint64_t>(opt.embedding_rows) * static_cast<uint64_t>(opt.embedding_dim) * sizeof(float);
      config.max_frame_bytes = std::max<uint64_t>(config.max_frame_bytes, var_bytes + kFrameOverheadBytes);
    }
    config.default_token_timeout_ms = opt.token_timeout_ms;
    config.summary_interval_s = 0;
    config.log_level = opt.log_level;
    config.replicas_per_shard = opt.replicas_per_shard;
    if (opt.shards > 1) {
      // A cluster in this process: P shards on sockets bound on port 0 (below).
      if (!opt.slice_bytes_text.empty()) {
        auto sb = ParseBytes(opt.slice_bytes_text);
        if (!sb.ok()) {
          std::fprintf(stderr, "psd_bench: --slice-bytes: %s\n", sb.status().message().c_str());
          return 1;
        }
        config.slice_bytes = *sb;
      } else {
        uint64_t largest = 0;
        for (const VarSpec& v : vars) largest = std::max<uint64_t>(largest, v.bytes());
        config.slice_bytes = std::max<uint64_t>(
            4096, (largest + static_cast<uint64_t>(opt.shards) - 1) / static_cast<uint64_t>(opt.shards));
      }
    }
    // A cluster's shards get sockets bound on port 0 first (their addresses make the --cluster
    // list), so no port is guessed.
    std::vector<int> sockets;
    std::vector<psd::SocketAddress> bound(static_cast<size_t>(opt.shards));
    if (opt.shards > 1) {
      config.cluster.clear();
      for (int k = 0; k < opt.shards; ++k) {
        auto fd = psd::ListenTcp("127.0.0.1", 0, &bound[static_cast<size_t>(k)]);
        if (!fd.ok()) {
          std::fprintf(stderr, "psd_bench: in-process shard %d: %s\n", k, fd.status().ToString().c_str());
          for (int open_fd : sockets) ::close(open_fd);
          return 1;
        }
        sockets.push_back(*fd);
        config.cluster.push_back(bound[static_cast<size_t>(k)].ToString());
      }
    }
    for (int k = 0; k < opt.shards; ++k) {
      psd::server::ServerConfig shard = config;
      if (opt.shards > 1) {
        shard.shard_index = k;
        shard.host = bound[static_cast<size_t>(k)].ip;
        shard.port = bound[static_cast<size_t>(k)].port;
        shard.listen_fd = sockets[static_cast<size_t>(k)];  // the Server owns it from Start() on
      }
      auto created = psd::server::Server::Create(shard);  // runs config.Validate()
      Status started = created.ok() ? (*created)->Start() : created.status();
      if (!started.ok()) {
        std::fprintf(stderr, "psd_bench: in-process psd: %s\n", started.ToString().c_str());
        if (!created.ok()) {
          for (size_t j = static_cast<size_t>(k); j < sockets.size(); ++j) ::close(sockets[j]);
        }
        return 1;
      }
      servers.push_back(std::move(*created));
    }
    ep = {"127.0.0.1", servers[0]->port(), config.cluster};
    report.daemon = "in-process";
    report.io_threads = psd::ThreadsOrCores(opt.io_threads);
  } else {
    auto parsed = ParseEndpoint(opt.connect);
    if (!parsed.ok()) {
      std::fprintf(stderr, "psd_bench: %s\n", parsed.status().message().c_str());
      return 1;
    }
    ep = *parsed;
    report.daemon = "connect";
  }
  report.endpoint = ep.host + ":" + std::to_string(ep.port);
  if (!ep.cluster.empty()) report.endpoint = std::to_string(ep.cluster.size()) + " shards from " + ep.cluster[0];

  if (opt.collectives > 0) {
    int rc = RunCollectives(opt, ep, opt.collectives, opt.collective_elements);
    for (auto& s : servers) s->Stop();
    return rc;
  }
  RunState state;
  std::vector<WorkerStats> stats(static_cast<size_t>(opt.workers));
  std::vector<std::thread> threads;
  threads.reserve(stats.size());
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opt.timeout_s));
  int launched = 0;
  for (int i = 0; i < opt.workers; ++i) {
    try {
      threads.emplace_back([&, i] {
        try {
          RunWorker(i, opt, ep, frame_limit, vars, &state, &stats[static_cast<size_t>(i)]);
        } catch (const std::exception& e) {
          state.Fail("bench-" + std::to_string(i) + ": unexpected exception: " + e.what());
        }
        state.Exited();
      });
      ++launched;
    } catch (const std::system_error& e) {
      state.Fail("cannot start worker thread " + std::to_string(i) + ": " + e.what());
      break;
    }
  }

  bool all_exited = state.WaitForExit(launched, deadline, /*stop_on_failure=*/true);
  if (!all_exited && !state.failed()) {
    std::fprintf(stderr, "psd_bench: the run did not finish within --timeout-s %g s; giving up\n", opt.timeout_s);
    std::fflush(stderr);
    std::_Exit(1);  // workers may be blocked in client reads that nothing can interrupt
  }
  if (state.failed()) {
    std::fprintf(stderr, "psd_bench: %s\n", state.error().c_str());
    std::fflush(stderr);
    // Stopping the in-process daemon cancels parked token waits and closes the connections, so
    // the other workers return promptly; against a remote daemon they could block until their
    // token deadline, which is not worth waiting for.
    for (auto& s : servers) s->Stop();
    if (servers.empty() || !state.WaitForExit(launched, Clock::now() + std::chrono::seconds(15), false)) std::_Exit(1);
    for (auto& t : threads) t.join();
    return 1;
  }
  for (auto& t : threads) t.join();
  uint64_t replica_sent = 0, replica_kept = 0, replica_kept_max = 0;
  int64_t steps_run = 0;
  for (auto& s : servers) {
    replica_sent += s->metrics().replica_sent();
    const uint64_t kept = s->metrics().replica_own() + s->metrics().replica_held();
    replica_kept += kept;
    replica_kept_max = std::max(replica_kept_max, kept);
    steps_run = std::max(steps_run, s->engine()->global_step());
  }
  for (auto& s : servers) s->Stop();

  Report measured = Summarize(opt, state.window, stats);
  measured.build_type = report.build_type;
  measured.ndebug = report.ndebug;
  measured.build_warning = report.build_warning;
  measured.daemon = report.daemon;
  measured.endpoint = report.endpoint;
  measured.io_threads = report.io_threads;
  // With --connect, --shards is not used (it excludes --connect): the cluster list says how many
  // shards served the run.
  measured.shards = in_process ? opt.shards : std::max<int>(1, static_cast<int>(ep.cluster.size()));
  if (opt.json) {
    PrintJson(measured);
  } else {
    PrintTable(measured, warning_line);
  }
  if (opt.replicas_per_shard > 1 && !opt.json) {
    constexpr double kMiB = 1024.0 * 1024.0;
    std::printf(
        "replication (--replicas-per-shard %d, %d shards): %.1f MiB sent over %lld global steps (%.2f MiB per step, "
        "all shards); copies kept: %.1f MiB in all, %.1f MiB on the fullest shard (own copies share the engine's "
        "newest buffers)\n",
        opt.replicas_per_shard, opt.shards, static_cast<double>(replica_sent) / kMiB, static_cast<long long>(steps_run),
        steps_run > 0 ? static_cast<double>(replica_sent) / kMiB / static_cast<double>(steps_run) : 0.0,
        static_cast<double>(replica_kept) / kMiB, static_cast<double>(replica_kept_max) / kMiB);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace psd_bench

int main(int argc, char** argv) {
  psd::TuneAllocator();  // before the first big buffer (psd/allocator.h)
  try {
    return psd_bench::Run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "psd_bench: unexpected error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "psd_bench: unexpected error\n");
  }
  return 1;
}
