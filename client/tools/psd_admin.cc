// psd_admin: an operator's view of a running psd, over the same protocol, without joining the job
// as a worker.
//
//   psd_admin --port 7070 status        # global step, workers, tokens, pushes, checkpoint, config
//   psd_admin --port 7070 checkpoint    # ask for a checkpoint at the next step boundary
//   psd_admin --cluster h:p,h:p placement  # which shard(s) hold each variable, bytes per shard
//   psd_admin --cluster h:p,h:p recover [--step S | --empty]
//                                       # the chief waits because a shard lost checkpoints: form at the
//                                       # newest common (or given) step, or empty (README "Losing a
//                                       # shard's checkpoints")
// With --cluster, status also lists every shard (the ones that answer) and the election state.
//
// Exit status: 0 when psd serves (every shard up, the cluster formed); 3 when it answers but does
// not serve (restoring, a shard missing or unreachable, the cluster forming); 1 when it cannot be
// reached or the request failed; 2 on bad arguments. `--json` prints one JSON object either way.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "psclient/client.h"
#include "psd/cluster_list.h"
#include "psd/secret.h"
#include "text/json.h"

namespace {

constexpr int kNotServing = 3;

void WritePlacementJson(psd::text::JsonWriter& j, const psclient::PlacementMap& map) {
  j.BeginObject();
  j.Key("shard_bytes").BeginArray();
  for (uint64_t b : map.shard_bytes) j.Int(static_cast<int64_t>(b));
  j.EndArray();
  j.Key("variables").BeginArray();
  for (const auto& v : map.variables) {
    j.BeginObject();
    j.Key("name").String(v.name);
    j.Key("dtype").String(psd::DTypeName(v.dtype));
    j.Key("shape").BeginArray();
    for (int64_t d : v.shape) j.Int(d);
    j.EndArray();
    j.Key("sliced").Bool(v.sliced);
    j.Key("parts").BeginArray();
    for (const auto& p : v.parts) {
      j.BeginObject().Key("shard").Int(p.shard).Key("row_begin").Int(p.row_begin).Key("row_end").Int(p.row_end);
      j.EndObject();
    }
    j.EndArray();
    j.EndObject();
  }
  j.EndArray();
  j.EndObject();
}

// The fields of one daemon's answer (the job's, and the cluster's as that shard sees it).
void WriteStatusFields(psd::text::JsonWriter& j, const psclient::JobStatus& s) {
  const psclient::JobConfig& c = s.config;
  j.Key("version").String(s.version);
  j.Key("uptime_s").Number(s.uptime_s);
  j.Key("ready").Bool(s.ready);
  j.Key("global_step").Int(s.global_step);
  j.Key("workers_connected").Int(s.workers_connected);
  j.Key("workers_finished").Int(s.workers_finished);
  j.Key("tokens_queued").Int(s.tokens_queued);
  j.Key("replicas_required").Int(s.replicas_required);
  j.Key("accepted_pushes").Int(s.accepted_pushes);
  j.Key("stale_pushes").Int(s.stale_pushes);
  j.Key("last_step_gradients").Int(s.last_step_gradients);
  j.Key("max_staleness").Int(s.max_staleness);
  j.Key("learning_rate").Number(s.learning_rate);
  j.Key("last_checkpoint_step").Int(s.last_checkpoint_step);
  j.Key("mode").String(c.mode);
  j.Key("replicas_to_aggregate").Int(c.replicas_to_aggregate);
  j.Key("total_replicas").Int(c.total_replicas);
  j.Key("tokens_per_step").Int(c.tokens_per_step);
  j.Key("optimizer").String(c.optimizer);
  j.Key("shard_index").Int(s.shard_index);
  j.Key("shards").Int(s.shards);
  j.Key("chief_shard").Int(s.chief_shard);
  j.Key("term").Int(static_cast<int64_t>(s.term));
  j.Key("cluster_epoch").Int(static_cast<int64_t>(s.cluster_epoch));
  j.Key("cluster_state").String(s.cluster_state);
  j.Key("missing_shards").BeginArray();
  for (int m : s.missing_shards) j.Int(m);
  j.EndArray();
  j.Key("shard_addresses").BeginArray();
  for (const auto& a : s.shard_addresses) j.String(a);
  j.EndArray();
}

std::string Duration(double s) {
  char buf[64];
  if (s < 120) {
    std::snprintf(buf, sizeof(buf), "%.0f s", s);
  } else if (s < 7200) {
    std::snprintf(buf, sizeof(buf), "%.0f min", s / 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f h", s / 3600);
  }
  return buf;
}

}  // namespace

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
  app.add_flag("--tls", opts.tls, "psd runs with --tls-cert-file: speak TLS (implied by the --tls-* files)");
  app.add_option("--tls-ca-file", opts.tls_ca_file, "CA that signed psd's certificate (default: the system's)");
  app.add_option("--tls-cert-file", opts.tls_cert_file, "this tool's certificate (psd --tls-require-client-cert)");
  app.add_option("--tls-key-file", opts.tls_key_file, "its private key");
  app.add_option("--tls-server-name", opts.tls_server_name, "the name psd's certificate carries, if not --host");
  app.add_flag("--json", json, "status and placement as one JSON object");
  app.require_subcommand(1);
  auto* status = app.add_subcommand("status", "print the job's state (exit 3 if psd does not serve)");
  auto* checkpoint = app.add_subcommand("checkpoint", "ask for a checkpoint at the next step boundary");
  auto* placement = app.add_subcommand("placement", "where each variable lives, and bytes per shard");
  auto* recover = app.add_subcommand(
      "recover",
      "cluster: the chief refuses to form because a shard lacks checkpoints others hold; decide to lose them and "
      "form at the newest checkpoint every shard can restore (or --step, or --empty)");
  int64_t recover_step = -1;
  bool recover_empty = false;
  auto* step_opt =
      recover->add_option("--step", recover_step, "restore this checkpoint step (every shard must have it)")
          ->check(CLI::NonNegativeNumber);
  recover->add_flag("--empty", recover_empty, "start empty at step 0 (the workers' chief re-creates the variables)")
      ->excludes(step_opt);
  // Not CLI11_PARSE: its exit codes (104, 106, 109...) would break the promise above, 2 on bad
  // arguments; --help and --version still exit 0.
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (!cluster.empty()) {
    // Checked here, as psd checks its own --cluster: a malformed list is a bad argument (2), not
    // an unreachable psd (1).
    auto entries = psd::ParseClusterList(cluster, "--cluster");
    if (!entries.ok()) {
      std::fprintf(stderr, "psd_admin: %s\n", entries.status().message().c_str());
      return 2;
    }
    opts.cluster = *entries;
  }
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
    if (json) {
      psd::text::JsonWriter j;
      j.BeginObject().Key("reachable").Bool(false).Key("error").String(client.status().ToString()).EndObject();
      std::printf("%s\n", j.text().c_str());
    }
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
  if (recover->parsed()) {
    psclient::Status s = (*client)->Recover(recover_step, recover_empty);
    if (!s.ok()) {
      std::fprintf(stderr, "psd_admin: %s\n", s.ToString().c_str());
      return 1;
    }
    std::printf("the chief forms the cluster %s; `psd_admin status` shows when it serves\n",
                recover_empty      ? "empty at step 0"
                : recover_step < 0 ? "at the newest checkpoint every shard can restore"
                                   : ("at checkpoint step " + std::to_string(recover_step)).c_str());
    return 0;
  }
  if (placement->parsed()) {
    auto map = (*client)->GetPlacementMap();
    if (!map.ok()) {
      std::fprintf(stderr, "psd_admin: %s\n", map.status().ToString().c_str());
      return map.status().code() == psd::Code::kUnavailable ? kNotServing : 1;
    }
    if (json) {
      psd::text::JsonWriter j;
      WritePlacementJson(j, *map);
      std::printf("%s\n", j.text().c_str());
      return 0;
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
  // Every shard's own answer (a cluster), then the job as the chief sees it.
  bool serving = true;
  struct ShardAnswer {
    int shard;
    psd::Result<psclient::JobStatus> status;
  };
  std::vector<ShardAnswer> shards;
  for (int k = 0; k < (*client)->shards() && (*client)->shards() > 1; ++k) {
    shards.push_back({k, (*client)->GetShardStatus(k)});
    const auto& s = shards.back().status;
    if (!s.ok() || !s->ready || !s->missing_shards.empty()) serving = false;
  }
  auto st = (*client)->GetStatus();
  if (!st.ok()) {
    std::fprintf(stderr, "psd_admin: %s\n", st.status().ToString().c_str());
    if (json) {
      psd::text::JsonWriter j;
      j.BeginObject().Key("reachable").Bool(true).Key("serving").Bool(false);
      j.Key("error").String(st.status().ToString()).EndObject();
      std::printf("%s\n", j.text().c_str());
    }
    return st.status().code() == psd::Code::kUnavailable ? kNotServing : 1;
  }
  const psclient::JobStatus& j = *st;
  const psclient::JobConfig& c = j.config;
  if (!j.ready || !j.missing_shards.empty()) serving = false;
  if (json) {
    psd::text::JsonWriter w;
    w.BeginObject();
    w.Key("reachable").Bool(true);
    w.Key("serving").Bool(serving);
    WriteStatusFields(w, j);
    if (!shards.empty()) {
      w.Key("shard_status").BeginArray();
      for (const ShardAnswer& a : shards) {
        w.BeginObject().Key("shard").Int(a.shard).Key("reachable").Bool(a.status.ok());
        if (a.status.ok()) {
          WriteStatusFields(w, *a.status);
        } else {
          w.Key("error").String(a.status.status().ToString());
        }
        w.EndObject();
      }
      w.EndArray();
    }
    w.EndObject();
    std::printf("%s\n", w.text().c_str());
    return serving ? 0 : kNotServing;
  }
  for (const ShardAnswer& a : shards) {
    if (!a.status.ok()) {
      std::printf("shard %d              unreachable: %s\n", a.shard, a.status.status().message().c_str());
      continue;
    }
    const psclient::JobStatus& s = *a.status;
    std::printf("shard %d              step %lld, chief %d, term %llu, epoch %llu: %s\n", a.shard,
                static_cast<long long>(s.global_step), s.chief_shard, static_cast<unsigned long long>(s.term),
                static_cast<unsigned long long>(s.cluster_epoch), s.cluster_state.c_str());
  }
  std::printf("psd                  %s, up %s, %s\n", j.version.c_str(), Duration(j.uptime_s).c_str(),
              serving ? "serving" : "NOT serving");
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
    for (size_t k = 0; k < j.shard_addresses.size() && k < opts.cluster.size(); ++k) {
      if (j.shard_addresses[k] != opts.cluster[k]) {
        std::printf("stand-in             shard %zu is served at %s (its entry: %s)\n", k, j.shard_addresses[k].c_str(),
                    opts.cluster[k].c_str());
      }
    }
  } else if (!j.ready) {
    std::printf("state                %s\n", j.cluster_state.c_str());
  }
  return serving ? 0 : kNotServing;
}
