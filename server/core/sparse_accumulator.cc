#include "core/sparse_accumulator.h"

#include <algorithm>
#include <cstring>

#include "core/accumulator.h"

namespace psd::server {

SparseAccumulator::SparseAccumulator(DType dtype, Shape declared, Reduction reduction, int64_t initial_step)
    : dtype_(dtype),
      declared_(std::move(declared)),
      reduction_(reduction),
      row_elements_(declared_.empty() ? 1 : NumElements(Shape(declared_.begin() + 1, declared_.end()))),
      step_(initial_step) {}

Status SparseAccumulator::Check(DType dtype, const Shape& declared, const SparseGradRef& g, bool accumulating) {
  auto S = [](int64_t v) { return std::to_string(v); };
  PSD_RETURN_IF_ERROR(CheckGradientDType(dtype, g.dtype));
  if (declared.empty()) return InvalidArgument("a scalar variable cannot take sparse gradients");
  if (declared[0] > kMaxRows) {
    return InvalidArgument("a variable taking sparse gradients may have at most " + S(kMaxRows) +
                           " rows on a shard; this one has " + S(declared[0]) +
                           " here: give it more rows per element (a higher rank) or more shards");
  }
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

uint32_t* SparseAccumulator::Place(int64_t row) {
  // Fibonacci hashing: the top bits of row x 2^64/phi, so runs of neighbouring rows spread out.
  size_t i = static_cast<size_t>((static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull) >> place_shift_);
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
  place_.assign(slots, 0);
  place_shift_ = shift;
  for (size_t i = 0; i < rows_.size(); ++i) *Place(rows_[i]) = static_cast<uint32_t>(i + 1);
}

template <typename T>
void SparseAccumulator::Merge(const SparseGradRef& g) {
  const size_t row_bytes = static_cast<size_t>(row_elements_) * sizeof(T);
  const auto* in = static_cast<const uint8_t*>(g.values);
  // Room for every row to be new (the table at most half full), grown geometrically: the rows
  // held are not moved again by each push's. Never beyond the variable's rows.
  ReservePlaces(rows_.size() + static_cast<size_t>(g.nnz));
  const size_t most = (rows_.size() + static_cast<size_t>(g.nnz)) * row_bytes;
  if (sums_.capacity() < most) {
    sums_.reserve(std::min(std::max(most, sums_.capacity() * 2), static_cast<size_t>(declared_[0]) * row_bytes));
  }
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
}

void SparseAccumulator::ClearRows() {
  std::fill(place_.begin(), place_.end(), 0);
  rows_.clear();
  sums_.clear();
  counts_.clear();
}

template <typename T>
void SparseAccumulator::TakeRows() {
  std::fill(place_.begin(), place_.end(), 0);
  if (reduction_ == Reduction::kMean) {
    T* v = reinterpret_cast<T*>(sums_.data());
    for (size_t r = 0; r < rows_.size(); ++r) {
      if (counts_[r] <= 1) continue;
      const T c = static_cast<T>(counts_[r]);
      for (int64_t k = 0; k < row_elements_; ++k) v[r * static_cast<size_t>(row_elements_) + k] /= c;
    }
  }
  // The result's buffers (given back by ReleaseTaken: the last take's, applied) hold the next
  // step's rows: no allocation, and no copy of the rows, once both have grown.
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
  if (counter_ == 0) ClearRows();  // nothing counted: no rows either (a gradient's rows count with it)
  FinishTake(count);
}

bool SparseAccumulator::SetGlobalStep(int64_t new_step) {
  bool lowered = new_step < step_;
  step_ = new_step;
  return lowered;
}

void SparseAccumulator::ReleaseTaken(std::vector<int64_t>* indices, std::vector<uint8_t>* values) {
  indices->swap(indices_);
  values->swap(values_);
  indices_.clear();
  values_.clear();
}

}  // namespace psd::server
