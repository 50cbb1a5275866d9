// SyncReplicasOptimizer: the TensorFlow SyncReplicasOptimizer API over libpsclient, so a trainer
// written against TF's usage maps over line by line (README: "Mapping from TensorFlow").
//
//   psclient::SyncReplicasOptimizer opt(*client, /*replicas_to_aggregate=*/2, /*total=*/3);
//   psclient::GlobalStep global_step;
//   auto grads = opt.compute_gradients(loss_fn, vars);      // pulls vars, runs your gradient fn
//   auto hook = opt.make_session_run_hook(client->is_chief());
//   hook.begin(); hook.after_create_session();              // readiness + local step init
//   while (...) { auto step = opt.minimize(loss_fn, &global_step, vars); }
//
// What the daemon does for you: the accumulators, the chief queue runner (take, apply, global
// step, tokens) and the init tokens (psd --init-tokens). What stays here: the worker's local step
// (TF sync_rep_local_step), the pull -> compute -> push -> token loop, TF's argument errors.
//
// psd coming back empty (restarted without its checkpoints, or a cluster an operator told to
// start empty; README "Losing a shard's checkpoints"): once the hook ran (or the first
// apply_gradients), a variable the daemon no longer has is re-created by the chief worker from
// its host value — the latest values pulled, or the trainer's init — with the options it was
// created with; the other workers wait for it (retrying with backoff, up to
// set_variables_timeout_ms) instead of failing with kNotFound. Optimizer slots start again from
// zero and the global step from the daemon's (0).
//
// Thread-safety: not thread-safe; one optimizer per worker thread, over its own Client.
#ifndef PSCLIENT_SYNC_REPLICAS_OPTIMIZER_H_
#define PSCLIENT_SYNC_REPLICAS_OPTIMIZER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "psclient/client.h"
#include "psd/export.h"

namespace psclient {

// An owned dense tensor in host memory (8-byte aligned, so pushes are zero-copy).
class PSD_EXPORT Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, Shape shape);
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t num_elements() const { return psd::NumElements(shape_); }
  size_t bytes() const { return static_cast<size_t>(num_elements()) * psd::DTypeSize(dtype_); }
  template <typename T>
  T* data() {
    return reinterpret_cast<T*>(storage_.data());
  }
  template <typename T>
  const T* data() const {
    return reinterpret_cast<const T*>(storage_.data());
  }
  TensorView view() { return {storage_.data(), dtype_, shape_, MemoryKind::kHost}; }
  ConstTensorView view() const { return {storage_.data(), dtype_, shape_, MemoryKind::kHost}; }

 private:
  DType dtype_ = DType::kFloat32;
  Shape shape_;
  std::vector<uint64_t> storage_;
};

// A trainable variable as a worker sees it: its name on the daemon and a host copy of its value,
// refreshed by compute_gradients (one pull per step for all variables).
class PSD_EXPORT Variable {
 public:
  Variable(std::string name, DType dtype, Shape shape) : name_(std::move(name)), value_(dtype, std::move(shape)) {}
  const std::string& name() const { return name_; }
  Tensor& value() { return value_; }
  const Tensor& value() const { return value_; }
  // Create-or-get on the daemon with this variable's current host value as the initial value.
  // Typically the chief does it (TF's chief initializes variables); others wait for readiness.
  Status Create(Client& client, bool trainable = true);
  // With options: TF's variables_to_average is `options.average = true` (psd --ema-decay is
  // TF's variable_averages); a per-variable optimizer is `options.optimizer`.
  Status Create(Client& client, const VariableOptions& options);
  // The options of the last Create (what a re-creation uses).
  const VariableOptions& options() const { return options_; }

 private:
  std::string name_;
  Tensor value_;
  VariableOptions options_;
};

// TF's global_step variable: read after every apply_gradients.
struct GlobalStep {
  int64_t value = 0;
};

// TF's IndexedSlices: rows `indices` of the variable get `values` ([indices.size(), row dims...]).
struct IndexedSlices {
  std::vector<int64_t> indices;
  Tensor values;
};

// One (gradient, variable) pair: a dense `grad`, or a `sparse` one (embeddings), or neither
// (TF's None: the variable is skipped). Both at once is TF's "Unknown grad type!".
struct GradAndVar {
  std::optional<Tensor> grad;
  Variable* var = nullptr;
  std::optional<IndexedSlices> sparse;
};

// The trainer's gradient function: given the variables (values already pulled), fill one
// gradient per variable (same order; std::nullopt for None) and the loss.
using GradientFn =
    std::function<Status(const std::vector<Variable*>& vars, std::vector<std::optional<Tensor>>* grads, double* loss)>;

class SyncReplicasOptimizer;

