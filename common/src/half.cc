#include "psd/half.h"

#include <cmath>
#include <cstring>

namespace psd {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// double -> float rounding to odd: the float a second rounding (to a half) rounds exactly as a
// single rounding of the double would.
float RoundToOddFloat(double d) {
  float f = static_cast<float>(d);
  if (std::isnan(d) || std::isinf(f) || static_cast<double>(f) == d) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  return FromBits(Bits(f) | 1u);
}

template <typename To, typename From>
void Cast(const void* src, void* dst, size_t n) {
  const From* s = static_cast<const From*>(src);
  To* d = static_cast<To*>(dst);
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<To>(s[i]);
}

float ToFloat(DType from, const void* src, size_t i) {
  switch (from) {
    case DType::kFloat32:
      return static_cast<const float*>(src)[i];
    case DType::kFloat64:
      return static_cast<float>(static_cast<const double*>(src)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(src)[i]);
    case DType::kFloat16:
      return Float16ToFloat(static_cast<const uint16_t*>(src)[i]);
  }
  return 0;
}

}  // namespace

uint16_t FloatToBFloat16(float f) {
  uint32_t u = Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);                                        // ties to even
  return static_cast<uint16_t>((u + rounding) >> 16);
}

float BFloat16ToFloat(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

uint16_t FloatToFloat16(float f) {
  uint32_t u = Bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x1ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: rounds to infinity
  if (a < 0x38800000u) {
    // Below float16's smallest normal (2^-14): a subnormal, in units of 2^-24, rounded to even.
    if (a < 0x33000000u) return sign;  // < 2^-25: rounds to zero (2^-25 exactly is a tie to 0)
    uint32_t exp = a >> 23;
    uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // value = mant * 2^(exp-150); units of 2^-24: mant >> (126-exp)
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 23-bit mantissa to 10 bits, ties to even.
  uint32_t r = a - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

float Float16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return FromBits(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp == 0) {
    float v = std::ldexp(static_cast<float>(mant), -24);  // zero or a subnormal, exact
    return sign ? -v : v;
  }
  return FromBits(sign | ((exp + 112) << 23) | (mant << 13));
}

void ConvertElements(const void* src, DType from, void* dst, DType to, size_t n) {
  if (from == to) {
    if (src != dst && n) std::memmove(dst, src, n * DTypeSize(from));
    return;
  }
  switch (to) {
    case DType::kFloat64: {
      double* d = static_cast<double*>(dst);
      if (from == DType::kFloat32) return Cast<double, float>(src, dst, n);
      for (size_t i = 0; i < n; ++i) d[i] = static_cast<double>(ToFloat(from, src, i));  // halves: exact
      return;
    }
    case DType::kFloat32:
      if (from == DType::kFloat64) return Cast<float, double>(src, dst, n);
      for (size_t i = 0; i < n; ++i) static_cast<float*>(dst)[i] = ToFloat(from, src, i);
      return;
    case DType::kBFloat16:
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      auto round = to == DType::kBFloat16 ? FloatToBFloat16 : FloatToFloat16;
      for (size_t i = 0; i < n; ++i) {
        float f = from == DType::kFloat64 ? RoundToOddFloat(static_cast<const double*>(src)[i]) : ToFloat(from, src, i);
        d[i] = round(f);
      }
      return;
    }
  }
}

}  // namespace psd
