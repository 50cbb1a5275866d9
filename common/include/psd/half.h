// bfloat16 and float16 <-> float32, rounding to nearest even (IEEE 754's default, and what
// PyTorch, numpy and CUDA's __float2half_rn / __float2bfloat16_rn do). NaN stays NaN (quiet),
// infinities stay infinite, values beyond the half type's range round to infinity, float16
// subnormals are produced and read exactly. Halves are passed as their 16-bit patterns.
#ifndef PSD_HALF_H_
#define PSD_HALF_H_

#include <cstddef>
#include <cstdint>

#include "psd/export.h"
#include "psd/tensor.h"

namespace psd {

PSD_EXPORT uint16_t FloatToBFloat16(float f);
PSD_EXPORT float BFloat16ToFloat(uint16_t h);
PSD_EXPORT uint16_t FloatToFloat16(float f);
PSD_EXPORT float Float16ToFloat(uint16_t h);

// n elements from `src` (of dtype `from`) into `dst` (of dtype `to`), for any pair of psd's dtypes
// (float64 -> float32 and -> halves round once, to nearest even). src and dst must not overlap
// unless they are the same pointer and the dtypes have the same size.
// The dtype psd keeps and computes a variable of `dtype` in: float32 for the halves (master
// weights: optimizers, accumulators and slots work in float32; reads round to the half), else itself.
inline DType ComputeDType(DType dtype) { return IsHalf(dtype) ? DType::kFloat32 : dtype; }

// Whether values of `from` may stand for a variable of `dtype` (converted on arrival): the same
// dtype, or float32 and the halves in any mix. float64 mixes with nothing.
inline bool ConvertibleDTypes(DType from, DType dtype) {
  return from == dtype || (from != DType::kFloat64 && dtype != DType::kFloat64);
}

PSD_EXPORT void ConvertElements(const void* src, DType from, void* dst, DType to, size_t n);

}  // namespace psd

#endif  // PSD_HALF_H_
