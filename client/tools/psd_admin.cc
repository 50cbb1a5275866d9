// psd_admin: an operator's view of a running psd, over the same protocol, without joining the job
// as a worker.
//
//   psd_admin --port 7070 status        # global step, workers, tokens, pushes, checkpoint, config
//   psd_admin --port 7070 checkpoint    # ask for a checkpoint at the next step boundary
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "psclient/client.h"
#include "psd/secret.h"

int main(int argc, char** argv) {
  CLI::App app{"psd_admin: status and checkpoints of a running psd"};
  psclient::ClientOptions opts;
  opts.observer = true;
  opts.connect_timeout_ms = 2000;
  app.add_option("--host", opts.host, "psd address")->capture_default_str();
  app.add_option("--port", opts.port, "psd port")->capture_default_str();
  bool json = false;
  std::string token_file;
  app.add_option("--auth-token-file", token_file, "psd's shared secret, if it runs with one");
  app.add_flag("--json", json, "status as one JSON object");
  app.require_subcommand(1);
  auto* status = app.add_subcommand("status", "print the job's state");
  auto* checkpoint = app.add_subcommand("checkpoint", "ask for a checkpoint at the next step boundary");
  CLI11_PARSE(app, argc, argv);
  if (!token_file.empty()) {
    auto token = psd::ReadSecretFile(token_file);
    if (!token.ok()) {
      std::fprintf(stderr, "psd_admin: %s\n", token.status().message().c_str());
      return 2;
    }
    opts.auth_token = *token;
  }

  auto client = psclient::Client::Connect(opts);
  if (!client.ok()) {
    std::fprintf(stderr, "psd_admin: %s\n", client.status().ToString().c_str());
    return 1;
  }
  if (checkpoint->parsed()) {
    psclient::Status s = (*client)->RequestCheckpoint();
    if (!s.ok()) {
      std::fprintf(stderr, "psd_admin: %s\n", s.ToString().c_str());
      return 1;
    }
    std::printf("checkpoint requested\n");
    return 0;
  }
  (void)status;
  auto st = (*client)->GetStatus();
  if (!st.ok()) {
    std::fprintf(stderr, "psd_admin: %s\n", st.status().ToString().c_str());
    return 1;
  }
  const psclient::JobStatus& j = *st;
  const psclient::JobConfig& c = j.config;
  if (json) {
    std::printf(
        "{\"global_step\": %lld, \"workers_connected\": %d, \"workers_finished\": %d, \"tokens_queued\": %lld, "
        "\"replicas_required\": %d, \"accepted_pushes\": %lld, \"stale_pushes\": %lld, \"last_step_gradients\": %d, "
        "\"max_staleness\": %lld, \"learning_rate\": %g, \"last_checkpoint_step\": %lld, \"mode\": \"%s\", "
        "\"replicas_to_aggregate\": %d, \"total_replicas\": %d, \"optimizer\": \"%s\"}\n",
        static_cast<long long>(j.global_step), j.workers_connected, j.workers_finished,
        static_cast<long long>(j.tokens_queued), j.replicas_required, static_cast<long long>(j.accepted_pushes),
        static_cast<long long>(j.stale_pushes), j.last_step_gradients, static_cast<long long>(j.max_staleness),
        j.learning_rate, static_cast<long long>(j.last_checkpoint_step), c.mode.c_str(), c.replicas_to_aggregate,
        c.total_replicas, c.optimizer.c_str());
    return 0;
  }
  std::printf("global step          %lld\n", static_cast<long long>(j.global_step));
  std::printf("mode                 %s (R=%d of N=%d, %d tokens per step)\n", c.mode.c_str(), c.replicas_to_aggregate,
              c.total_replicas, c.tokens_per_step);
  std::printf("optimizer            %s, learning rate %g\n", c.optimizer.c_str(), j.learning_rate);
  std::printf("workers              %d connected, %d finished\n", j.workers_connected, j.workers_finished);
  std::printf("step needs           %d gradient(s) per variable (last step used %d)\n", j.replicas_required,
              j.last_step_gradients);
  std::printf("tokens queued        %lld\n", static_cast<long long>(j.tokens_queued));
  std::printf("pushes               %lld accepted, %lld stale (max staleness %lld)\n",
              static_cast<long long>(j.accepted_pushes), static_cast<long long>(j.stale_pushes),
              static_cast<long long>(j.max_staleness));
  if (j.last_checkpoint_step >= 0) {
    std::printf("last checkpoint      step %lld\n", static_cast<long long>(j.last_checkpoint_step));
  } else {
    std::printf("last checkpoint      none\n");
  }
  return 0;
}
