// psd_bench: measures psd's synchronous training step on loopback, the way a trainer drives it.
//
// W worker threads, each with its own psclient::Client (one connection each, as real workers have),
// run the SyncReplicasOptimizer loop: pull every variable in one call, push a gradient for every
// variable tagged with the local step, wait for a token (the barrier), take the token as the new
// local step. By default the push and the token wait are two calls so their latencies can be told
// apart; --fused asks for the token in the push (one round trip, what a tuned trainer does).
//
// The daemon is either started in this process (127.0.0.1, port 0) or reached with --connect.
// --warmup and --steps count global steps: all workers start together after the chief created the
// variables, and each stops once its token reaches the last step.
// Figures: steps/s and step time on worker 0, bytes moved by all workers per second of worker 0's
// measured wall time, per-call latency percentiles over all workers, accepted/stale gradients.
// Compare against the raw-socket floor (bench/compare_floor.sh) in the same run: absolute times
// drift on shared machines, ratios much less.
//
// Every wait is bounded: token waits by --token-timeout-ms, setup by the same deadline, and the
// whole run by --timeout-s (a watchdog ends the process, since a blocked client read cannot be
// interrupted from outside). Errors are printed and the exit status is 1.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cctype>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "config.h"
#include "net/server.h"
#include "psclient/client.h"

#ifndef PSD_BUILD_TYPE
#define PSD_BUILD_TYPE ""
#endif

namespace {

using Clock = std::chrono::steady_clock;
using psd::Result;
using psd::Status;

// capnp lists hold at most 2^29 - 1 elements, so one variable's Data blob must stay below that.
constexpr uint64_t kMaxVariableBytes = (1ull << 29) - 8;
// Room for the message structure around the tensor bytes (names, shapes, segment table).
constexpr uint64_t kFrameOverheadBytes = 64 << 10;
constexpr uint64_t kFrameOverheadPerVariable = 1 << 10;

struct Options {
  std::string connect;  // HOST:PORT; empty: start psd in this process
  int workers = 2;
  int replicas_to_aggregate = -1;  // -1: the number of workers
  int backup_replicas = -1;        // -1: not given (psd's default, 0)
  std::string model_bytes_text = "4M";
  uint64_t model_bytes = 0;
  int variables = 1;
  int warmup = 3;
  int steps = 20;
  bool fused = false;
  int io_threads = 2;
  double learning_rate = 0.01;
  int64_t token_timeout_ms = 30000;
  double timeout_s = 300;
  bool json = false;
  bool finish = false;
  std::string log_level = "warn";
};

struct Endpoint {
  std::string host;
  uint16_t port = 0;
};

struct VarSpec {
  std::string name;
  int64_t elements = 0;
  size_t bytes() const { return static_cast<size_t>(elements) * sizeof(float); }
};

// What one worker measured (the measured phase only, unless named warmup_*).
struct WorkerStats {
  std::vector<double> step_ms;
  std::vector<double> pull_ms;
  std::vector<double> push_ms;  // with --fused: push + token wait, one round trip
  std::vector<double> wait_ms;  // token waits (empty with --fused)
  uint64_t pushed_bytes = 0;
  uint64_t pulled_bytes = 0;
  int64_t accepted = 0;
  int64_t stale = 0;
  int64_t warmup_stale = 0;
  double measured_s = 0;
  int64_t first_step = 0;  // global step when the measured phase began (worker 0 only)
  int64_t last_step = 0;   // global step when it ended (worker 0 only)
  psclient::JobConfig job;
};

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

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> failed_{false};
  std::string error_;       // guarded by mu_
  int exited_ = 0;          // guarded by mu_
  int arrived_ = 0;         // guarded by mu_
  int64_t start_step_ = 0;  // guarded by mu_
};

