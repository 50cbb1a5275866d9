#include "config.h"

#include <algorithm>

namespace psd::server {

const char* ReductionName(Reduction r) { return r == Reduction::kSum ? "sum" : "mean"; }

Result<int> ResolveInitTokens(int num_tokens, int replicas_to_aggregate, int total_replicas) {
  int needed = replicas_to_aggregate - total_replicas;
  if (num_tokens == -1) return replicas_to_aggregate;
  if (num_tokens < needed) {
    return InvalidArgument("Too few tokens to finish the first step: " + std::to_string(num_tokens) +
                           " (given) vs " + std::to_string(needed) + " (needed)");
  }
  return num_tokens;
}

Status ServerConfig::Validate() {
  if (replicas_to_aggregate < 1) {
    return InvalidArgument("--replicas-to-aggregate must be >= 1, got " +
                           std::to_string(replicas_to_aggregate));
  }
  if (backup_replicas >= 0 && total_replicas >= 0 &&
      total_replicas != replicas_to_aggregate + backup_replicas) {
    return InvalidArgument(
        "--total-replicas " + std::to_string(total_replicas) + " contradicts --replicas-to-aggregate " +
        std::to_string(replicas_to_aggregate) + " + --backup-replicas " + std::to_string(backup_replicas) +
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
  if (!(learning_rate > 0)) return InvalidArgument("--learning-rate must be > 0");
  if (optimizer != "sgd") {
    return InvalidArgument("--optimizer '" + optimizer + "' is not supported (supported: sgd)");
  }
  if (default_token_timeout_ms <= 0) return InvalidArgument("--token-timeout-ms must be > 0");
  if (max_connections < 1) return InvalidArgument("--max-connections must be >= 1");
  return Status::Ok();
}

}  // namespace psd::server
