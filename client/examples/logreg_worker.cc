// psd_logreg_worker: a real trainer on libpsclient. Logistic regression on a generated but
// learnable dataset (labels drawn from a fixed "true" model), gradients computed on the CPU,
// synchronized through psd with the SyncReplicasOptimizer API. Prints one line per step and a
// summary. Run several of these against one psd, by hand or under psrun
// (`psrun --workers 3 --replicas 2 -- psd_logreg_worker --steps 300`; see deploy/local_cluster.sh).
#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>

#include "psclient/client.h"
#include "psclient/sync_replicas_optimizer.h"
#include "psd/secret.h"

namespace {

struct Dataset {
  int features = 0;
  std::vector<float> x;  // rows x features
  std::vector<float> y;  // 0/1
  int rows() const { return static_cast<int>(y.size()); }
};

// Every worker draws the same true model (seed 1234) and its own samples (seed + worker shard).
Dataset MakeData(int features, int rows, uint64_t shard_seed) {
  std::mt19937_64 truth_rng(1234);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::vector<float> w_true(features);
  for (auto& w : w_true) w = n01(truth_rng);
  float b_true = 0.5f;
  std::mt19937_64 rng(shard_seed);
  std::uniform_real_distribution<float> u01(0.f, 1.f);
  Dataset d;
  d.features = features;
  d.x.resize(static_cast<size_t>(rows) * features);
  d.y.resize(rows);
  for (int r = 0; r < rows; ++r) {
    float z = b_true;
    for (int f = 0; f < features; ++f) {
      float v = n01(rng);
      d.x[static_cast<size_t>(r) * features + f] = v;
      z += v * w_true[f];
    }
    d.y[r] = u01(rng) < 1.f / (1.f + std::exp(-z)) ? 1.f : 0.f;
  }
  return d;
}

// Mean binary cross-entropy over rows [begin, end) and its gradient w.r.t. w and b.
double LossAndGrad(const Dataset& d, int begin, int end, const float* w, float b, float* gw, float* gb) {
  double loss = 0;
  if (gw) std::fill(gw, gw + d.features, 0.f);
  float gbias = 0;
  int n = end - begin;
  for (int r = begin; r < end; ++r) {
    const float* x = &d.x[static_cast<size_t>(r) * d.features];
    float z = b;
    for (int f = 0; f < d.features; ++f) z += x[f] * w[f];
    float p = 1.f / (1.f + std::exp(-z));
    float y = d.y[r];
    loss += -(y * std::log(std::max(p, 1e-7f)) + (1 - y) * std::log(std::max(1 - p, 1e-7f)));
    float err = (p - y) / static_cast<float>(n);
    if (gw) {
      for (int f = 0; f < d.features; ++f) gw[f] += err * x[f];
    }
    gbias += err;
  }
  if (gb) *gb = gbias;
  return loss / n;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"psd example worker: logistic regression trained through psd"};
  psclient::ClientOptions opts;
  int steps = 200, batch = 64, features = 32, rows = 4096, shard = 0, print_every = 1;
  int replicas = -1, total = -1, num_tokens = -1;
  int slow_ms = 0;
  bool data_by_step = false;
  int64_t token_timeout_ms = 30000;
  double retry_s = 60;
  std::string token_file;
  auto* host_opt = app.add_option("--host", opts.host, "psd address")->capture_default_str();
  auto* port_opt = app.add_option("--port", opts.port, "psd port")->capture_default_str();
  std::string cluster;
  auto* cluster_opt = app.add_option("--cluster", cluster,
                                     "a psd cluster: every shard's host:port, comma-separated (instead of --port)");
  auto* name_opt = app.add_option("--worker-name", opts.worker_name, "this worker's name (default worker-<pid>)");
  auto* shard_opt = app.add_option("--shard", shard, "which slice of the generated data this worker trains on")
                        ->capture_default_str();
  app.add_option("--steps", steps, "train until the global step reaches this")->capture_default_str();
  app.add_option("--batch", batch, "minibatch rows per gradient")->capture_default_str();
  app.add_option("--features", features, "input features")->capture_default_str();
  app.add_option("--rows", rows, "rows of data per worker")->capture_default_str();
  app.add_option("--replicas-to-aggregate", replicas, "must match psd (-1: psd's)")->capture_default_str();
  app.add_option("--total-replicas", total, "must match psd (-1: psd's)")->capture_default_str();
  app.add_option("--num-tokens", num_tokens, "init tokens the chief expects (-1: TF default)")->capture_default_str();
  app.add_option("--slow-ms", slow_ms, "sleep this long per step (an artificial straggler)")->capture_default_str();
  app.add_option("--token-timeout-ms", token_timeout_ms, "token wait deadline")->capture_default_str();
  app.add_option("--print-every", print_every, "print every N-th step")->capture_default_str();
  app.add_flag("--data-by-step", data_by_step,
               "the minibatch of global step s is rows s*batch.. (mod the shard): a step computed again after a "
               "failover reads the same rows, so a run is reproducible whatever happened (with psd --deterministic)");
  auto* token_opt = app.add_option("--auth-token-file", token_file, "psd's shared secret, if it runs with one");
  app.add_option("--tls-ca-file", opts.tls_ca_file, "psd runs with TLS: the CA that signed its certificate");
  app.add_option("--tls-cert-file", opts.tls_cert_file, "this worker's certificate (psd --tls-require-client-cert)");
  app.add_option("--tls-key-file", opts.tls_key_file, "its private key");
  app.add_option("--retry-s", retry_s,
                 "keep retrying this long while psd is unavailable: not up yet at the first connect, restarting "
                 "later")
      ->capture_default_str();
  app.footer(
      "Under psrun (no --host/--port/--cluster, PSD_CLUSTER set) the worker reads the launcher's environment: "
      "PSD_CLUSTER, PSD_WORKER_NAME, PSD_WORKER_INDEX (its data shard), PSD_AUTH_TOKEN_FILE and PSD_TLS_*; flags given "
      "explicitly win.");
  CLI11_PARSE(app, argc, argv);
  // Checked here, not later: a batch larger than the data read past its end, a batch of 0
  // divided by zero.
  if (rows < 1 || features < 1 || batch < 1 || batch > rows) {
    std::fprintf(stderr,
                 "need --rows >= 1, --features >= 1 and 1 <= --batch <= --rows (got --rows %d --features %d "
                 "--batch %d)\n",
                 rows, features, batch);
    return 2;
  }
  opts.cluster = psclient::ParseClusterList(cluster);
  if (host_opt->count() + port_opt->count() + cluster_opt->count() == 0 && std::getenv("PSD_CLUSTER") != nullptr) {
    auto env = psclient::ReadLaunchEnvironment();
    if (!env.ok()) {
      std::fprintf(stderr, "%s\n", env.status().ToString().c_str());
      return 2;
    }
    opts.host = env->options.host;
    opts.port = env->options.port;
    opts.cluster = env->options.cluster;
    if (name_opt->count() == 0) opts.worker_name = env->options.worker_name;
    if (shard_opt->count() == 0 && env->worker_index >= 0) shard = env->worker_index;
    if (token_opt->count() == 0) opts.auth_token = env->options.auth_token;
    if (!opts.tls_enabled()) {  // PSD_TLS_* from psrun --tls-dir
      opts.tls = env->options.tls;
      opts.tls_ca_file = env->options.tls_ca_file;
      opts.tls_cert_file = env->options.tls_cert_file;
      opts.tls_key_file = env->options.tls_key_file;
      opts.tls_server_name = env->options.tls_server_name;
    }
  }
  if (!token_file.empty()) {
    auto token = psd::ReadSecretFile(token_file);
    if (!token.ok()) {
      std::fprintf(stderr, "%s\n", token.status().ToString().c_str());
      return 2;
    }
    opts.auth_token = *token;
  }

