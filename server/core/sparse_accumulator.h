// SparseAccumulator: TensorFlow's SparseConditionalAccumulator semantics for one variable's
// IndexedSlices gradients (shared/reference/tf_semantics.md section 2), without the blocking.
//
//   A gradient is (indices, values[nnz, row...], optional dense_shape). Same staleness rule,
//   counter and take as the dense accumulator. Rows with equal indices are summed and counted;
//   MEAN divides each row by its own count (the number of gradients that contained it).
//   Checks run in TF's order with TF's messages; psd adds two that protect the variable's
//   memory: indices must be strictly increasing (sorted, unique) and non-negative. Clients that
//   hold unsorted or duplicated indices coalesce them first (psclient does).
//
// Thread-safety: none; the owner serializes all calls.
#ifndef PSD_SERVER_CORE_SPARSE_ACCUMULATOR_H_
#define PSD_SERVER_CORE_SPARSE_ACCUMULATOR_H_

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "core/training_config.h"
#include "psd/status.h"
#include "psd/tensor.h"

namespace psd::server {

struct SparseGradRef {
  const int64_t* indices;
  int64_t nnz;
  DType dtype;
  Shape values_shape;  // [nnz, row dims...]
  const void* values;
  size_t values_bytes;
  std::optional<Shape> dense_shape;  // TF has_known_shape
};

class SparseAccumulator {
 public:
  // `declared` is the variable's shape: its first dimension bounds the indices.
  SparseAccumulator(DType dtype, Shape declared, Reduction reduction, int64_t initial_step);

  Status Validate(const SparseGradRef& g) const { return Check(dtype_, declared_, g, counter_ > 0); }
  // The same checks for a variable of `dtype`/`declared` whose accumulator need not exist;
  // `accumulating` only words one message as TF does.
  static Status Check(DType dtype, const Shape& declared, const SparseGradRef& g, bool accumulating);
  // Returns true when accepted, false when stale. `counts` false: some of a gradient's rows, more
  // of them to come from `source` (a gradient bigger than a frame; each part's rows follow the
  // last's). They are kept apart until its last rows come (counts true, the same source): then the
  // whole gradient is added and counted at once, or dropped whole if a take made it stale
  // meanwhile, as TensorFlow's apply_grad is all or nothing. A take never sees a gradient's first
  // rows without its last.
  Result<bool> ApplyGrad(int64_t local_step, const SparseGradRef& g, bool counts = true, uint64_t source = 0);
  // The rows kept for `source`'s unfinished gradient go (its push was cut off).
  void DropUnfinished(uint64_t source) { unfinished_.erase(source); }
  // As DenseAccumulator::TryTakeGrad. On success the averaged rows are in indices()/values().
  Result<bool> TryTakeGrad(int num_required, int* count);
  // Takes whatever is there (a step deadline passed); *count may be 0.
  void ForceTake(int* count);
  bool SetGlobalStep(int64_t new_step);

  int num_accumulated() const { return counter_; }
  int64_t step() const { return step_; }
  // The result of the last take; valid until the next ApplyGrad. Dense shape of the result:
  // [declared dim0, row dims...].
  const std::vector<int64_t>& indices() const { return indices_; }
  const std::vector<uint8_t>& values() const { return values_; }
  // Moves the last take's rows out (the accumulator no longer needs them).
  void ReleaseTaken(std::vector<int64_t>* indices, std::vector<uint8_t>* values);

 private:
  template <typename T>
  void Merge(const SparseGradRef& g);
  template <typename T>
  void Average();
  void FinishTake(int* count);

  const DType dtype_;
  const Shape declared_;
  const Reduction reduction_;
  const int64_t row_elements_;
  int64_t step_;
  int counter_ = 0;
  bool merged_ = false;           // rows were merged since the last take (counter_ may still be 0)
  std::vector<int64_t> indices_;  // sorted
  std::vector<uint8_t> values_;   // indices_.size() rows
  std::vector<int32_t> counts_;   // per row
  // The rows so far of gradients sent in several parts, by source, until their last part.
  struct Unfinished {
    std::vector<int64_t> indices;
    std::vector<uint8_t> values;
  };
  std::map<uint64_t, Unfinished> unfinished_;
  // Scratch for merges (kept to avoid reallocating every push).
  std::vector<int64_t> scratch_indices_;
  std::vector<uint8_t> scratch_values_;
  std::vector<int32_t> scratch_counts_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_SPARSE_ACCUMULATOR_H_
