// SyncEngine: the daemon-side SyncReplicasOptimizer. It owns the variables, one dense
// accumulator per trainable variable, the optimizer, the global step and the token queue, and
// runs what TF called the chief queue runner — so no worker has to.
//
// One step, as TF's chief loop (tf_semantics.md 3.2):
//   every trainable variable's accumulator reaches `required_replicas()` fresh gradients and is
//   taken (its step += 1, MEAN over the count actually accumulated) -> the optimizer writes the
//   variable's next value into a staging buffer -> once ALL variables are taken the staged
//   values are published together, global_step += 1, and tokens_per_step tokens carrying the
//   new step are pushed. Pulls therefore always see every variable at one step.
//
// Threading and locks (lock order: a Variable's `mu` before the engine's `mu_`, never the
// reverse):
//   - `Variable::mu` guards that variable's accumulator and slots; pushes to different
//     variables accumulate in parallel, and the optimizer apply runs on the thread of the push
//     that completed the take.
//   - `mu_` guards the variable map, published/staged/spare value buffers, the global step and
//     the count of takes still pending in the current step.
//   - Published values are immutable shared buffers: a pull reply holds a reference while it is
//     being written, an apply never writes into a buffer a reader may hold.
#ifndef PSD_SERVER_SYNC_SYNC_ENGINE_H_
#define PSD_SERVER_SYNC_SYNC_ENGINE_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "config.h"
#include "optimizer/optimizer.h"
#include "psd/status.h"
#include "psd/tensor.h"
#include "sync/accumulator.h"
#include "sync/buffer.h"
#include "sync/token_queue.h"

namespace psd::server {

struct VariableDef {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  const void* initial = nullptr;  // nullptr: zeros; else exactly NumElements*DTypeSize bytes
  size_t initial_bytes = 0;
  bool trainable = true;
};

struct VariableDesc {
  std::string name;
  DType dtype;
  Shape shape;
  bool trainable;
  bool created;  // true if the call created it
};

struct GradRef {
  std::string_view name;
  DType dtype;
  Shape shape;
  const void* data;
  size_t bytes;
};

struct GradOutcome {
  bool accepted;
  int64_t step;  // the accumulator's step when the gradient was handled
};

struct PulledValue {
  std::shared_ptr<const Buffer> value;  // immutable; hold it while the bytes are in use
  DType dtype;
  Shape shape;
};

struct StepInfo {
  int64_t step;         // the new global step
  int min_gradients;    // fewest gradients averaged into one variable this step
  int max_gradients;    // most gradients averaged into one variable this step
};

struct EngineStats {
  int64_t global_step;
  int64_t accepted;
  int64_t stale;
  int64_t tokens_queued;
  int required_replicas;
  int variables;
};

// Names: 1..256 characters from [A-Za-z0-9_./:-].
Status ValidateName(std::string_view name);

class SyncEngine {
 public:
  SyncEngine(const ServerConfig& config, std::unique_ptr<Optimizer> optimizer);
  ~SyncEngine();
  SyncEngine(const SyncEngine&) = delete;
  SyncEngine& operator=(const SyncEngine&) = delete;

  // Pushes the init tokens (carrying the current global step). Call once at job start.
  void PushInitTokens(int count);

  // Create-or-get: idempotent for the same definition; a different dtype, shape or
  // trainability for an existing name is AlreadyExists with both definitions in the message.
  Result<VariableDesc> CreateVariable(const VariableDef& def);

  // Applies each gradient (validated all first: an invalid push changes nothing). `out` gets
  // one outcome per gradient, in order.
  Status Push(int64_t local_step, const std::vector<GradRef>& grads, std::vector<GradOutcome>* out);

  // Snapshot of the named variables (all of them, sorted by name, if `names` is empty) at one
  // global step, returned in *step.
  Status Pull(const std::vector<std::string>& names, std::vector<PulledValue>* out, int64_t* step);

  // Copy of an optimizer slot ("momentum", ...) of a variable.
  Result<PulledValue> GetSlot(const std::string& variable, const std::string& slot);

  // How many fresh gradients a step waits for: replicas_to_aggregate, lowered as workers declare
  // themselves finished (see WorkerRegistry). Re-evaluates pending takes.
  void SetRequiredReplicas(int required);
  int required_replicas() const { return required_.load(); }

  int64_t global_step() const { return global_step_.load(); }
  TokenQueue& tokens() { return tokens_; }
  const Optimizer& optimizer() const { return *optimizer_; }
  EngineStats Stats() const;
  std::vector<std::string> VariableNames() const;

  // Called after every committed step, outside all locks.
  void set_on_commit(std::function<void(const StepInfo&)> cb) { on_commit_ = std::move(cb); }

 private:
  struct Variable;
  Variable* FindLocked(std::string_view name) const;
  // With v->mu held: takes and applies if the step is ready. Returns true if it took.
  bool MaybeTakeLocked(Variable* v, int* count);
  // After a take (no variable lock held): records the staged value; commits if it was the last.
  void OnTaken(Variable* v, int count);
  void ReevaluateAll();

  const ServerConfig config_;
  std::unique_ptr<Optimizer> optimizer_;
  TokenQueue tokens_;
  std::function<void(const StepInfo&)> on_commit_;

  std::atomic<int64_t> global_step_{0};  // written under mu_
  std::atomic<int> required_;
  std::atomic<int64_t> accepted_{0};
  std::atomic<int64_t> stale_{0};

  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<Variable>, std::less<>> vars_;  // guarded by mu_
  int pending_takes_ = 0;      // guarded by mu_: trainable variables not yet taken this step
  int step_min_count_ = 0;     // guarded by mu_
  int step_max_count_ = 0;     // guarded by mu_
};

}  // namespace psd::server

#endif  // PSD_SERVER_SYNC_SYNC_ENGINE_H_
