#include "psclient/sync_replicas_optimizer.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace psclient {

Tensor::Tensor(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)), storage_((bytes() + 7) / 8, 0) {}

Status Variable::Create(Client& client, bool trainable) {
  VariableOptions options;
  options.trainable = trainable;
  return Create(client, options);
}

Status Variable::Create(Client& client, const VariableOptions& options) {
  options_ = options;
  auto info = client.CreateVariable(name_, value_.view(), options);
  return info.ok() ? Status::Ok() : info.status();
}

SyncReplicasOptimizer::SyncReplicasOptimizer(Client& client, int replicas_to_aggregate, int total_num_replicas)
    : client_(client), replicas_to_aggregate_(replicas_to_aggregate), total_num_replicas_(total_num_replicas) {
  const JobConfig& cfg = client_.config();
  if (replicas_to_aggregate_ == -1) replicas_to_aggregate_ = cfg.replicas_to_aggregate;
  // TF: total_num_replicas defaults to replicas_to_aggregate.
  if (total_num_replicas_ == -1) {
    total_num_replicas_ = replicas_to_aggregate == -1 ? cfg.total_replicas : replicas_to_aggregate_;
  }
  if (replicas_to_aggregate_ != cfg.replicas_to_aggregate || total_num_replicas_ != cfg.total_replicas) {
    status_ = psd::FailedPrecondition(
        "this trainer asks for replicas_to_aggregate=" + std::to_string(replicas_to_aggregate_) +
        " total_num_replicas=" + std::to_string(total_num_replicas_) + " but psd runs with " +
        std::to_string(cfg.replicas_to_aggregate) + " and " + std::to_string(cfg.total_replicas) +
        " (psd --replicas-to-aggregate / --total-replicas)");
  }
  local_step_ = client_.initial_global_step();
}

Result<std::vector<GradAndVar>> SyncReplicasOptimizer::compute_gradients(const GradientFn& fn,
                                                                         const std::vector<Variable*>& var_list) {
  PSD_RETURN_IF_ERROR(status_);
  if (var_list.empty()) return psd::InvalidArgument("Must supply at least one variable");
  std::vector<std::pair<std::string, TensorView>> outs;
  for (Variable* v : var_list) {
    if (v == nullptr) return psd::InvalidArgument("var_list has a null variable");
    outs.emplace_back(v->name(), v->value().view());
  }
  // The "graph" exists from here on, even if the variables are not on the daemon yet (a
  // non-chief worker before the chief created them): the hook's readiness wait covers that.
  built_ = true;
  bool fresh = values_fresh_ && var_list == var_list_;
  values_fresh_ = false;
  var_list_ = var_list;
  if (!fresh) {
    auto pulled = PullVariables(outs);
    if (!pulled.ok()) return pulled.status();
    if (local_init_done_ && epoch_ != client_.connection_epoch()) {
      // The connection was re-established (the cluster restored a checkpoint or its live copies):
      // TF's local_step_init_op, at the step of the values these gradients are computed on, so the
      // gradient function sees it too (local_step()).
      local_step_ = *pulled;
      epoch_ = client_.connection_epoch();
    }
  }
  std::vector<std::optional<Tensor>> grads(var_list.size());
  double loss = 0;
  PSD_RETURN_IF_ERROR(fn(var_list, &grads, &loss));
  if (grads.size() != var_list.size()) {
    return psd::InvalidArgument("the gradient function returned " + std::to_string(grads.size()) + " gradients for " +
                                std::to_string(var_list.size()) + " variables");
  }
  last_loss_ = loss;
  std::vector<GradAndVar> out;
  out.reserve(var_list.size());
  for (size_t i = 0; i < var_list.size(); ++i) out.push_back({std::move(grads[i]), var_list[i], std::nullopt});
  return out;
}

Result<int64_t> SyncReplicasOptimizer::apply_gradients(const std::vector<GradAndVar>& grads_and_vars,
                                                       GlobalStep* global_step) {
  PSD_RETURN_IF_ERROR(status_);
  if (grads_and_vars.empty()) return psd::InvalidArgument("Must supply at least one variable");
  if (global_step == nullptr) return psd::InvalidArgument("Global step is required to check staleness");
  std::vector<Gradient> grads;
  std::vector<SparseGradient> sparse;
  for (const GradAndVar& gv : grads_and_vars) {
    if (gv.var == nullptr || (gv.grad && gv.sparse)) return psd::InvalidArgument("Unknown grad type!");
    if (gv.grad) grads.push_back({gv.var->name(), gv.grad->view()});
    if (gv.sparse) sparse.push_back({gv.var->name(), gv.sparse->indices, gv.sparse->values.view(), std::nullopt});
    // Neither: None, no accumulator, passes through.
  }
  built_ = true;
  gradients_applied_ = true;
  if (!local_init_done_ || epoch_ != client_.connection_epoch()) {
    // No hook ran, or the connection was re-established (the daemon may have restarted from a
    // checkpoint): do TF's local_step_init_op so the next gradients are fresh.
    auto st = client_.GlobalStep();
    if (!st.ok()) return st.status();
    local_step_ = *st;
    local_init_done_ = true;
    epoch_ = client_.connection_epoch();
  }
  if (grads.empty() && sparse.empty()) return psd::InvalidArgument("Must supply at least one variable");
  // The next step's values come back with the token: push, barrier and pull in one round trip.
  std::vector<std::pair<std::string, TensorView>> pull_after;
  for (Variable* v : var_list_) pull_after.emplace_back(v->name(), v->value().view());
  values_fresh_ = false;
  auto out = client_.Push(local_step_, grads, sparse, /*wait_token=*/true, token_timeout_ms_, &pull_after);
  if (!out.ok() && out.status().code() == Code::kNotFound && local_init_done_) {
    // psd came back without the variables between the pull and this push: bring them back (or
    // wait for them); these gradients were computed on values psd no longer has, so they go.
    auto pulled = PullVariables(pull_after);
    if (!pulled.ok()) return pulled.status();
    values_fresh_ = true;
    return psd::Aborted("psd lost the variables (" + out.status().message() +
                        "); they are back: compute the gradients again from the values pulled");
  }
  if (!out.ok()) return out.status();
  values_fresh_ = out->pulled_step >= 0;
  last_push_ = std::move(*out);
  accepted_total_ += last_push_.accepted();
  stale_total_ += last_push_.stale();
  if (!last_push_.token_status.ok()) return last_push_.token_status;
  local_step_ = last_push_.token;
  global_step->value = last_push_.token;
  return local_step_;
}

