// psd_admin: an operator's view of a running psd, over the same protocol, without joining the job
// as a worker.
//
//   psd_admin --port 7070 status        # global step, workers, tokens, pushes, checkpoint, config
//   psd_admin --port 7070 checkpoint    # ask for a checkpoint at the next step boundary
//   psd_admin --cluster h:p,h:p placement  # which shard(s) hold each variable, bytes per shard
// With --cluster, status also lists every shard (the ones that answer) and the election state.
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
  std::string cluster;
  app.add_option("--cluster", cluster, "a psd cluster: every shard's host:port, comma-separated");
  bool json = false;
  std::string token_file;
  app.add_option("--auth-token-file", token_file, "psd's shared secret, if it runs with one");
  app.add_flag("--json", json, "status as one JSON object");
  app.require_subcommand(1);
  auto* status = app.add_subcommand("status", "print the job's state");
  auto* checkpoint = app.add_subcommand("checkpoint", "ask for a checkpoint at the next step boundary");
  auto* placement = app.add_subcommand("placement", "where each variable lives, and bytes per shard");
  CLI11_PARSE(app, argc, argv);
  opts.cluster = psclient::ParseClusterList(cluster);
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
  if (placement->parsed()) {
    auto map = (*client)->GetPlacementMap();
    if (!map.ok()) {
      std::fprintf(stderr, "psd_admin: %s\n", map.status().ToString().c_str());
      return 1;
    }
    for (size_t k = 0; k < map->shard_bytes.size(); ++k) {
      std::printf("shard %zu: %llu bytes\n", k, static_cast<unsigned long long>(map->shard_bytes[k]));
    }
    for (const auto& v : map->variables) {
      std::printf("%-32s %s %-16s", v.name.c_str(), psd::DTypeName(v.dtype), psd::ShapeString(v.shape).c_str());
      if (!v.sliced) {
        std::printf(" shard %d\n", v.parts[0].shard);
        continue;
      }
      for (const auto& p : v.parts) {
        std::printf(" shard %d rows [%lld, %lld)", p.shard, static_cast<long long>(p.row_begin),
                    static_cast<long long>(p.row_end));
      }
      std::printf("\n");
    }
    return 0;
  }
  (void)status;
  if ((*client)->shards() > 1 && !json) {
    for (int k = 0; k < (*client)->shards(); ++k) {
      auto s = (*client)->GetShardStatus(k);
      if (!s.ok()) {
        std::printf("shard %d              unreachable: %s\n", k, s.status().message().c_str());
        continue;
      }
      std::printf("shard %d              step %lld, chief %d, term %llu, epoch %llu: %s\n", k,
                  static_cast<long long>(s->global_step), s->chief_shard, static_cast<unsigned long long>(s->term),
                  static_cast<unsigned long long>(s->cluster_epoch), s->cluster_state.c_str());
    }
  }
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
  if (j.shards > 1) {
    std::string missing;
    for (int m : j.missing_shards) missing += (missing.empty() ? "" : ", ") + std::to_string(m);
    std::printf("cluster              %d shards, chief %d, term %llu, epoch %llu: %s%s\n", j.shards, j.chief_shard,
                static_cast<unsigned long long>(j.term), static_cast<unsigned long long>(j.cluster_epoch),
                j.cluster_state.c_str(), missing.empty() ? "" : (" (missing: " + missing + ")").c_str());
  }
  return 0;
}
