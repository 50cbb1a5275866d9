// TrainingConfig: what the training core is told (the step rule, the optimizer, consistency,
// averages, limits). ServerConfig (config.h) extends it with the daemon's network, cluster,
// checkpoint-file and operations settings; the core sees only this part.
#ifndef PSD_SERVER_CORE_TRAINING_CONFIG_H_
#define PSD_SERVER_CORE_TRAINING_CONFIG_H_

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/optimizer.h"
#include "psd/status.h"

namespace psd::server {

enum class Reduction { kMean, kSum };

// Consistency modes (README "Consistency modes").
enum class Mode {
  kSync,   // N-of-M with backup replicas (TF SyncReplicasOptimizer); soft sync via the fraction/deadline
  kAsync,  // every gradient applied on arrival
  kSsp,    // bounded staleness: a worker more than `staleness_bound` clocks ahead of the slowest waits
};

// Async/ssp learning-rate scaling by staleness.
enum class StalenessLr {
  kNone,
  kInverse,  // lr / max(1, staleness)
  kWorkers,  // lr / N
};

struct TrainingConfig {
  // Synchronous training (TF SyncReplicasOptimizer semantics).
  int replicas_to_aggregate = 1;  // R
  int backup_replicas = -1;       // B; -1: not given
  int total_replicas = -1;        // N; -1: not given (then N = R + max(B, 0))
  int init_tokens = -1;           // -1: TF default (R); must be >= R - N
  Reduction reduction = Reduction::kMean;
  // A sync step's dense sum is formed in replica order (the workers' names), not arrival order:
  // the same gradients give bit-identical parameters run after run. Costs a model-sized slot per
  // gradient of a step (DenseAccumulator).
  bool deterministic = false;

  // Optimizer (job-wide; variables may name another one with the same hyper-parameters).
  OptimizerParams optimizer;
  int apply_threads = 0;  // threads that split the apply of big variables (0: one per usable core)
  // How many pushes may add at once: the daemon's I/O threads (ServerConfig::Validate sets it from
  // --threads; 0: one per usable core). Sparse accumulators weigh how their rows spread by it.
  int concurrent_adds = 0;

  // Consistency.
  Mode mode = Mode::kSync;
  int64_t staleness_bound = 3;  // ssp
  StalenessLr staleness_lr = StalenessLr::kNone;
  double soft_sync_fraction = 0;  // sync: a step needs ceil(f * N) gradients (0: R)
  int64_t step_deadline_ms = 0;   // sync: commit a step this long after its first gradient (0: never)

  // Exponential moving averages of the variables created with average=true.
  double ema_decay = 0;          // 0: off
  bool ema_num_updates = false;  // decay = min(decay, (1 + step) / (10 + step))

  // Limits.
  uint64_t max_model_bytes = 16ull << 30;   // all variables with their slots, averages and buffers
  uint64_t max_frame_bytes = 256ull << 20;  // also bounds one tensor (a variable, a pull of rows)
  int64_t checkpoint_every_steps = 0;       // 0: not by steps (a sync commit at such a step also snapshots)

  // Derived by Validate().
  int tokens_per_step = 0;
  int resolved_init_tokens = 0;

  // Fresh gradients a sync step needs before any worker finished: R, or ceil(f * N).
  int InitialRequiredReplicas() const;
  // Workers are numbered below this (WorkerRegistry's slots): the larger of -N and -R, at least 1.
  int worker_slots() const { return std::max({1, total_replicas, replicas_to_aggregate}); }
};

const char* ReductionName(Reduction r);
const char* ModeName(Mode m);
Result<Mode> ParseMode(const std::string& name);
Result<StalenessLr> ParseStalenessLr(const std::string& name);

// TF get_init_tokens_op rule: -1 -> R; fewer than R - N -> the "Too few tokens" error.
Result<int> ResolveInitTokens(int num_tokens, int replicas_to_aggregate, int total_replicas);

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_TRAINING_CONFIG_H_
