#include "config.h"

#include <algorithm>
#include <cmath>

namespace psd::server {

const char* ReductionName(Reduction r) { return r == Reduction::kSum ? "sum" : "mean"; }

const char* ModeName(Mode m) {
  switch (m) {
    case Mode::kSync:
      return "sync";
    case Mode::kAsync:
      return "async";
    case Mode::kSsp:
      return "ssp";
  }
  return "sync";
}

Result<Mode> ParseMode(const std::string& name) {
  if (name == "sync") return Mode::kSync;
  if (name == "async") return Mode::kAsync;
  if (name == "ssp") return Mode::kSsp;
  return InvalidArgument("--mode '" + name + "' is not one of sync, async, ssp");
}

Result<StalenessLr> ParseStalenessLr(const std::string& name) {
  if (name == "none") return StalenessLr::kNone;
  if (name == "inverse") return StalenessLr::kInverse;
  if (name == "workers") return StalenessLr::kWorkers;
  return InvalidArgument("--staleness-lr '" + name + "' is not one of none, inverse, workers");
}

int ServerConfig::InitialRequiredReplicas() const {
  if (soft_sync_fraction > 0) {
    return std::max(1, static_cast<int>(std::ceil(soft_sync_fraction * total_replicas - 1e-9)));
  }
  return replicas_to_aggregate;
}

Result<int> ResolveInitTokens(int num_tokens, int replicas_to_aggregate, int total_replicas) {
  int needed = replicas_to_aggregate - total_replicas;
  if (num_tokens == -1) return replicas_to_aggregate;
  if (num_tokens < needed) {
    return InvalidArgument("Too few tokens to finish the first step: " + std::to_string(num_tokens) + " (given) vs " +
                           std::to_string(needed) + " (needed)");
  }
  return num_tokens;
}

Status ServerConfig::Validate() {
  if (metrics_port < -1 || metrics_port > 65535) {
    return InvalidArgument("--metrics-port must be -1 (off), 0 (any free port) or a port up to 65535, got " +
                           std::to_string(metrics_port));
  }
  if (replicas_to_aggregate < 1) {
    return InvalidArgument("--replicas-to-aggregate must be >= 1, got " + std::to_string(replicas_to_aggregate));
  }
  if (backup_replicas >= 0 && total_replicas >= 0 && total_replicas != replicas_to_aggregate + backup_replicas) {
    return InvalidArgument("--total-replicas " + std::to_string(total_replicas) +
                           " contradicts --replicas-to-aggregate " + std::to_string(replicas_to_aggregate) +
                           " + --backup-replicas " + std::to_string(backup_replicas) +
                           "; give only one of --total-replicas and --backup-replicas");
  }
  if (backup_replicas < -1) return InvalidArgument("--backup-replicas must be >= 0");
  if (total_replicas < -1 || total_replicas == 0) return InvalidArgument("--total-replicas must be >= 1");
  if (total_replicas < 0) total_replicas = replicas_to_aggregate + std::max(backup_replicas, 0);
  if (init_tokens < -1) return InvalidArgument("--init-tokens must be >= 0, or -1 for the default (R)");
  auto tokens = ResolveInitTokens(init_tokens, replicas_to_aggregate, total_replicas);
  if (!tokens.ok()) {
    return InvalidArgument(tokens.status().message() + "; raise --init-tokens to at least " +
                           std::to_string(replicas_to_aggregate - total_replicas));
  }
  resolved_init_tokens = *tokens;
  tokens_per_step = std::max(total_replicas, replicas_to_aggregate);
  if (io_threads < 1 || io_threads > 256) return InvalidArgument("--threads must be in [1, 256]");
  if (max_frame_bytes < 4096) return InvalidArgument("--max-frame-bytes must be >= 4096");
  PSD_RETURN_IF_ERROR(optimizer.Validate());
  if (apply_threads < 1 || apply_threads > 256) return InvalidArgument("--apply-threads must be in [1, 256]");
  if (staleness_bound < 0) return InvalidArgument("--staleness must be >= 0");
  if (soft_sync_fraction < 0 || soft_sync_fraction > 1) {
    return InvalidArgument("--soft-sync-fraction must be in (0, 1], or 0 for off");
  }
  if (step_deadline_ms < 0) return InvalidArgument("--step-deadline-ms must be >= 0");
  if (mode != Mode::kSync && (soft_sync_fraction > 0 || step_deadline_ms > 0)) {
    return InvalidArgument("--soft-sync-fraction and --step-deadline-ms need --mode sync");
  }
  if (mode == Mode::kSync && staleness_lr != StalenessLr::kNone) {
    return InvalidArgument("--staleness-lr needs --mode async or ssp");
  }
  if (ema_decay < 0 || ema_decay >= 1) return InvalidArgument("--ema-decay must be in [0, 1)");
  if (checkpoint_every_steps < 0 || checkpoint_every_s < 0) {
    return InvalidArgument("--checkpoint-every-steps and --checkpoint-every-s must be >= 0");
  }
  if (checkpoint_dir.empty() && (checkpoint_every_steps > 0 || checkpoint_every_s > 0)) {
    return InvalidArgument("--checkpoint-every-steps/--checkpoint-every-s need --checkpoint-dir");
  }
  if (keep_checkpoints < 0) return InvalidArgument("--keep-checkpoints must be >= 0 (0: keep all)");
  if (default_token_timeout_ms <= 0) return InvalidArgument("--token-timeout-ms must be > 0");
  if (max_connections < 1) return InvalidArgument("--max-connections must be >= 1");
  if (worker_grace_s < 0) return InvalidArgument("--worker-grace-s must be >= 0");
  if (shards() > 256) return InvalidArgument("--cluster has more than 256 shards");
  if (shard_index < 0 || shard_index >= shards()) {
    return InvalidArgument("--shard-index " + std::to_string(shard_index) + " is outside the --cluster list of " +
                           std::to_string(shards()) + " shard(s)");
  }
  for (const std::string& a : cluster) {
    size_t colon = a.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == a.size()) {
      return InvalidArgument("--cluster entry '" + a + "' is not host:port");
    }
  }
  if (clustered()) {
    if (mode != Mode::kSync) return InvalidArgument("a cluster of several shards runs --mode sync only (for now)");
    if (step_deadline_ms > 0) return InvalidArgument("--step-deadline-ms is not supported with several shards yet");
    if (heartbeat_ms < 10 || election_timeout_ms < 3 * heartbeat_ms) {
      return InvalidArgument("--heartbeat-ms must be >= 10 and --election-timeout-ms >= 3 x --heartbeat-ms");
    }
  }
  if (slice_bytes < 4096) return InvalidArgument("--slice-bytes must be >= 4096");
  return Status::Ok();
}

}  // namespace psd::server
