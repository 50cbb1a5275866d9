// Element types, shapes and non-owning tensor views shared by psd and libpsclient.
// Views never own memory: the caller keeps the bytes alive for the duration of the call.
#ifndef PSD_TENSOR_H_
#define PSD_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "psd/export.h"
#include "psd/status.h"

namespace psd {

// Mirrors the wire enum `DType` in schema/psd.capnp. bfloat16 and float16 are IEEE-style halves
// (bfloat16: float32's exponent, 7 mantissa bits; float16: IEEE 754 binary16), stored as their
// 16-bit patterns; psd/half.h converts them (round to nearest even).
enum class DType { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3 };

PSD_EXPORT size_t DTypeSize(DType dtype);
PSD_EXPORT const char* DTypeName(DType dtype);  // "float32", "float64", "bfloat16", "float16"
// Also accepts "float", "double", "bf16", "half", "fp16".
PSD_EXPORT Result<DType> ParseDType(const std::string& name);
// bfloat16 or float16.
inline bool IsHalf(DType dtype) { return dtype == DType::kBFloat16 || dtype == DType::kFloat16; }

using Shape = std::vector<int64_t>;

// Number of elements; 1 for a scalar (rank 0).
PSD_EXPORT int64_t NumElements(const Shape& shape);
// TF-style text: "[3,2]", "[]" for a scalar.
PSD_EXPORT std::string ShapeString(const Shape& shape);
// Rejects negative dimensions and element counts whose byte size would exceed max_bytes.
PSD_EXPORT Status ValidateShape(const Shape& shape, DType dtype, uint64_t max_bytes);

// Where a view's bytes live. Device memory is accepted by the API so that GPU trainers can
// hand device pointers; a build without PSD_WITH_CUDA answers kUnimplemented for kCuda.
enum class MemoryKind { kHost = 0, kCuda = 1 };

// A read-only view of a tensor held by the caller.
struct ConstTensorView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  Shape shape;
  MemoryKind memory = MemoryKind::kHost;
  // kCuda: the CUDA stream (a cudaStream_t) the copies are ordered on; the call waits for the work
  // already queued on it, and no other stream. nullptr: the default stream.
  void* stream = nullptr;

  size_t bytes() const { return static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype); }
};

// A writable view of caller memory (results of pulls are written straight into it).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Shape shape;
  MemoryKind memory = MemoryKind::kHost;
  void* stream = nullptr;  // kCuda: as in ConstTensorView

  size_t bytes() const { return static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype); }
  operator ConstTensorView() const { return {data, dtype, shape, memory, stream}; }  // NOLINT
};

}  // namespace psd

#endif  // PSD_TENSOR_H_