  // Workers are often started with the cluster (psrun, deploy/slurm, deploy/kubernetes) while
  // its shards still restore a checkpoint: the first connect is retried like any later call, for
  // up to --retry-s, as long as psd is only unreachable (refused, timed out). Each try waits up to
  // connect_timeout_ms itself, so the last one may end that much after --retry-s. A rejection
  // (a bad token, a mismatched job) fails at once: waiting would not change it.
  const auto connect_start = std::chrono::steady_clock::now();
  auto next_note = connect_start;
  auto client = psclient::Client::Connect(opts);
  while (
      !client.ok() &&
      (client.status().code() == psd::Code::kUnavailable || client.status().code() == psd::Code::kDeadlineExceeded) &&
      std::chrono::steady_clock::now() - connect_start < std::chrono::duration<double>(retry_s)) {
    if (std::chrono::steady_clock::now() >= next_note) {  // a line every 10 s, not one per try
      std::fprintf(stderr, "connect: %s; retrying for up to %.0f s (--retry-s)\n", client.status().ToString().c_str(),
                   retry_s);
      next_note = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    client = psclient::Client::Connect(opts);
  }
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  psclient::Client& c = **client;
  const std::string me = opts.worker_name.empty() ? "worker" : opts.worker_name;
  Dataset data = MakeData(features, rows, 1000 + static_cast<uint64_t>(shard));

  psclient::Variable w("logreg/w", psd::DType::kFloat32, {features});
  psclient::Variable b("logreg/b", psd::DType::kFloat32, {1});
  std::vector<psclient::Variable*> vars{&w, &b};
  if (c.is_chief()) {
    // TF's chief initializes the variables; small random weights.
    std::mt19937_64 rng(7);
    std::normal_distribution<float> init(0.f, 0.01f);
    for (int f = 0; f < features; ++f) w.value().data<float>()[f] = init(rng);
    for (auto* v : vars) {
      psclient::Status s = v->Create(c);
      if (!s.ok()) {
        std::fprintf(stderr, "create %s: %s\n", v->name().c_str(), s.ToString().c_str());
        return 1;
      }
    }
  }

  psclient::SyncReplicasOptimizer opt(c, replicas, total);
  if (!opt.status().ok()) {
    std::fprintf(stderr, "%s\n", opt.status().ToString().c_str());
    return 1;
  }
  opt.set_token_timeout_ms(token_timeout_ms);
  int cursor = 0;
  std::mt19937_64 batch_rng(99 + shard);
  auto loss_fn = [&](const std::vector<psclient::Variable*>& vs, std::vector<std::optional<psclient::Tensor>>* grads,
                     double* loss) {
    if (data_by_step) cursor = static_cast<int>((opt.local_step() * batch) % std::max(1, data.rows() - batch + 1));
    if (cursor + batch > data.rows()) cursor = 0;
    psclient::Tensor gw(psd::DType::kFloat32, {features}), gb(psd::DType::kFloat32, {1});
    *loss = LossAndGrad(data, cursor, cursor + batch, vs[0]->value().data<float>(), vs[1]->value().data<float>()[0],
                        gw.data<float>(), gb.data<float>());
    cursor += batch;
    (*grads)[0] = std::move(gw);
    (*grads)[1] = std::move(gb);
    if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
    return psclient::Status::Ok();
  };

  // psd went away (restarting from a checkpoint, a lost shard, an election) or a wait ran out:
  // true (after a short sleep) when `s` is worth retrying and retry_s has not passed since the
  // first such failure; says what psd waits for each time it changes. The client reconnects by
  // itself and the optimizer re-reads the global step.
  auto unavailable_since = std::chrono::steady_clock::time_point::max();
  std::string last_error;
  auto retry = [&](const psclient::Status& s) {
    psd::Code code = s.code();
    // kAborted: the cluster restored a checkpoint; the optimizer re-reads the step and values.
    if (code != psd::Code::kUnavailable && code != psd::Code::kDeadlineExceeded && code != psd::Code::kNotFound &&
        code != psd::Code::kAborted) {
      return false;
    }
    auto now = std::chrono::steady_clock::now();
    if (unavailable_since == std::chrono::steady_clock::time_point::max()) unavailable_since = now;
    std::string what = s.ToString();
    if (what != last_error) {
      std::fprintf(stderr, "[%s] %s; retrying for up to %.0f s\n", me.c_str(), what.c_str(), retry_s);
      last_error = what;
    }
    if (std::chrono::duration<double>(now - unavailable_since).count() >= retry_s) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return true;
  };

  // TF order: build (compute_gradients declares the variables; on a non-chief worker the pull
  // may find nothing yet), then the hook: readiness wait + local step init. A cluster that loses a
  // shard meanwhile is waited for, as in training.
  psclient::SyncReplicasHook hook = opt.make_session_run_hook(c.is_chief(), num_tokens);
  for (;;) {
    auto first = opt.compute_gradients(loss_fn, vars);
    psclient::Status hs =
        first.ok() || first.status().code() == psd::Code::kNotFound ? psclient::Status::Ok() : first.status();
    cursor = 0;  // the build pass may or may not have read a batch: every run sees the same data order
    if (hs.ok()) hs = hook.begin();
    if (hs.ok()) hs = hook.after_create_session();
    if (hs.ok()) break;
    if (!retry(hs)) {
      std::fprintf(stderr, "%s: %s\n", me.c_str(), hs.ToString().c_str());
      return 1;
    }
  }
  unavailable_since = std::chrono::steady_clock::time_point::max();
  last_error.clear();

  psclient::GlobalStep global_step;
  global_step.value = opt.local_step();
  auto t0 = std::chrono::steady_clock::now();
  int my_steps = 0;
  double last_loss = 0;
  int64_t recreated = 0;
  while (global_step.value < steps) {
    auto step = opt.minimize(loss_fn, &global_step, vars);
    if (!step.ok()) {
      if (step.status().code() == psd::Code::kOutOfRange) break;  // training is over
      if (retry(step.status())) continue;
      std::fprintf(stderr, "%s: %s\n", me.c_str(), step.status().ToString().c_str());
      return 1;
    }
    unavailable_since = std::chrono::steady_clock::time_point::max();
    last_error.clear();
    ++my_steps;
    last_loss = opt.last_loss();
    if (opt.recreated_total() != recreated) {
      // psd came back empty and this worker (the chief) gave it the variables back.
      recreated = opt.recreated_total();
      std::printf(
          "[%s] psd had lost the variables: re-created them from this worker's latest values (%lld so far); "
          "global step %lld, loss %.4f\n",
          me.c_str(), static_cast<long long>(recreated), static_cast<long long>(*step), last_loss);
      std::fflush(stdout);
    }
    if (print_every > 0 && my_steps % print_every == 0) {
      const auto& p = opt.last_push();
      std::printf("[%s] global step %4lld  loss %.4f  pushes accepted %d stale %d%s\n", me.c_str(),
                  static_cast<long long>(*step), last_loss, p.accepted(), p.stale(), p.is_chief ? "  (chief)" : "");
      std::fflush(stdout);
    }
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Final loss of the trained model on this worker's whole shard.
  std::vector<std::pair<std::string, psclient::TensorView>> outs{{w.name(), w.value().view()},
                                                                 {b.name(), b.value().view()}};
  double final_loss = -1;
  double param_sum = 0;
  uint64_t param_hash = 1469598103934665603ull;  // FNV-1a 64 over the parameters' bytes: bit-identical or not
  auto hash_bytes = [&param_hash](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) param_hash = (param_hash ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ull;
  };
  if (c.Pull(outs).ok()) {
    for (int f = 0; f < features; ++f) param_sum += w.value().data<float>()[f];
    param_sum += b.value().data<float>()[0];
    hash_bytes(w.value().data<float>(), sizeof(float) * static_cast<size_t>(features));
    hash_bytes(b.value().data<float>(), sizeof(float));
    final_loss =
        LossAndGrad(data, 0, data.rows(), w.value().data<float>(), b.value().data<float>()[0], nullptr, nullptr);
  }
  double initial_loss = std::log(2.0);  // the loss of the ~zero initial model
  std::printf(
      "[%s] done: %d local steps in %.2f s (%.1f steps/s), global step %lld, pushes accepted %lld stale "
      "%lld, loss %.4f -> %.4f, parameter sum %.9g, parameter hash %016llx\n",
      me.c_str(), my_steps, secs, my_steps / std::max(secs, 1e-9), static_cast<long long>(global_step.value),
      static_cast<long long>(opt.accepted_total()), static_cast<long long>(opt.stale_total()), initial_loss, final_loss,
      param_sum, static_cast<unsigned long long>(param_hash));
  psclient::Status fs = c.Finish();
  if (!fs.ok()) std::fprintf(stderr, "%s: finish: %s\n", me.c_str(), fs.ToString().c_str());
  return 0;
}
