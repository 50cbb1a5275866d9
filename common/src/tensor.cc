#include "psd/tensor.h"

namespace psd {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
  }
  return "unknown";
}

Result<DType> ParseDType(const std::string& name) {
  if (name == "float32" || name == "float") return DType::kFloat32;
  if (name == "float64" || name == "double") return DType::kFloat64;
  if (name == "bfloat16" || name == "bf16") return DType::kBFloat16;
  if (name == "float16" || name == "half" || name == "fp16") return DType::kFloat16;
  return InvalidArgument("unsupported dtype '" + name + "' (supported: float32, float64, bfloat16, float16)");
}

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Status ValidateShape(const Shape& shape, DType dtype, uint64_t max_bytes) {
  if (shape.size() > 32) return InvalidArgument("shape rank " + std::to_string(shape.size()) + " exceeds 32");
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return InvalidArgument("shape " + ShapeString(shape) + " has a negative dimension");
    if (d != 0 && n > max_bytes / static_cast<uint64_t>(d)) {
      return InvalidArgument("shape " + ShapeString(shape) + " is too large");
    }
    n *= static_cast<uint64_t>(d);
  }
  if (n > max_bytes / DTypeSize(dtype)) {
    return InvalidArgument("shape " + ShapeString(shape) + " of " + DTypeName(dtype) + " exceeds " +
                           std::to_string(max_bytes) + " bytes");
  }
  return Status::Ok();
}

}  // namespace psd
