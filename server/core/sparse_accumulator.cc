#include "core/sparse_accumulator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <random>

#include "core/accumulator.h"

namespace psd::server {

Status SparseAccumulator::Check(DType dtype, const Shape& declared, const SparseGradRef& g, bool accumulating) {
  auto S = [](int64_t v) { return std::to_string(v); };
  PSD_RETURN_IF_ERROR(CheckGradientDType(dtype, g.dtype));
  if (declared.empty()) return InvalidArgument("a scalar variable cannot take sparse gradients");
  if (g.values_shape.empty()) return InvalidArgument("Values cannot be 0-dimensional.");
  if (g.values_shape[0] != g.nnz) {
    return InvalidArgument("Expected " + S(g.nnz) + " non-empty input values, got " + S(g.values_shape[0]));
  }
  if (g.dense_shape) {
    const Shape& ds = *g.dense_shape;
    if (declared.size() > ds.size()) {
      return InvalidArgument("Shape mismatch: expected shape rank at least " + S(declared.size()) + ", got " +
                             S(ds.size()));
    }
    for (size_t i = 0; i < declared.size(); ++i) {
      if (ds[i] != declared[i]) {
        return InvalidArgument("Shape mismatch: expected shape dim " + S(i) + " to be " + S(declared[i]) + ", got " +
                               S(ds[i]));
      }
    }
  }
  for (int64_t i = 0; i < g.nnz; ++i) {
    int64_t idx = g.indices[i];
    if (idx >= declared[0]) {
      return InvalidArgument("Shape mismatch: index of slice " + S(i) + " exceeded limits of shape; index is " +
                             S(idx) + " exceeded " + S(declared[0]));
    }
    if (idx < 0) return InvalidArgument("index of slice " + S(i) + " is negative: " + S(idx));
    if (i > 0 && idx <= g.indices[i - 1]) {
      return InvalidArgument("indices must be strictly increasing (sorted, unique): slice " + S(i) + " has " + S(idx) +
                             " after " + S(g.indices[i - 1]));
    }
  }
  // The variable's row shape is fully known, so values must be [nnz, declared[1:]...]. TF's
  // texts: against the accumulated gradient's rank once gradients are accumulating, else "at
  // least" the declared rank (a higher rank, which TF would let through until the apply, gets
  // the exact rank psd needs).
  if (g.values_shape.size() != declared.size()) {
    const bool at_least = !accumulating && g.values_shape.size() < declared.size();
    return InvalidArgument(std::string("Shape mismatch: expected values rank ") + (at_least ? "at least " : "") +
                           S(declared.size()) + ", got " + S(g.values_shape.size()));
  }
  for (size_t i = 1; i < declared.size(); ++i) {
    if (g.values_shape[i] != declared[i]) {
      return InvalidArgument("Shape mismatch: expected values dim " + S(i) + " to be " + S(declared[i]) + ", got " +
                             S(g.values_shape[i]));
    }
  }
  const int64_t row_elements = NumElements(Shape(declared.begin() + 1, declared.end()));
  size_t want = static_cast<size_t>(g.nnz * row_elements) * DTypeSize(dtype);
  if (g.values_bytes != want) {
    return InvalidArgument("values data has " + std::to_string(g.values_bytes) + " bytes, expected " +
                           std::to_string(want));
  }
  return Status::Ok();
}

Status SparseAccumulator::CheckRows(const Shape& declared) {
  if (!declared.empty() && declared[0] > kMaxRows) {
    return InvalidArgument("a variable accumulating sparse gradients may have at most " + std::to_string(kMaxRows) +
                           " rows on a shard; this one has " + std::to_string(declared[0]) +
                           " here: give it fewer rows of more elements each, or spread it over more shards");
  }
  return Status::Ok();
}

namespace {

// A random odd multiplier per accumulator: which rows share a slot of its table cannot be chosen
// by a peer (rows picked to collide would make every lookup walk them all).
uint64_t RandomOddMultiplier() {
  uint64_t bits = 0;
  try {
    std::random_device device;
    bits = static_cast<uint64_t>(device()) << 32 | device();
  } catch (const std::exception&) {  // no entropy source: the clock, mixed (still unknown to peers)
    bits = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ull;
  }
  return bits | 1;
}

// Grows `v`'s capacity to hold `n` elements (at most `most`, all it can ever hold):
// geometrically, so appends do not move what is held again and again.
template <typename V>
void Reserve(V& v, size_t n, size_t most) {
  n = std::min(n, most);
  if (v.capacity() < n) v.reserve(std::min(std::max(n, v.capacity() * 2), most));
}

}  // namespace

SparseAccumulator::SparseAccumulator(DType dtype, Shape declared, Reduction reduction, int64_t initial_step)
    : dtype_(dtype),
      declared_(std::move(declared)),
      reduction_(reduction),
      row_elements_(declared_.empty() ? 1 : NumElements(Shape(declared_.begin() + 1, declared_.end()))),
      hash_multiplier_(RandomOddMultiplier()),
      step_(initial_step) {}

uint32_t* SparseAccumulator::Place(int64_t row) {
  // Multiplicative hashing: the top bits of row x an odd multiplier.
  size_t i = static_cast<size_t>((static_cast<uint64_t>(row) * hash_multiplier_) >> place_shift_);
  const size_t mask = place_.size() - 1;
  for (;; i = (i + 1) & mask) {
    uint32_t& at = place_[i];
    if (at == 0 || rows_[at - 1] == row) return &at;
  }
}

void SparseAccumulator::ReservePlaces(size_t rows) {
  rows = std::min(rows, static_cast<size_t>(declared_[0]));
  if (rows * 2 <= place_.size()) return;
  size_t slots = 64;
  int shift = 64 - 6;
  while (slots < rows * 2) {
    slots *= 2;
    --shift;
  }
  std::vector<uint32_t> fresh(slots, 0);  // allocated before anything changes (a failure leaves all as it was)
  place_.swap(fresh);
  place_shift_ = shift;
  for (size_t i = 0; i < rows_.size(); ++i) *Place(rows_[i]) = static_cast<uint32_t>(i + 1);
}

void SparseAccumulator::ForgetPlaces() {
  // A table much bigger than the rows it held (a burst of rows once) goes, rather than being
  // cleared whole every step; the next rows make one of their size.
  if (place_.size() > 8 * std::max<size_t>(rows_.size(), 64)) {
    std::vector<uint32_t>().swap(place_);
    place_shift_ = 64;
  } else {
    std::fill(place_.begin(), place_.end(), 0);
  }
}

template <typename T>
void SparseAccumulator::Merge(const SparseGradRef& g) {
  const size_t row_bytes = static_cast<size_t>(row_elements_) * sizeof(T);
  const size_t rows = static_cast<size_t>(declared_[0]);
  const size_t most = rows_.size() + static_cast<size_t>(g.nnz);  // every row new
  // Everything this gradient may need is allocated first: the loop below allocates nothing, so
  // an allocation that fails (the push fails) leaves the rows held as they were.
  ReservePlaces(most);
  Reserve(rows_, most, rows);
  Reserve(counts_, most, rows);
  Reserve(sums_, most * row_bytes, rows * row_bytes);
  Reserve(order_, most, rows);  // the take's, so that a take allocates nothing
  Reserve(merged_, most, rows);
  Reserve(run_starts_, run_starts_.size() + 2, rows + 1);
  const auto* in = static_cast<const uint8_t*>(g.values);
  const size_t first_new = rows_.size();
  for (int64_t b = 0; b < g.nnz; ++b) {
    const int64_t row = g.indices[b];  // checked: 0 <= row < declared_[0]
    const uint8_t* y = in + static_cast<size_t>(b) * row_bytes;
    uint32_t* at = Place(row);
    if (*at == 0) {
      sums_.insert(sums_.end(), y, y + row_bytes);
      rows_.push_back(row);
      counts_.push_back(1);
      *at = static_cast<uint32_t>(rows_.size());
    } else {  // held: the row held first plus this one (TF's merge adds in the same order), count + 1
      T* x = reinterpret_cast<T*>(sums_.data() + static_cast<size_t>(*at - 1) * row_bytes);
      const T* add = reinterpret_cast<const T*>(y);
      for (int64_t k = 0; k < row_elements_; ++k) x[k] = x[k] + add[k];
      ++counts_[*at - 1];
    }
  }
  // This gradient's new rows follow in increasing order (its indices do): one run.
  if (rows_.size() > first_new) run_starts_.push_back(static_cast<uint32_t>(first_new));
}

void SparseAccumulator::ClearRows() {
  ForgetPlaces();
  rows_.clear();
  sums_.clear();
  counts_.clear();
  run_starts_.clear();
}

void SparseAccumulator::SortOrder() {
  // Each gradient's new rows are one increasing run of rows_: merged pairwise, log2(gradients)
  // passes over positions (none for one gradient).
  const size_t n = rows_.size();
  order_.resize(n);  // within the capacity Merge reserved, as below
  for (size_t i = 0; i < n; ++i) order_[i] = static_cast<uint32_t>(i);
  std::vector<uint32_t>& runs = run_starts_;
  if (runs.size() <= 1) {
    runs.clear();
    return;
  }
  runs.push_back(static_cast<uint32_t>(n));
  const auto by_row = [this](uint32_t a, uint32_t b) { return rows_[a] < rows_[b]; };
  while (runs.size() > 2) {
    merged_.resize(n);
    size_t kept = 0;
    for (size_t r = 0; r + 1 < runs.size(); r += 2) {
      const uint32_t begin = runs[r], mid = runs[r + 1];
      const uint32_t end = r + 2 < runs.size() ? runs[r + 2] : mid;
      std::merge(order_.begin() + begin, order_.begin() + mid, order_.begin() + mid, order_.begin() + end,
                 merged_.begin() + begin, by_row);
      runs[kept++] = begin;
    }
    runs[kept++] = static_cast<uint32_t>(n);
    runs.resize(kept);
    order_.swap(merged_);
  }
  runs.clear();
}

template <typename T>
void SparseAccumulator::TakeRows() {
  ForgetPlaces();
  if (reduction_ == Reduction::kMean) {
    T* v = reinterpret_cast<T*>(sums_.data());
    for (size_t r = 0; r < rows_.size(); ++r) {
      if (counts_[r] <= 1) continue;
      const T c = static_cast<T>(counts_[r]);
      for (int64_t k = 0; k < row_elements_; ++k) v[r * static_cast<size_t>(row_elements_) + k] /= c;
    }
  }
  SortOrder();
  // The rows and sums are the result as they are (no copy); ReleaseTaken gives the accumulator
  // the last take's buffers for the next step's rows.
  indices_.swap(rows_);
  values_.swap(sums_);
  rows_.clear();
  sums_.clear();
  counts_.clear();
}

Result<bool> SparseAccumulator::ApplyGrad(int64_t local_step, const SparseGradRef& g, bool counts, uint64_t source) {
  PSD_RETURN_IF_ERROR(Validate(g));
  auto part = unfinished_.find(source);
  if (local_step < step_) {
    if (part != unfinished_.end()) unfinished_.erase(part);  // stale: the whole gradient goes
    return false;
  }
  if (!counts || part != unfinished_.end()) {
    Unfinished& u = part != unfinished_.end() ? part->second : unfinished_[source];
    const auto* bytes = static_cast<const uint8_t*>(g.values);
    if (g.nnz > 0 && !u.indices.empty() && g.indices[0] <= u.indices.back()) {
      return InvalidArgument("a sparse gradient's rows continue at index " + std::to_string(g.indices[0]) +
                             ", not after the last part's " + std::to_string(u.indices.back()));
    }
    // Both grown first (geometrically: a gradient of many frames is not copied again at each):
    // a failed allocation leaves the rows kept so far consistent.
    const size_t rows = static_cast<size_t>(declared_[0]);  // its rows increase: at most this many
    Reserve(u.indices, u.indices.size() + static_cast<size_t>(g.nnz), rows);
    Reserve(u.values, u.values.size() + g.values_bytes, rows * static_cast<size_t>(row_elements_) * DTypeSize(dtype_));
    u.indices.insert(u.indices.end(), g.indices, g.indices + g.nnz);
    u.values.insert(u.values.end(), bytes, bytes + g.values_bytes);
    if (!counts) return true;
    Unfinished whole = std::move(u);
    unfinished_.erase(source);
    Shape shape = g.values_shape;
    shape[0] = static_cast<int64_t>(whole.indices.size());
    return ApplyGrad(local_step,
                     {whole.indices.data(), static_cast<int64_t>(whole.indices.size()), g.dtype, std::move(shape),
                      whole.values.data(), whole.values.size(), g.dense_shape},
                     /*counts=*/true, source);
  }
  if (dtype_ == DType::kFloat32) {
    Merge<float>(g);
  } else {
    Merge<double>(g);
  }
  if (counts) ++counter_;
  return true;
}

void SparseAccumulator::FinishTake(int* count) {
  ++step_;
  if (dtype_ == DType::kFloat32) {
    TakeRows<float>();
  } else {
    TakeRows<double>();
  }
  *count = counter_;
  counter_ = 0;
}

Result<bool> SparseAccumulator::TryTakeGrad(int num_required, int* count) {
  if (num_required <= 0) {
    return InvalidArgument("Argument num_required must be positive, but was " + std::to_string(num_required));
  }
  if (counter_ < num_required) return false;
  FinishTake(count);
  return true;
}

void SparseAccumulator::ForceTake(int* count) {
  if (counter_ > 0) return FinishTake(count);
  // Nothing counted, so no rows either (a gradient's rows count with it): an empty result, and
  // the row buffers stay where they are for the next step's rows.
  ClearRows();
  indices_.clear();
  values_.clear();
  order_.clear();
  ++step_;
  *count = 0;
}

bool SparseAccumulator::SetGlobalStep(int64_t new_step) {
  bool lowered = new_step < step_;
  step_ = new_step;
  return lowered;
}

void SparseAccumulator::ReleaseTaken(std::vector<int64_t>* indices, std::vector<uint8_t>* values,
                                     std::vector<uint32_t>* order) {
  indices->swap(indices_);
  values->swap(values_);
  order->swap(order_);
  indices_.clear();  // meant to come back cleared (applied); their contents are not rows of ours
  values_.clear();
  // What came back (the last take's, applied) holds the next step's rows, unless rows came in
  // meanwhile; the rest goes: two sets of row buffers in all, this one and the engine's.
  if (rows_.empty() && rows_.capacity() < indices_.capacity()) rows_.swap(indices_);
  if (sums_.empty() && sums_.capacity() < values_.capacity()) sums_.swap(values_);
  std::vector<int64_t>().swap(indices_);
  std::vector<uint8_t>().swap(values_);
  order_.clear();
}

}  // namespace psd::server