// TF's SyncReplicasHook (make_session_run_hook).
class PSD_EXPORT SyncReplicasHook {
 public:
  // FailedPrecondition "SyncReplicasOptimizer.apply_gradient should be called before using the
  // hook." until the optimizer has seen its variables (compute_gradients, apply_gradients or
  // minimize — psd's analogue of building the graph).
  Status begin();
  // Waits (up to timeout_ms) until every variable exists on the daemon (TF: "all global
  // variables initialized"), sets the local step to the global step, and on the chief checks
  // num_tokens against the daemon's init tokens.
  Status after_create_session(int64_t timeout_ms = 60000);

 private:
  friend class SyncReplicasOptimizer;
  SyncReplicasHook(SyncReplicasOptimizer* opt, bool is_chief, int num_tokens)
      : opt_(opt), is_chief_(is_chief), num_tokens_(num_tokens) {}
  SyncReplicasOptimizer* opt_;
  bool is_chief_;
  int num_tokens_;
};

class PSD_EXPORT SyncReplicasOptimizer {
 public:
  // replicas_to_aggregate / total_num_replicas must match the daemon's (-1: take the daemon's);
  // a mismatch is reported by ok() / status().
  SyncReplicasOptimizer(Client& client, int replicas_to_aggregate = -1, int total_num_replicas = -1);
  Status status() const { return status_; }

  // Pulls every variable (one round trip, one consistent step) and calls `fn`. The first call
  // also declares the variable list (TF: building the graph), even when the pull fails because
  // the chief has not created the variables yet (kNotFound; the hook waits for them).
  Result<std::vector<GradAndVar>> compute_gradients(const GradientFn& fn, const std::vector<Variable*>& var_list);
  // Pushes the gradients tagged with the local step, waits for a token (the barrier) and makes
  // it the new local step; sets global_step->value and returns it. TF's errors:
  //   empty list          -> InvalidArgument "Must supply at least one variable"
  //   global_step nullptr -> InvalidArgument "Global step is required to check staleness"
  //   a pair without a variable, or with both a dense and a sparse gradient -> "Unknown grad type!"
  Result<int64_t> apply_gradients(const std::vector<GradAndVar>& grads_and_vars, GlobalStep* global_step);
  // compute_gradients + apply_gradients.
  Result<int64_t> minimize(const GradientFn& fn, GlobalStep* global_step, const std::vector<Variable*>& var_list);

  // TF get_init_tokens_op's rule: -1 -> replicas_to_aggregate; fewer than R - N is
  // "Too few tokens to finish the first step: <n> (given) vs <m> (needed)". Before
  // apply_gradients: "get_init_tokens_op() should be called after apply_gradients()." The daemon
  // queues the init tokens itself (psd --init-tokens); this returns the count.
  Result<int> get_init_tokens(int num_tokens = -1) const;

  SyncReplicasHook make_session_run_hook(bool is_chief, int num_tokens = -1) {
    return SyncReplicasHook(this, is_chief, num_tokens);
  }

  std::vector<std::string> get_slot_names() const { return client_.SlotNames(); }
  // Reads slot `name` of `var` from the daemon; nullopt when the optimizer has no such slot.
  Result<std::optional<Tensor>> get_slot(const Variable& var, const std::string& name) const;

  int64_t local_step() const { return local_step_; }
  const PushOutcome& last_push() const { return last_push_; }
  int64_t accepted_total() const { return accepted_total_; }
  int64_t stale_total() const { return stale_total_; }
  void set_token_timeout_ms(int64_t ms) { token_timeout_ms_ = ms; }
  // How long a worker waits for the chief to re-create variables psd lost (default 60 s).
  void set_variables_timeout_ms(int64_t ms) { variables_timeout_ms_ = ms; }
  // Variables this worker re-created after psd came back empty (as the chief), over its life.
  int64_t recreated_total() const { return recreated_total_; }
  double last_loss() const { return last_loss_; }
  Client& client() { return client_; }

 private:
  friend class SyncReplicasHook;
  // Pulls var_list_'s values into `outs`. kNotFound after the local init means psd lost them:
  // the chief re-creates them from the host values, the others wait (see the file comment).
  // The global step of the values pulled.
  Result<int64_t> PullVariables(const std::vector<std::pair<std::string, TensorView>>& outs);
  Status RecreateVariables();

  Client& client_;
  Status status_;
  int replicas_to_aggregate_;
  int total_num_replicas_;
  bool built_ = false;  // compute/apply seen: the "graph" exists
  bool gradients_applied_ = false;
  bool local_init_done_ = false;
  uint64_t epoch_ = 0;         // the client's connection epoch at the last local init
  bool values_fresh_ = false;  // var_list_'s host values came with the last token (no pull needed)
  std::vector<Variable*> var_list_;
  int64_t local_step_ = 0;
  int64_t token_timeout_ms_ = 0;
  int64_t variables_timeout_ms_ = 60000;
  int64_t recreated_total_ = 0;
  PushOutcome last_push_;
  int64_t accepted_total_ = 0;
  int64_t stale_total_ = 0;
  double last_loss_ = 0;
};

}  // namespace psclient

#endif  // PSCLIENT_SYNC_REPLICAS_OPTIMIZER_H_
