// DenseAccumulator: TensorFlow's ConditionalAccumulator semantics for one variable
// (shared/reference/tf_semantics.md section 1), without the blocking: the TrainingEngine decides
// when to take.
//
//   apply: stale iff local_step < step(); stale gradients are dropped (counter unchanged).
//          Accepted ones are added into the running sum; counter += 1.
//   take:  needs counter >= num_required (> 0); step += 1; MEAN divides by the counter actually
//          accumulated (may exceed num_required), SUM returns the raw sum; counter = 0.
//   set_global_step: overwrite (a lower value is allowed, as TF, and reported), keeps pending
//          gradients.
// Deliberate deviation from TF: shape/dtype/size are validated even for stale gradients, so a
// malformed push always gets an error.
//
// Thread-safety: none; the owner serializes all calls (TrainingEngine: the variable's mutex).
#ifndef PSD_SERVER_CORE_ACCUMULATOR_H_
#define PSD_SERVER_CORE_ACCUMULATOR_H_

#include <cstdint>

#include "core/buffer.h"
#include "core/training_config.h"
#include "psd/status.h"
#include "psd/tensor.h"

namespace psd::server {

// "dtype mismatch: accumulator is float32, gradient is float64", shared by both accumulators.
Status CheckGradientDType(DType want, DType got);

// dst[i] += src[i] over n elements of dtype (float32 or float64), dst and src not overlapping.
void AddInto(DType dtype, void* dst, const void* src, int64_t n);

class DenseAccumulator {
 public:
  DenseAccumulator(DType dtype, Shape shape, Reduction reduction, int64_t initial_step);

  // Checks that a gradient matches this accumulator's dtype, shape and byte size. Errors use
  // TF's wording ("Shape mismatch: expected [3,2], got [2,2]").
  Status Validate(DType dtype, const Shape& shape, size_t bytes) const {
    return Check(dtype_, shape_, dtype, shape, bytes);
  }
  // The same check for an accumulator of `want_dtype`/`want_shape` that need not exist (the
  // engine validates a whole push before any accumulator is touched).
  static Status Check(DType want_dtype, const Shape& want_shape, DType dtype, const Shape& shape, size_t bytes);

  // TF apply_grad. Returns true when accepted, false when stale (dropped).
  Result<bool> ApplyGrad(int64_t local_step, DType dtype, const Shape& shape, const void* data, size_t bytes);
  // ApplyGrad for a gradient that already passed Check against this accumulator's dtype and
  // shape (the engine validates a whole push first): no second validation on the hot path.
  bool AddChecked(int64_t local_step, DType dtype, const void* data);

  // TF take_grad without the wait. Errors with "Argument num_required must be positive, but was
  // <n>" for num_required <= 0. Returns false (nothing changes) while counter < num_required.
  // On success *count is the number of gradients taken and the result is grad() / divisor()
  // (MEAN: the count; SUM: 1), valid until the next ApplyGrad. The division is left to the
  // consumer so the optimizer can fuse it into its own pass over the memory (TF divides in
  // place first: the same arithmetic, one pass less here).
  Result<bool> TryTakeGrad(int num_required, int* count);

  // Takes whatever is there (a soft-sync step deadline passed); *count may be 0 (then grad()
  // is meaningless). step += 1.
  void ForceTake(int* count);

  // TF set_global_step. Returns true when the new step is lower than the current one (TF only
  // warns about that and still lowers it).
  bool SetGlobalStep(int64_t new_step);

  int num_accumulated() const { return counter_; }
  int64_t step() const { return step_; }
  const Buffer& grad() const { return sum_; }
  double divisor() const { return divisor_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }

 private:
  const DType dtype_;
  const Shape shape_;
  const Reduction reduction_;
  const int64_t num_elements_;
  int64_t step_;
  int counter_ = 0;
  double divisor_ = 1;  // of the last take
  Buffer sum_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_ACCUMULATOR_H_
