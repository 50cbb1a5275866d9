#include "core/accumulator.h"

#include <cstring>

#include "psd/half.h"

namespace psd::server {
namespace {

template <typename T>
void AddTyped(T* __restrict dst, const T* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace

void AddInto(DType dtype, void* dst, const void* src, int64_t n) {
  if (dtype == DType::kFloat32) {
    AddTyped(static_cast<float*>(dst), static_cast<const float*>(src), n);
  } else {
    AddTyped(static_cast<double*>(dst), static_cast<const double*>(src), n);
  }
}

DenseAccumulator::DenseAccumulator(DType dtype, Shape shape, Reduction reduction, int64_t initial_step)
    : dtype_(dtype),
      shape_(std::move(shape)),
      reduction_(reduction),
      num_elements_(NumElements(shape_)),
      step_(initial_step),
      sum_(static_cast<size_t>(num_elements_) * DTypeSize(dtype)) {}

Status CheckGradientDType(DType want, DType got) {
  if (got == want) return Status::Ok();
  // A float32 accumulator (a float32 or half variable's) takes half gradients, converted as added.
  if (want == DType::kFloat32 && IsHalf(got)) return Status::Ok();
  return InvalidArgument(std::string("dtype mismatch: accumulator is ") + DTypeName(want) + ", gradient is " +
                         DTypeName(got));
}

Status DenseAccumulator::Check(DType want_dtype, const Shape& want_shape, DType dtype, const Shape& shape,
                               size_t bytes) {
  PSD_RETURN_IF_ERROR(CheckGradientDType(want_dtype, dtype));
  if (shape != want_shape) {
    return InvalidArgument("Shape mismatch: expected " + ShapeString(want_shape) + ", got " + ShapeString(shape));
  }
  size_t need = static_cast<size_t>(NumElements(want_shape)) * DTypeSize(dtype);
  if (bytes != need) {
    return InvalidArgument("gradient data has " + std::to_string(bytes) + " bytes, shape " + ShapeString(shape) +
                           " of " + DTypeName(dtype) + " needs " + std::to_string(need));
  }
  return Status::Ok();
}

Result<bool> DenseAccumulator::ApplyGrad(int64_t local_step, DType dtype, const Shape& shape, const void* data,
                                         size_t bytes) {
  PSD_RETURN_IF_ERROR(Validate(dtype, shape, bytes));
  return AddChecked(local_step, dtype, data);
}

bool DenseAccumulator::AddChecked(int64_t local_step, DType dtype, const void* data) {
  if (local_step < step_) return false;
  const size_t bytes = static_cast<size_t>(num_elements_) * DTypeSize(dtype_);
  if (dtype != dtype_) {  // a half gradient into float32: converted while it is added
    if (counter_ == 0) {
      ConvertElements(data, dtype, sum_.data(), dtype_, static_cast<size_t>(num_elements_));
    } else {
      AddConvertedInto(sum_.as<float>(), data, dtype, static_cast<size_t>(num_elements_));
    }
  } else if (counter_ == 0) {
    if (bytes) std::memcpy(sum_.data(), data, bytes);
  } else {
    AddInto(dtype_, sum_.data(), data, num_elements_);
  }
  ++counter_;
  return true;
}

Result<bool> DenseAccumulator::TryTakeGrad(int num_required, int* count) {
  if (num_required <= 0) {
    return InvalidArgument("Argument num_required must be positive, but was " + std::to_string(num_required));
  }
  if (counter_ < num_required) return false;
  ForceTake(count);
  return true;
}

void DenseAccumulator::ForceTake(int* count) {
  ++step_;
  divisor_ = reduction_ == Reduction::kMean && counter_ > 1 ? counter_ : 1;
  *count = counter_;
  counter_ = 0;
}

bool DenseAccumulator::SetGlobalStep(int64_t new_step) {
  bool lowered = new_step < step_;
  step_ = new_step;
  return lowered;
}

}  // namespace psd::server
