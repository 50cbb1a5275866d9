// ServerConfig: everything psd is told at start-up, parsed from flags by main() and validated
// here so that contradictory settings are rejected before anything starts.
#ifndef PSD_SERVER_CONFIG_H_
#define PSD_SERVER_CONFIG_H_

#include <cstdint>
#include <string>

#include "psd/status.h"

namespace psd::server {

enum class Reduction { kMean, kSum };

struct ServerConfig {
  // Network.
  std::string host = "127.0.0.1";
  uint16_t port = 7070;            // 0 picks a free port (see port_file)
  std::string port_file;           // if set, the bound port is written there once listening
  int io_threads = 2;
  uint64_t max_frame_bytes = 256ull << 20;
  int max_connections = 1024;

  // Synchronous training (TF SyncReplicasOptimizer semantics).
  int replicas_to_aggregate = 1;   // R
  int backup_replicas = -1;        // B; -1: not given
  int total_replicas = -1;         // N; -1: not given (then N = R + max(B, 0))
  int init_tokens = -1;            // -1: TF default (R); must be >= R - N
  Reduction reduction = Reduction::kMean;

  // Optimizer.
  std::string optimizer = "sgd";
  double learning_rate = 0.01;

  // Waits and lifetime.
  int64_t default_token_timeout_ms = 60000;
  bool exit_when_done = false;
  double summary_interval_s = 10.0;
  std::string log_level = "info";

  // Derived by Validate().
  int tokens_per_step = 0;
  int resolved_init_tokens = 0;

  // Resolves N, tokens per step and init tokens; returns an error naming the flag to change.
  Status Validate();
};

const char* ReductionName(Reduction r);

// TF get_init_tokens_op rule: -1 -> R; fewer than R - N -> the "Too few tokens" error.
Result<int> ResolveInitTokens(int num_tokens, int replicas_to_aggregate, int total_replicas);

}  // namespace psd::server

#endif  // PSD_SERVER_CONFIG_H_