Result<int64_t> SyncReplicasOptimizer::minimize(const GradientFn& fn, GlobalStep* global_step,
                                                const std::vector<Variable*>& var_list) {
  auto gv = compute_gradients(fn, var_list);
  if (!gv.ok()) return gv.status();
  return apply_gradients(*gv, global_step);
}

Status SyncReplicasOptimizer::RecreateVariables() {
  for (Variable* v : var_list_) {
    auto info = client_.CreateVariable(v->name(), v->value().view(), v->options());
    if (!info.ok()) return info.status();
    if (info->created) ++recreated_total_;
  }
  return Status::Ok();
}

Result<int64_t> SyncReplicasOptimizer::PullVariables(const std::vector<std::pair<std::string, TensorView>>& outs) {
  auto step = client_.Pull(outs);
  if (step.ok() || step.status().code() != Code::kNotFound || !local_init_done_) return step;
  // The variables existed at the local init: psd came back empty.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(variables_timeout_ms_);
  auto backoff = std::chrono::milliseconds(20);
  for (;;) {
    bool chief = client_.is_chief();
    Status made = chief ? RecreateVariables() : Status::Ok();
    step = made.ok() ? client_.Pull(outs) : Result<int64_t>(made);
    if (step.ok()) return step;
    Code code = step.status().code();
    // kUnavailable: psd (or the cluster) is not serving yet; kNotFound: not re-created yet.
    if ((code != Code::kNotFound && code != Code::kUnavailable) || std::chrono::steady_clock::now() >= deadline) {
      return psd::Status(
          code, std::string("psd lost the variables (it came back without its checkpoints) and ") +
                    (chief ? "this chief worker could not re-create them" : "the chief worker did not re-create them") +
                    " within " + std::to_string(variables_timeout_ms_) +
                    " ms (set_variables_timeout_ms): " + step.status().message());
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
}

Result<int> SyncReplicasOptimizer::get_init_tokens(int num_tokens) const {
  if (!built_) return psd::FailedPrecondition("get_init_tokens_op() should be called after apply_gradients().");
  int needed = replicas_to_aggregate_ - total_num_replicas_;
  if (num_tokens == -1) return replicas_to_aggregate_;
  if (num_tokens < needed) {
    return psd::InvalidArgument("Too few tokens to finish the first step: " + std::to_string(num_tokens) +
                                " (given) vs " + std::to_string(needed) + " (needed)");
  }
  return num_tokens;
}

Result<std::optional<Tensor>> SyncReplicasOptimizer::get_slot(const Variable& var, const std::string& name) const {
  auto names = client_.SlotNames();
  if (std::find(names.begin(), names.end(), name) == names.end()) return std::optional<Tensor>();
  Tensor t(var.value().dtype(), var.value().shape());
  PSD_RETURN_IF_ERROR(client_.GetSlot(var.name(), name, t.view()));
  return std::optional<Tensor>(std::move(t));
}

Status SyncReplicasHook::begin() {
  if (!opt_->built_) {
    return psd::FailedPrecondition("SyncReplicasOptimizer.apply_gradient should be called before using the hook.");
  }
  return Status::Ok();
}

Status SyncReplicasHook::after_create_session(int64_t timeout_ms) {
  PSD_RETURN_IF_ERROR(begin());
  if (is_chief_) {
    auto tokens = opt_->get_init_tokens(num_tokens_);
    if (!tokens.ok()) return tokens.status();
    int daemon_tokens = opt_->client_.config().init_tokens;
    if (num_tokens_ != -1 && *tokens != daemon_tokens) {
      return psd::FailedPrecondition("num_tokens=" + std::to_string(*tokens) + " but psd queued " +
                                     std::to_string(daemon_tokens) + " init tokens; start psd with --init-tokens " +
                                     std::to_string(*tokens));
    }
  }
  // Readiness: every variable exists on the daemon.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::vector<std::pair<std::string, TensorView>> outs;
  for (Variable* v : opt_->var_list_) outs.emplace_back(v->name(), v->value().view());
  for (;;) {
    auto step = opt_->client_.Pull(outs);
    if (step.ok()) break;
    if (step.status().code() != Code::kNotFound || std::chrono::steady_clock::now() >= deadline) {
      return psd::Status(
          step.status().code(),
          "Init operations did not make model ready for SyncReplicasOptimizer local_init: " + step.status().message());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto st = opt_->client_.GlobalStep();
  if (!st.ok()) return st.status();
  opt_->local_step_ = *st;
  opt_->local_init_done_ = true;
  opt_->epoch_ = opt_->client_.connection_epoch();
  return Status::Ok();
}

}  // namespace psclient
