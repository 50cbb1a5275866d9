// Element types, shapes and non-owning tensor views shared by psd and libpsclient.
// Views never own memory: the caller keeps the bytes alive for the duration of the call.
#ifndef PSD_TENSOR_H_
#define PSD_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "psd/status.h"

namespace psd {

// Mirrors the wire enum `DType` in schema/psd.capnp.
enum class DType { kFloat32 = 0, kFloat64 = 1 };

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);  // "float32", "float64"
Result<DType> ParseDType(const std::string& name);

using Shape = std::vector<int64_t>;

// Number of elements; 1 for a scalar (rank 0).
int64_t NumElements(const Shape& shape);
// TF-style text: "[3,2]", "[]" for a scalar.
std::string ShapeString(const Shape& shape);
// Rejects negative dimensions and element counts whose byte size would exceed max_bytes.
Status ValidateShape(const Shape& shape, DType dtype, uint64_t max_bytes);

// Where a view's bytes live. Device memory is accepted by the API so that GPU trainers can
// hand device pointers; a build without PSD_WITH_CUDA answers kUnimplemented for kCuda.
enum class MemoryKind { kHost = 0, kCuda = 1 };

// A read-only view of a tensor held by the caller.
struct ConstTensorView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  Shape shape;
  MemoryKind memory = MemoryKind::kHost;

  size_t bytes() const { return static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype); }
};

// A writable view of caller memory (results of pulls are written straight into it).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Shape shape;
  MemoryKind memory = MemoryKind::kHost;

  size_t bytes() const { return static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype); }
  operator ConstTensorView() const { return {data, dtype, shape, memory}; }  // NOLINT
};

}  // namespace psd

#endif  // PSD_TENSOR_H_
