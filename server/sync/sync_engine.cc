#include "sync/sync_engine.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <set>

#include <spdlog/spdlog.h>

namespace psd::server {

struct SyncEngine::Variable {
  Variable(const VariableDef& def, Reduction reduction, int64_t step, size_t num_slots)
      : name(def.name),
        dtype(def.dtype),
        shape(def.shape),
        trainable(def.trainable),
        bytes(static_cast<size_t>(NumElements(def.shape)) * DTypeSize(def.dtype)),
        acc(def.dtype, def.shape, reduction, step) {
    slots.reserve(num_slots);
    for (size_t i = 0; i < num_slots; ++i) slots.emplace_back(bytes);
  }

  const std::string name;
  const DType dtype;
  const Shape shape;
  const bool trainable;
  const size_t bytes;

  std::mutex mu;
  DenseAccumulator acc;        // guarded by mu
  std::vector<Buffer> slots;   // guarded by mu

  std::shared_ptr<Buffer> published;  // guarded by SyncEngine::mu_
  std::shared_ptr<Buffer> staged;     // guarded by SyncEngine::mu_
  std::shared_ptr<Buffer> spare;      // guarded by SyncEngine::mu_
};

Status ValidateName(std::string_view name) {
  if (name.empty() || name.size() > 256) {
    return InvalidArgument("name must have 1 to 256 characters, got " + std::to_string(name.size()));
  }
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '.' || c == '/' || c == ':' || c == '-';
    if (!ok) return InvalidArgument("name has a character outside [A-Za-z0-9_./:-]");
  }
  return Status::Ok();
}

SyncEngine::SyncEngine(const ServerConfig& config, std::unique_ptr<Optimizer> optimizer)
    : config_(config), optimizer_(std::move(optimizer)), required_(config.replicas_to_aggregate) {}

SyncEngine::~SyncEngine() = default;

void SyncEngine::PushInitTokens(int count) {
  if (count > 0) tokens_.Push(global_step_.load(), count);
}

SyncEngine::Variable* SyncEngine::FindLocked(std::string_view name) const {
  auto it = vars_.find(name);
  return it == vars_.end() ? nullptr : it->second.get();
}

Result<VariableDesc> SyncEngine::CreateVariable(const VariableDef& def) {
  PSD_RETURN_IF_ERROR(ValidateName(def.name));
  PSD_RETURN_IF_ERROR(ValidateShape(def.shape, def.dtype, config_.max_frame_bytes));
  size_t bytes = static_cast<size_t>(NumElements(def.shape)) * DTypeSize(def.dtype);
  if (def.initial != nullptr && def.initial_bytes != bytes) {
    return InvalidArgument("initial value of '" + def.name + "' has " + std::to_string(def.initial_bytes) +
                           " bytes, shape " + ShapeString(def.shape) + " of " + DTypeName(def.dtype) +
                           " needs " + std::to_string(bytes));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (Variable* v = FindLocked(def.name)) {
    if (v->dtype != def.dtype || v->shape != def.shape || v->trainable != def.trainable) {
      return AlreadyExists("variable '" + def.name + "' exists as " + DTypeName(v->dtype) + " " +
                           ShapeString(v->shape) + (v->trainable ? " trainable" : " non-trainable") +
                           "; requested " + DTypeName(def.dtype) + " " + ShapeString(def.shape) +
                           (def.trainable ? " trainable" : " non-trainable"));
    }
    return VariableDesc{v->name, v->dtype, v->shape, v->trainable, false};
  }
  auto v = std::make_unique<Variable>(def, config_.reduction, global_step_.load(),
                                      optimizer_->SlotNames().size());
  v->published = std::make_shared<Buffer>(bytes);
  if (def.initial != nullptr && bytes) std::memcpy(v->published->data(), def.initial, bytes);
  if (v->trainable) ++pending_takes_;
  VariableDesc desc{v->name, v->dtype, v->shape, v->trainable, true};
  vars_.emplace(def.name, std::move(v));
  spdlog::info("created variable '{}' {} {}{}", def.name, DTypeName(def.dtype), ShapeString(def.shape),
               def.trainable ? "" : " (non-trainable)");
  return desc;
}

Status SyncEngine::Push(int64_t local_step, const std::vector<GradRef>& grads,
                        std::vector<GradOutcome>* out) {
  std::vector<Variable*> targets;
  targets.reserve(grads.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const GradRef& g : grads) {
      Variable* v = FindLocked(g.name);
      if (v == nullptr) return NotFound("no variable named '" + std::string(g.name) + "'");
      if (!v->trainable) return InvalidArgument("variable '" + v->name + "' is not trainable");
      if (std::find(targets.begin(), targets.end(), v) != targets.end()) {
        return InvalidArgument("variable '" + v->name + "' appears twice in one push");
      }
      targets.push_back(v);
    }
  }
  // Validate everything before touching any accumulator: a bad push changes nothing.
  for (size_t i = 0; i < grads.size(); ++i) {
    Variable* v = targets[i];
    Status s = v->acc.Validate(grads[i].dtype, grads[i].shape, grads[i].bytes);  // reads const fields
    if (!s.ok()) return Status(s.code(), "gradient for '" + v->name + "': " + s.message());
  }
  out->clear();
  out->reserve(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    Variable* v = targets[i];
    const GradRef& g = grads[i];
    bool took = false;
    int count = 0;
    {
      std::lock_guard<std::mutex> lock(v->mu);
      auto accepted = v->acc.ApplyGrad(local_step, g.dtype, g.shape, g.data, g.bytes);
      if (!accepted.ok()) return accepted.status();  // unreachable: validated above
      out->push_back({*accepted, v->acc.step()});
      if (*accepted) {
        accepted_.fetch_add(1);
        took = MaybeTakeLocked(v, &count);
      } else {
        stale_.fetch_add(1);
      }
    }
    if (took) OnTaken(v, count);
  }
  return Status::Ok();
}

