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
//   Cost: TF merges each gradient's sorted rows with all rows held (R gradients of K rows: R^2 K
//   / 2 row copies a step). psd finds a row's place through a hash table of the rows held, so a
//   gradient costs its own K rows, whatever was added before, and a take copies no row. Each row
//   is summed in arrival order, as TF's merge sums it (bit-identical sums). The take's rows stay
//   where they arrived; beside them it gives their order by index (order(): the gradients'
//   increasing runs merged), in which the engine updates them and lists them for copies. What it
//   holds beside the rows' values follows the rows sent, at most BookkeepingBytes.
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

  // The most rows a variable accumulating sparse gradients may have on a shard (a held row's
  // place is 32 bits); CheckRows says so.
  static constexpr int64_t kMaxRows = int64_t{UINT32_MAX} - 1;
  static Status CheckRows(const Shape& declared);
  // What accumulating a variable of `rows` rows may hold beyond two value-sized buffers of rows
  // (the sums accumulating, and a take's until its commit applies them: the variable's own charge
  // counts those), were every row sent: the hash table (at most half full: under 16 bytes a row),
  // the held rows' indices and counts (12), the take's order and its merge scratch (8), where
  // each gradient's rows begin (4), and the engine's copy of the taken rows' indices and order
  // (12). Each grows with the rows sent, never beyond the variable's rows.
  static uint64_t BookkeepingBytes(int64_t rows) { return static_cast<uint64_t>(rows) * 52; }

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
  // The result of the last take (until the next take or ReleaseTaken): its rows in arrival order
  // (each a row's index and its averaged sum), and order(), the positions of indices() by
  // increasing index. Dense shape of the result: [declared dim0, row dims...].
  const std::vector<int64_t>& indices() const { return indices_; }
  const std::vector<uint8_t>& values() const { return values_; }
  const std::vector<uint32_t>& order() const { return order_; }
  // Swaps the last take's result out for the buffers given (cleared: the take before's, once
  // applied), which hold the next step's rows: a step allocates nothing once they have grown.
  void ReleaseTaken(std::vector<int64_t>* indices, std::vector<uint8_t>* values, std::vector<uint32_t>* order);

 private:
  template <typename T>
  void Merge(const SparseGradRef& g);
  // The rows held become the take's result (indices_/values_, order_), averaged for MEAN; the
  // hash table forgets them. Allocates nothing (Merge reserved what it needs).
  template <typename T>
  void TakeRows();
  // order_: the positions of rows_ by increasing index (merging the gradients' runs).
  void SortOrder();
  void FinishTake(int* count);
  // Forgets the rows held (their places in the hash table too).
  void ClearRows();
  // Empties the hash table (frees it when it is much bigger than the rows it held).
  void ForgetPlaces();
  // The slot of `row` in place_: its position + 1, or the empty slot where it goes.
  uint32_t* Place(int64_t row);
  // Makes room in place_ for `rows` rows held (at most the variable's).
  void ReservePlaces(size_t rows);

  const DType dtype_;
  const Shape declared_;
  const Reduction reduction_;
  const int64_t row_elements_;
  const uint64_t hash_multiplier_;  // random, odd: which rows share slots cannot be chosen by a peer
  int64_t step_;
  int counter_ = 0;
  // The rows held, in arrival order: index, sum, and how many gradients contained it; and where
  // each gradient's new rows begin (an increasing run each).
  std::vector<int64_t> rows_;
  std::vector<uint8_t> sums_;
  std::vector<int32_t> counts_;
  std::vector<uint32_t> run_starts_;
  // Where each held row is: an open-addressing table (linear probing) of positions in rows_ plus
  // one (0: an empty slot), at most half full: its size follows the rows held, not the
  // variable's. Kept from step to step.
  std::vector<uint32_t> place_;
  int place_shift_ = 64;  // 64 - log2(place_.size())
  // The last take's result, and SortOrder's scratch.
  std::vector<int64_t> indices_;
  std::vector<uint8_t> values_;
  std::vector<uint32_t> order_;
  std::vector<uint32_t> merged_;
  // The rows so far of gradients sent in several parts, by source, until their last part.
  struct Unfinished {
    std::vector<int64_t> indices;
    std::vector<uint8_t> values;
  };
  std::map<uint64_t, Unfinished> unfinished_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_SPARSE_ACCUMULATOR_H_