// "4096", "4K", "4M", "64M", "1G" (binary multiples; "KiB"/"MB" spellings accepted too).
Result<uint64_t> ParseBytes(const std::string& text) {
  size_t i = 0;
  uint64_t value = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    uint64_t digit = static_cast<uint64_t>(text[i] - '0');
    if (value > (UINT64_MAX - digit) / 10) return psd::InvalidArgument("'" + text + "' is too large");
    value = value * 10 + digit;
    ++i;
  }
  if (i == 0) return psd::InvalidArgument("'" + text + "' is not a size (examples: 4096, 4K, 4M, 64M)");
  std::string suffix = text.substr(i);
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  uint64_t multiplier = 1;
  if (suffix == "K" || suffix == "KB" || suffix == "KIB") {
    multiplier = 1ull << 10;
  } else if (suffix == "M" || suffix == "MB" || suffix == "MIB") {
    multiplier = 1ull << 20;
  } else if (suffix == "G" || suffix == "GB" || suffix == "GIB") {
    multiplier = 1ull << 30;
  } else if (!suffix.empty() && suffix != "B") {
    return psd::InvalidArgument("'" + text + "' has an unknown suffix (use K, M or G)");
  }
  if (value > UINT64_MAX / multiplier) return psd::InvalidArgument("'" + text + "' is too large");
  return value * multiplier;
}

Result<Endpoint> ParseEndpoint(const std::string& text) {
  size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
    return psd::InvalidArgument("--connect wants HOST:PORT, got '" + text + "'");
  }
  Endpoint ep;
  ep.host = text.substr(0, colon);
  unsigned long port = 0;
  for (size_t i = colon + 1; i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9' || port > 65535) {
      return psd::InvalidArgument("--connect: '" + text.substr(colon + 1) + "' is not a port");
    }
    port = port * 10 + static_cast<unsigned long>(text[i] - '0');
  }
  if (port == 0 || port > 65535) return psd::InvalidArgument("--connect: port must be in [1, 65535]");
  ep.port = static_cast<uint16_t>(port);
  return ep;
}

