// ShardSnapshot: one shard's training state at a step boundary (values, slots, moving averages,
// placements) as the training core hands it out and takes it back (TrainingEngine::RequestSnapshot,
// Restore). Values are shared immutable buffers, so a snapshot costs no copy of them. Checkpoint
// files are one way to keep it (checkpoint/checkpoint.h).
#ifndef PSD_SERVER_CORE_SNAPSHOT_H_
#define PSD_SERVER_CORE_SNAPSHOT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/var_placement.h"
#include "psd/tensor.h"

namespace psd::server {

struct VariableSnapshot {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  bool trainable = true;
  bool average = false;
  std::string optimizer;  // empty: the job's
  std::shared_ptr<const Buffer> value;
  std::vector<std::pair<std::string, std::shared_ptr<const Buffer>>> slots;
  std::shared_ptr<const Buffer> shadow;  // moving average, if `average`
  VarPlacement placement;                // cluster: the whole variable's placement (name empty: none)
  int aggregation = 0;                   // psd::server::Aggregation
  bool sync_on_read = false;             // `value` is the replicas' combined value
};

// One shard's part of a checkpoint.
struct ShardSnapshot {
  int64_t step = 0;  // the global step the state reflects
  // The cluster epoch of the engine that took it (0: a single daemon): a part written for an
  // epoch the cluster has left is never sealed into another epoch's checkpoint.
  uint64_t epoch = 0;
  double learning_rate = 0;
  std::string optimizer;  // the job's optimizer (restoring under another one is refused)
  std::vector<VariableSnapshot> variables;
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_SNAPSHOT_H_
