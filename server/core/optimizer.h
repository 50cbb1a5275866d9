// Optimizer: the server-side update rule applied to a trainable variable with its aggregated
// gradient. Slots (per-variable state such as momentum) live beside the variable and are passed
// in; an optimizer holds only its hyper-parameters. Formulas follow TensorFlow's training ops
// (ApplyGradientDescent, ApplyMomentum, ApplyAdagrad, ApplyAdam, ApplyRMSProp, ApplyFtrl); the
// README lists them.
//
// Thread-safety: Apply/ApplySparse may run concurrently for different variables, UpdateSparse for
// disjoint rows of one. Hyper-parameters are immutable after construction except the learning
// rate, which the engine passes per call.
#ifndef PSD_SERVER_CORE_OPTIMIZER_H_
#define PSD_SERVER_CORE_OPTIMIZER_H_

#include <memory>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "psd/status.h"
#include "psd/tensor.h"

namespace psd::server {

struct OptimizerParams {
  std::string name = "sgd";  // sgd, momentum, adagrad, adam, rmsprop, ftrl
  double learning_rate = 0.01;
  double momentum = 0.9;  // momentum; rmsprop's momentum uses rms_momentum
  bool nesterov = false;
  double beta1 = 0.9;                // adam
  double beta2 = 0.999;              // adam
  double epsilon = 1e-8;             // adam, rmsprop (TF1 default 1e-10 for rmsprop is not used)
  double initial_accumulator = 0.1;  // adagrad, ftrl
  double rho = 0.9;                  // rmsprop decay
  double rms_momentum = 0.0;         // rmsprop
  double l1 = 0.0;                   // ftrl
  double l2 = 0.0;                   // ftrl
  double lr_power = -0.5;            // ftrl

  // Checks names and ranges; messages name the flag.
  Status Validate() const;
};

struct SlotSpec {
  std::string name;
  double initial;  // every element starts at this value
};
// The most slots an optimizer has (Adam's m and v, RMSProp's, FTRL's): the updates keep their
// pointers on the stack, so an update running on an apply thread allocates nothing (and cannot
// throw there).
inline constexpr size_t kMaxSlots = 2;

struct ApplyArgs {
  DType dtype;
  int64_t num_elements;
  const void* value;  // the current value (read-only: pulls may be reading it)
  const void* grad;   // the aggregated gradient
  // Where the new value goes: may equal value only when no reader exists, and may equal grad (the
  // sync take applies into the taken sum): every update reads an element's gradient before it
  // writes that element.
  void* out;
  std::vector<Buffer>* slots;  // this variable's slots, in Slots() order; updated in place
  int64_t slot_offset;         // element of the slots that corresponds to value[0] (parallel ranges)
  int64_t step;                // 1-based count of updates (Adam's t)
  double learning_rate;
  double grad_divisor = 1;  // MEAN: the number of gradients summed in `grad` (divided, as TF does)
};

// Updates only the listed rows (lazy semantics: slots of untouched rows do not move, Adam's
// bias correction still uses the global step).
struct SparseApplyArgs {
  DType dtype;
  int64_t row_elements;  // elements per row
  void* value;           // updated in place, rows only
  const int64_t* rows;   // row indices, distinct, in range
  int64_t num_rows;
  const void* grad;  // num_rows x row_elements
  std::vector<Buffer>* slots;
  int64_t step;
  double learning_rate;
  // Null: rows increase. Else rows[order[0]], rows[order[1]], ... increase: rows are updated in
  // that order (and the slot rows listed in it, Buffer::MarkChanged).
  const uint32_t* order = nullptr;
  // The slot rows were listed already (Optimizer::ListSparseSlots): UpdateSparse only updates.
  bool slots_listed = false;
  // Non-null: the n-th row's gradient (in the order above) is at grad_rows[n], not in `grad` (a
  // sync step's rows in index order, their sums where each stripe of the accumulator left them).
  const void* const* grad_rows = nullptr;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  const OptimizerParams& params() const { return params_; }
  const std::string& name() const { return params_.name; }
  virtual std::vector<SlotSpec> Slots() const { return {}; }
  std::vector<std::string> SlotNames() const;

  // Dense update of num_elements values, split into ranges processed by `Range`.
  void Apply(const ApplyArgs& args) const;
  // ListSparseSlots, then UpdateSparse.
  void ApplySparse(const SparseApplyArgs& args) const;
  // Lists the slot rows a sparse update writes (Buffer::MarkChanged), in the args' order: one
  // caller at a time for a variable, before UpdateSparse.
  void ListSparseSlots(const SparseApplyArgs& args) const;
  // The update itself (slots listed already: args.slots_listed); concurrently with others of
  // disjoint rows of the same variable.
  void UpdateSparse(const SparseApplyArgs& args) const;

 protected:
  explicit Optimizer(OptimizerParams params) : params_(std::move(params)) {}
  // Updates elements [begin, end): value/out/grad/slots are indexed by the same element index.
  // `slot_ptrs` point at each slot's element 0. float and double variants.
  // The gradient of element i is grad[i] / div (the MEAN's division, fused into this pass).
  virtual void Range(const float* value, const float* grad, float* out, float** slots, int64_t begin, int64_t end,
                     int64_t step, double lr, float div) const = 0;
  virtual void Range(const double* value, const double* grad, double* out, double** slots, int64_t begin, int64_t end,
                     int64_t step, double lr, double div) const = 0;

 private:
  OptimizerParams params_;
};

Result<std::unique_ptr<Optimizer>> MakeOptimizer(const OptimizerParams& params);

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_OPTIMIZER_H_
