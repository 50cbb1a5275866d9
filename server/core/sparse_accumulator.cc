#include "core/sparse_accumulator.h"

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

template <typename T>
void SparseAccumulator::Merge(const SparseGradRef& g) {
  const size_t row_bytes = static_cast<size_t>(row_elements_) * sizeof(T);
  if (g.nnz > 0 && (indices_.empty() || g.indices[0] > indices_.back())) {
    // Rows all after those held (a push split over frames, rowsMore: each frame's rows follow the
    // last's): appended, not merged, or a gradient of F frames would cost F passes over all it holds.
    const auto* bytes = static_cast<const uint8_t*>(g.values);
    indices_.insert(indices_.end(), g.indices, g.indices + g.nnz);
    counts_.insert(counts_.end(), static_cast<size_t>(g.nnz), 1);
    values_.insert(values_.end(), bytes, bytes + static_cast<size_t>(g.nnz) * row_bytes);
    return;
  }
  const T* in = static_cast<const T*>(g.values);
  const T* acc = reinterpret_cast<const T*>(values_.data());
  scratch_indices_.clear();
  scratch_counts_.clear();
  scratch_values_.resize((indices_.size() + static_cast<size_t>(g.nnz)) * row_bytes);
  T* out = reinterpret_cast<T*>(scratch_values_.data());
  size_t a = 0, b = 0, n = 0;
  while (a < indices_.size() || b < static_cast<size_t>(g.nnz)) {
    T* dst = out + n * row_elements_;
    if (b == static_cast<size_t>(g.nnz) || (a < indices_.size() && indices_[a] < g.indices[b])) {
      std::memcpy(dst, acc + a * row_elements_, row_bytes);
      scratch_indices_.push_back(indices_[a]);
      scratch_counts_.push_back(counts_[a]);
      ++a;
    } else if (a == indices_.size() || g.indices[b] < indices_[a]) {
      std::memcpy(dst, in + b * row_elements_, row_bytes);
      scratch_indices_.push_back(g.indices[b]);
      scratch_counts_.push_back(1);
      ++b;
    } else {  // equal: sum the rows, count + 1
      const T* x = acc + a * row_elements_;
      const T* y = in + b * row_elements_;
      for (int64_t k = 0; k < row_elements_; ++k) dst[k] = x[k] + y[k];
      scratch_indices_.push_back(indices_[a]);
      scratch_counts_.push_back(counts_[a] + 1);
      ++a;
      ++b;
    }
    ++n;
  }
  scratch_values_.resize(n * row_bytes);
  indices_.swap(scratch_indices_);
  values_.swap(scratch_values_);
  counts_.swap(scratch_counts_);
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
  if (!merged_) {
    indices_.clear();
    values_.clear();
    counts_.clear();
    merged_ = true;
  }
  if (dtype_ == DType::kFloat32) {
    Merge<float>(g);
  } else {
    Merge<double>(g);
  }
  if (counts) ++counter_;
  return true;
}

template <typename T>
void SparseAccumulator::Average() {
  T* v = reinterpret_cast<T*>(values_.data());
  for (size_t r = 0; r < indices_.size(); ++r) {
    if (counts_[r] <= 1) continue;
    const T c = static_cast<T>(counts_[r]);
    for (int64_t k = 0; k < row_elements_; ++k) v[r * row_elements_ + k] /= c;
  }
}

void SparseAccumulator::FinishTake(int* count) {
  ++step_;
  if (reduction_ == Reduction::kMean) {
    if (dtype_ == DType::kFloat32) {
      Average<float>();
    } else {
      Average<double>();
    }
  }
  *count = counter_;
  counter_ = 0;
  merged_ = false;
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
  if (counter_ == 0) {
    indices_.clear();
    values_.clear();
    counts_.clear();
  }
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
  counts_.clear();
}

}  // namespace psd::server
