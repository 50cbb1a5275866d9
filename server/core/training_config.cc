#include "core/training_config.h"

#include <algorithm>
#include <cmath>
#include <string>

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

int TrainingConfig::InitialRequiredReplicas() const {
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

}  // namespace psd::server