// Splits the model into float32 variables whose sizes differ by at most one element.
Result<std::vector<VarSpec>> MakeVariables(uint64_t model_bytes, int count) {
  if (model_bytes % sizeof(float) != 0) {
    return psd::InvalidArgument("--model-bytes must be a multiple of 4 (float32 variables), got " +
                                std::to_string(model_bytes));
  }
  uint64_t elements = model_bytes / sizeof(float);
  if (count < 1 || elements < static_cast<uint64_t>(count)) {
    return psd::InvalidArgument("--variables must be in [1, " + std::to_string(elements) + "] for --model-bytes " +
                                std::to_string(model_bytes));
  }
  uint64_t base = elements / static_cast<uint64_t>(count);
  uint64_t extra = elements % static_cast<uint64_t>(count);
  std::vector<VarSpec> vars;
  vars.reserve(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    uint64_t n = base + (static_cast<uint64_t>(i) < extra ? 1 : 0);
    if (n * sizeof(float) > kMaxVariableBytes) {
      return psd::InvalidArgument("a variable of " + std::to_string(n * sizeof(float)) +
                                  " bytes exceeds the wire limit of 512 MiB per tensor; raise --variables");
    }
    vars.push_back({"bench/v" + std::to_string(i), static_cast<int64_t>(n)});
  }
  return vars;
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Nearest-rank percentile of `v` (sorted in place); 0 for no samples.
double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  auto rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// JSON has no NaN or infinity; a figure that could not be measured is null.
std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

// One worker: connect, (chief) create the variables, then warmup + measured steps.
void RunWorker(int index, const Options& opt, const Endpoint& ep, uint64_t frame_limit,
               const std::vector<VarSpec>& vars, RunState* state, WorkerStats* stats) {
  const std::string who = "bench-" + std::to_string(index);
  auto fail = [&](const std::string& what, const Status& s) { state->Fail(who + ": " + what + ": " + s.ToString()); };

  psclient::ClientOptions co;
  co.host = ep.host;
  co.port = ep.port;
  co.worker_name = who;
  co.max_frame_bytes = std::max<uint64_t>(co.max_frame_bytes, frame_limit);
  auto connected = psclient::Client::Connect(co);
  if (!connected.ok()) return fail("connect to " + ep.host + ":" + std::to_string(ep.port), connected.status());
  psclient::Client& c = **connected;
  stats->job = c.config();
  // Fewer workers than the daemon needs per step would only end in token-wait timeouts.
  if (c.config().replicas_to_aggregate > opt.workers) {
    state->Fail(who + ": psd needs " + std::to_string(c.config().replicas_to_aggregate) +
                " fresh gradients per step but the bench runs only " + std::to_string(opt.workers) +
                " workers; pass --workers " + std::to_string(c.config().replicas_to_aggregate) + " or more");
    return;
  }

  // Buffers are allocated once: the loop measures psd, not the allocator. uint64_t storage keeps
  // gradients 8-byte aligned so libpsclient sends them without staging copies.
  std::vector<std::vector<uint64_t>> grad_storage(vars.size());
  std::vector<std::vector<uint64_t>> value_storage(vars.size());
  std::vector<psclient::Gradient> grads;
  std::vector<std::pair<std::string, psclient::TensorView>> outs;
  grads.reserve(vars.size());
  outs.reserve(vars.size());
  uint64_t model_bytes = 0;
  for (size_t i = 0; i < vars.size(); ++i) {
    const size_t words = (vars[i].bytes() + 7) / 8;
    // Small per-worker constants: the model drifts slowly and stays finite for any step count.
    const float g = 1e-3f * static_cast<float>(index + 1);
    const float pair[2] = {g, g};
    uint64_t pattern = 0;
    std::memcpy(&pattern, pair, sizeof(pattern));
    grad_storage[i].assign(words, pattern);
    value_storage[i].assign(words, 0);
    const psd::Shape shape{vars[i].elements};
    grads.push_back({vars[i].name, psclient::ConstTensorView{grad_storage[i].data(), psd::DType::kFloat32, shape}});
    outs.emplace_back(vars[i].name, psclient::TensorView{value_storage[i].data(), psd::DType::kFloat32, shape});
    model_bytes += vars[i].bytes();
  }

  // TF's chief creates the variables; the others wait for them by pulling until they exist.
  if (c.is_chief()) {
    for (const VarSpec& v : vars) {
      auto created = c.CreateVariable(v.name, psclient::ConstTensorView{nullptr, psd::DType::kFloat32, {v.elements}});
      if (!created.ok()) {
        std::string hint = created.status().code() == psd::Code::kAlreadyExists
                               ? " (a previous run created it with another size: restart psd or use the same "
                                 "--model-bytes and --variables)"
                               : "";
        return state->Fail(who + ": create '" + v.name + "': " + created.status().ToString() + hint);
      }
    }
  }
  const auto setup_deadline = Clock::now() + std::chrono::milliseconds(opt.token_timeout_ms);
  int64_t local_step = 0;
  for (;;) {
    auto pulled = c.Pull(outs);
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
  // Everyone starts together. A worker that started alone would not wait for the others: psd
  // queues N tokens per step, so one worker can take them all and fill the accumulator with its
  // own gradients (TF semantics), running steps ahead and skewing the whole measurement.
  const int64_t start_step = state->StartTogether(opt.workers, local_step);
  if (start_step < 0) return;

  // The run is counted in global steps, not in iterations per worker: a worker may take a token
  // left over from an earlier commit and do an extra iteration, and with a fixed iteration count
  // the others would then wait at the end for a step nobody pushes. A worker stops once its
  // token reaches the last step; the W tokens of that step are enough for every worker.
  const int64_t measure_from = start_step + opt.warmup;
  const int64_t end_step = measure_from + opt.steps;
  for (auto* v : {&stats->step_ms, &stats->pull_ms, &stats->push_ms, &stats->wait_ms}) {
    v->reserve(static_cast<size_t>(opt.steps) + 8);
  }
  Clock::time_point measure_start = Clock::now();
  bool measuring = false;
  while (local_step < end_step) {
    if (state->failed()) return;  // another worker failed: the run is over
    const bool measured = local_step >= measure_from;
    if (measured && !measuring) {
      measuring = true;
      // A token is not always the current global step (see above), so worker 0 counts steps
      // with the daemon's own figure, read outside the timed window.
      if (index == 0) {
        auto step = c.GlobalStep();
        if (!step.ok()) return fail("status at the start of the measured phase", step.status());
        stats->first_step = *step;
      }
      measure_start = Clock::now();
    }
    const auto t0 = Clock::now();
    auto pulled = c.Pull(outs);
    if (!pulled.ok()) return fail("pull at local step " + std::to_string(local_step), pulled.status());
    const auto t1 = Clock::now();
    int64_t token = 0;
    int accepted = 0;
    int stale = 0;
    Clock::time_point t2;
    if (opt.fused) {
      auto pushed = c.Push(local_step, grads, /*wait_token=*/true, opt.token_timeout_ms);
      if (!pushed.ok()) return fail("push at local step " + std::to_string(local_step), pushed.status());
      if (!pushed->token_status.ok()) {
        return fail("token wait after the push at local step " + std::to_string(local_step), pushed->token_status);
      }
      token = pushed->token;
      accepted = pushed->accepted();
      stale = pushed->stale();
      t2 = Clock::now();
    } else {
      auto pushed = c.Push(local_step, grads);
      if (!pushed.ok()) return fail("push at local step " + std::to_string(local_step), pushed.status());
      accepted = pushed->accepted();
      stale = pushed->stale();
      t2 = Clock::now();
      auto waited = c.WaitToken(opt.token_timeout_ms);
      if (!waited.ok()) return fail("token wait at local step " + std::to_string(local_step), waited.status());
      token = *waited;
    }
    const auto t3 = Clock::now();
    local_step = token;
    if (!measured) {
      stats->warmup_stale += stale;
      continue;
    }
    stats->step_ms.push_back(Ms(t3 - t0));
    stats->pull_ms.push_back(Ms(t1 - t0));
    stats->push_ms.push_back(Ms(t2 - t1));
    if (!opt.fused) stats->wait_ms.push_back(Ms(t3 - t2));
    stats->pulled_bytes += model_bytes;
    stats->pushed_bytes += model_bytes;
    stats->accepted += accepted;
    stats->stale += stale;
  }
  stats->measured_s = std::chrono::duration<double>(Clock::now() - measure_start).count();
  if (index == 0) {
    auto step = c.GlobalStep();
    if (!step.ok()) return fail("status at the end of the measured phase", step.status());
    stats->last_step = *step;
  }
  if (opt.finish) {
    // Lets the remaining workers' last steps commit with fewer gradients, and an --exit-when-done
    // daemon exit, instead of logging "disconnected without finishing".
    Status s = c.Finish();
    if (!s.ok()) return fail("finish", s);
  }
}

struct Report {
  std::string build_type;
  bool ndebug = false;
  bool build_warning = false;
  std::string mode;
  std::string endpoint;
  int io_threads = -1;  // unknown with --connect
  int replicas_to_aggregate = 0;
  int total_replicas = 0;
  int workers = 0;
  uint64_t model_bytes = 0;
  int variables = 0;
  int warmup = 0;
  int steps = 0;
  bool fused = false;
  double wall_s = 0;
  int64_t global_steps = 0;
  double steps_per_s = 0;
  double step_p50 = 0, step_p99 = 0;
  double push_gbps = 0, pull_gbps = 0;
  double push_p50 = 0, push_p99 = 0;
  double wait_p50 = 0, wait_p99 = 0;
  double pull_p50 = 0, pull_p99 = 0;
  int64_t accepted = 0, stale = 0, warmup_stale = 0;
};

Report Summarize(const Options& opt, std::vector<WorkerStats>& stats) {
  Report r;
  WorkerStats& w0 = stats[0];
  r.workers = opt.workers;
  r.model_bytes = opt.model_bytes;
  r.variables = opt.variables;
  r.warmup = opt.warmup;
  r.steps = opt.steps;
  r.fused = opt.fused;
  r.replicas_to_aggregate = w0.job.replicas_to_aggregate;
  r.total_replicas = w0.job.total_replicas;
  r.wall_s = w0.measured_s;
  r.global_steps = w0.last_step - w0.first_step;
  r.steps_per_s = r.wall_s > 0 ? static_cast<double>(r.global_steps) / r.wall_s : NAN;
  std::vector<double> step = w0.step_ms;
  r.step_p50 = Percentile(step, 50);
  r.step_p99 = Percentile(step, 99);
  std::vector<double> push, wait, pull;
  uint64_t pushed = 0, pulled = 0;
  for (const WorkerStats& s : stats) {
    push.insert(push.end(), s.push_ms.begin(), s.push_ms.end());
    wait.insert(wait.end(), s.wait_ms.begin(), s.wait_ms.end());
    pull.insert(pull.end(), s.pull_ms.begin(), s.pull_ms.end());
    pushed += s.pushed_bytes;
    pulled += s.pulled_bytes;
    r.accepted += s.accepted;
    r.stale += s.stale;
    r.warmup_stale += s.warmup_stale;
  }
  r.push_gbps = r.wall_s > 0 ? static_cast<double>(pushed) / r.wall_s / 1e9 : NAN;
  r.pull_gbps = r.wall_s > 0 ? static_cast<double>(pulled) / r.wall_s / 1e9 : NAN;
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
  field("tool", JsonString("psd_bench"));
  field("build_type", JsonString(r.build_type));
  field("ndebug", boolean(r.ndebug));
  field("build_warning", boolean(r.build_warning));
  field("mode", JsonString(r.mode));
  field("endpoint", JsonString(r.endpoint));
  field("io_threads", r.io_threads < 0 ? "null" : integer(r.io_threads));
  field("replicas_to_aggregate", integer(r.replicas_to_aggregate));
  field("total_replicas", integer(r.total_replicas));
  field("workers", integer(r.workers));
  field("model_bytes", std::to_string(r.model_bytes));
  field("variables", integer(r.variables));
  field("warmup", integer(r.warmup));
  field("steps", integer(r.steps));
  field("fused", boolean(r.fused));
  field("wall_s", JsonNumber(r.wall_s));
  field("global_steps", integer(r.global_steps));
  field("steps_per_s", JsonNumber(r.steps_per_s));
  field("step_ms_p50", JsonNumber(r.step_p50));
  field("step_ms_p99", JsonNumber(r.step_p99));
  field("push_gb_per_s", JsonNumber(r.push_gbps));
  field("pull_gb_per_s", JsonNumber(r.pull_gbps));
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
  o += "}";
  std::printf("%s\n", o.c_str());
}

void PrintTable(const Report& r, const std::string& build_warning_line) {
  if (!build_warning_line.empty()) std::printf("%s\n", build_warning_line.c_str());
  std::printf("psd_bench  build %s%s\n", r.build_type.empty() ? "(unknown)" : r.build_type.c_str(),
              r.ndebug ? " (NDEBUG)" : " (assertions on)");
  std::printf("psd        %s %s", r.mode.c_str(), r.endpoint.c_str());
  if (r.io_threads >= 0) std::printf(", %d I/O threads", r.io_threads);
  std::printf(", R=%d of N=%d\n", r.replicas_to_aggregate, r.total_replicas);
  std::printf("run        %d workers, model %" PRIu64
              " bytes (%.2f MiB) in %d float32 variable(s), %d warmup + %d "
              "measured steps, %s\n",
              r.workers, r.model_bytes, static_cast<double>(r.model_bytes) / (1 << 20), r.variables, r.warmup, r.steps,
              r.fused ? "fused push+token (1 round trip)" : "push then token wait (2 round trips)");
  std::printf("\n");
  std::printf("  %-22s %12s %12s %14s\n", "", "p50 ms", "p99 ms", "GB/s");
  std::printf("  %-22s %12.3f %12.3f %14s\n", "step (worker 0)", r.step_p50, r.step_p99, "");
  std::printf("  %-22s %12.3f %12.3f %14.3f\n", "pull", r.pull_p50, r.pull_p99, r.pull_gbps);
  if (r.fused) {
    std::printf("  %-22s %12.3f %12.3f %14.3f\n", "push+token (fused)", r.push_p50, r.push_p99, r.push_gbps);
  } else {
    std::printf("  %-22s %12.3f %12.3f %14.3f\n", "push", r.push_p50, r.push_p99, r.push_gbps);
    std::printf("  %-22s %12.3f %12.3f %14s\n", "token wait", r.wait_p50, r.wait_p99, "");
  }
  std::printf("\n");
  std::printf("  steps/s                %.2f  (%" PRId64 " global steps in %.4g s, worker 0)\n", r.steps_per_s,
              r.global_steps, r.wall_s);
  std::printf("  gradients              %" PRId64 " accepted, %" PRId64 " stale (measured; %" PRId64
              " stale in warmup)\n",
              r.accepted, r.stale, r.warmup_stale);
  std::printf(
      "  latencies are over all workers' calls; GB/s = bytes moved by all workers / worker 0's wall "
      "time (GB = 1e9 B)\n");
}

int Run(int argc, char** argv) {
  Options opt;
  CLI::App app{"psd_bench: synchronous-training benchmark for psd (in-process daemon or --connect)"};
  auto* connect = app.add_option("--connect", opt.connect, "HOST:PORT of a running psd (default: start one here)");
  app.add_option("--workers,-w", opt.workers, "worker threads, one client each")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--replicas-to-aggregate,-R", opt.replicas_to_aggregate,
                 "in-process psd: gradients per step (default: --workers)")
      ->excludes(connect);
  app.add_option("--backup-replicas,-B", opt.backup_replicas, "in-process psd: backup replicas (default 0)")
      ->excludes(connect);
  app.add_option("--model-bytes", opt.model_bytes_text, "model size: 4096, 4K, 4M, 64M, ...")->capture_default_str();
  app.add_option("--variables", opt.variables, "float32 variables the model is split into")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--warmup", opt.warmup, "unmeasured steps first")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--steps", opt.steps, "measured steps")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_flag("--fused", opt.fused, "ask for the token in the push (one round trip per push+wait)");
  app.add_option("--threads", opt.io_threads, "in-process psd: I/O threads")->excludes(connect)->capture_default_str();
  app.add_option("--learning-rate,--lr", opt.learning_rate, "in-process psd: SGD learning rate")
      ->excludes(connect)
      ->capture_default_str();
  app.add_option("--token-timeout-ms", opt.token_timeout_ms, "deadline of every token wait (and of setup)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--timeout-s", opt.timeout_s, "the whole run is abandoned (exit 1) after this long")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--finish", opt.finish, "with --connect: declare the workers done at the end (always done in-process)");
  app.add_flag("--json", opt.json, "print one JSON object instead of the table");
  app.add_option("--log-level", opt.log_level, "in-process psd's log level")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help is a success; every usage error is status 1
  }

  auto model_bytes = ParseBytes(opt.model_bytes_text);
  if (!model_bytes.ok()) {
    std::fprintf(stderr, "psd_bench: --model-bytes: %s\n", model_bytes.status().message().c_str());
    return 1;
  }
  opt.model_bytes = *model_bytes;
  auto vars = MakeVariables(opt.model_bytes, opt.variables);
  if (!vars.ok()) {
    std::fprintf(stderr, "psd_bench: %s\n", vars.status().message().c_str());
    return 1;
  }
  const bool in_process = opt.connect.empty();
  if (in_process) opt.finish = true;
  const uint64_t frame_limit =
      opt.model_bytes + kFrameOverheadBytes + kFrameOverheadPerVariable * static_cast<uint64_t>(opt.variables);

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

  std::unique_ptr<psd::server::Server> server;
  Endpoint ep;
  if (in_process) {
    psd::server::ServerConfig config;
    config.host = "127.0.0.1";
    config.port = 0;
    config.io_threads = opt.io_threads;
    config.replicas_to_aggregate = opt.replicas_to_aggregate > 0 ? opt.replicas_to_aggregate : opt.workers;
    config.backup_replicas = opt.backup_replicas;
    config.init_tokens = -1;  // TF default: R tokens at start
    config.learning_rate = opt.learning_rate;
    config.max_frame_bytes = std::max<uint64_t>(config.max_frame_bytes, frame_limit);
    config.default_token_timeout_ms = opt.token_timeout_ms;
    config.summary_interval_s = 0;
    config.log_level = opt.log_level;
    auto created = psd::server::Server::Create(config);  // runs config.Validate()
    if (!created.ok()) {
      std::fprintf(stderr, "psd_bench: in-process psd: %s\n", created.status().ToString().c_str());
      return 1;
    }
    server = std::move(*created);
    Status started = server->Start();
    if (!started.ok()) {
      std::fprintf(stderr, "psd_bench: in-process psd: %s\n", started.ToString().c_str());
      return 1;
    }
    ep = {"127.0.0.1", server->port()};
    report.mode = "in-process";
    report.io_threads = opt.io_threads;
  } else {
    auto parsed = ParseEndpoint(opt.connect);
    if (!parsed.ok()) {
      std::fprintf(stderr, "psd_bench: %s\n", parsed.status().message().c_str());
      return 1;
    }
    ep = *parsed;
    report.mode = "connect";
  }
  report.endpoint = ep.host + ":" + std::to_string(ep.port);

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
          RunWorker(i, opt, ep, frame_limit, *vars, &state, &stats[static_cast<size_t>(i)]);
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
    if (server) server->Stop();
    if (!server || !state.WaitForExit(launched, Clock::now() + std::chrono::seconds(15), false)) std::_Exit(1);
    for (auto& t : threads) t.join();
    return 1;
  }
  for (auto& t : threads) t.join();
  if (server) server->Stop();

  Report measured = Summarize(opt, stats);
  measured.build_type = report.build_type;
  measured.ndebug = report.ndebug;
  measured.build_warning = report.build_warning;
  measured.mode = report.mode;
  measured.endpoint = report.endpoint;
  measured.io_threads = report.io_threads;
  if (opt.json) {
    PrintJson(measured);
  } else {
    PrintTable(measured, warning_line);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "psd_bench: unexpected error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "psd_bench: unexpected error\n");
  }
  return 1;
}