bool SyncEngine::MaybeTakeLocked(Variable* v, int* count) {
  if (v->acc.step() != global_step_.load()) return false;  // already taken this step
  auto taken = v->acc.TryTakeGrad(required_.load(), count);
  if (!taken.ok() || !*taken) return false;
  std::shared_ptr<Buffer> value;
  std::shared_ptr<Buffer> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    value = v->published;
    if (v->spare && v->spare.use_count() == 1) out = std::move(v->spare);
    v->spare.reset();
  }
  if (!out) out = std::make_shared<Buffer>(v->bytes);
  ApplyArgs args{v->dtype, NumElements(v->shape), value->data(), v->acc.grad().data(), out->data(),
                 &v->slots, v->acc.step()};
  optimizer_->Apply(args);
  std::lock_guard<std::mutex> lock(mu_);
  v->staged = std::move(out);
  return true;
}

void SyncEngine::OnTaken(Variable* v, int count) {
  (void)v;
  StepInfo info{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    step_min_count_ = std::min(step_min_count_ == 0 ? INT_MAX : step_min_count_, count);
    step_max_count_ = std::max(step_max_count_, count);
    if (--pending_takes_ > 0) return;
    int trainable = 0;
    for (auto& [name, var] : vars_) {
      if (!var->trainable) continue;
      ++trainable;
      var->spare = std::move(var->published);
      var->published = std::move(var->staged);
    }
    pending_takes_ = trainable;
    int64_t step = global_step_.load() + 1;
    global_step_.store(step);
    info = {step, step_min_count_, step_max_count_};
    step_min_count_ = step_max_count_ = 0;
  }
  tokens_.Push(info.step, config_.tokens_per_step);
  if (on_commit_) on_commit_(info);
  // Gradients for the new step may already be waiting (pushed with a future local step, or
  // the requirement shrank); take them now rather than on the next push.
  ReevaluateAll();
}

void SyncEngine::ReevaluateAll() {
  std::vector<Variable*> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [name, var] : vars_) {
      if (var->trainable) all.push_back(var.get());
    }
  }
  for (Variable* v : all) {
    bool took = false;
    int count = 0;
    {
      std::lock_guard<std::mutex> lock(v->mu);
      took = MaybeTakeLocked(v, &count);
    }
    if (took) OnTaken(v, count);
  }
}

Status SyncEngine::Pull(const std::vector<std::string>& names, std::vector<PulledValue>* out,
                        int64_t* step) {
  out->clear();
  std::lock_guard<std::mutex> lock(mu_);
  if (names.empty()) {
    for (auto& [name, v] : vars_) out->push_back({v->published, v->dtype, v->shape});
  } else {
    out->reserve(names.size());
    for (const std::string& name : names) {
      Variable* v = FindLocked(name);
      if (v == nullptr) return NotFound("no variable named '" + name + "'");
      out->push_back({v->published, v->dtype, v->shape});
    }
  }
  *step = global_step_.load();
  return Status::Ok();
}

Result<PulledValue> SyncEngine::GetSlot(const std::string& variable, const std::string& slot) {
  Variable* v = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    v = FindLocked(variable);
  }
  if (v == nullptr) return NotFound("no variable named '" + variable + "'");
  auto names = optimizer_->SlotNames();
  auto it = std::find(names.begin(), names.end(), slot);
  if (it == names.end()) {
    return NotFound("optimizer '" + std::string(optimizer_->name()) + "' has no slot '" + slot + "'");
  }
  auto copy = std::make_shared<Buffer>(v->bytes);
  std::lock_guard<std::mutex> lock(v->mu);
  std::memcpy(copy->data(), v->slots[it - names.begin()].data(), v->bytes);
  return PulledValue{std::move(copy), v->dtype, v->shape};
}

void SyncEngine::SetRequiredReplicas(int required) {
  required = std::max(required, 1);
  if (required_.exchange(required) != required) {
    spdlog::info("a step now needs {} fresh gradient(s) per variable", required);
    ReevaluateAll();
  }
}

EngineStats SyncEngine::Stats() const {
  EngineStats s{};
  s.global_step = global_step_.load();
  s.accepted = accepted_.load();
  s.stale = stale_.load();
  s.tokens_queued = tokens_.size();
  s.required_replicas = required_.load();
  std::lock_guard<std::mutex> lock(mu_);
  s.variables = static_cast<int>(vars_.size());
  return s;
}

std::vector<std::string> SyncEngine::VariableNames() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> names;
  for (auto& [name, v] : vars_) names.push_back(name);
  return names;
}

}  // namespace psd::server
