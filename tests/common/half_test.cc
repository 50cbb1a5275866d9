// bfloat16 / float16 conversions against references computed here a different way: every finite
// half value is enumerated (from its sign, exponent and mantissa with ldexp), and the nearest one
// (ties to the even mantissa) is found by bisection in double precision.
#include "psd/half.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace psd;

namespace {

struct HalfFormat {
  int mantissa_bits;
  int exponent_bias;
  int max_exponent_field;  // the all-ones field (inf/NaN)
};
constexpr HalfFormat kFp16{10, 15, 31};
constexpr HalfFormat kBf16{7, 127, 255};

// The value of a finite, non-negative half pattern, computed from its fields.
double ValueOf(const HalfFormat& f, uint32_t bits) {
  uint32_t mant = bits & ((1u << f.mantissa_bits) - 1);
  uint32_t exp = bits >> f.mantissa_bits;
  if (exp == 0) return std::ldexp(static_cast<double>(mant), 1 - f.exponent_bias - f.mantissa_bits);
  return std::ldexp(static_cast<double>(mant | (1u << f.mantissa_bits)),
                    static_cast<int>(exp) - f.exponent_bias - f.mantissa_bits);
}

// Round-to-nearest-even of x (finite) to the format, as a bit pattern, by search.
uint16_t Reference(const HalfFormat& f, double x) {
  uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  double a = std::fabs(x);
  uint32_t max_finite = (static_cast<uint32_t>(f.max_exponent_field) << f.mantissa_bits) - 1;
  uint32_t inf = max_finite + 1;
  // Beyond the largest finite value by half an ulp or more: infinity (IEEE's overflow rule).
  double top = ValueOf(f, max_finite);
  double half_ulp = (top - ValueOf(f, max_finite - 1)) / 2;
  if (a >= top + half_ulp) return static_cast<uint16_t>(sign | inf);
  uint32_t lo = 0, hi = max_finite;  // largest pattern with value <= a
  while (lo < hi) {
    uint32_t mid = (lo + hi + 1) / 2;
    if (ValueOf(f, mid) <= a)
      lo = mid;
    else
      hi = mid - 1;
  }
  uint32_t pick = lo;
  if (lo < max_finite) {
    double below = a - ValueOf(f, lo), above = ValueOf(f, lo + 1) - a;
    if (above < below || (above == below && (lo & 1))) pick = lo + 1;
  }
  return static_cast<uint16_t>(sign | pick);
}

float FloatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

TEST_CASE("half dtypes have names, sizes and parse", "[half]") {
  CHECK(DTypeSize(DType::kBFloat16) == 2);
  CHECK(DTypeSize(DType::kFloat16) == 2);
  CHECK(std::string(DTypeName(DType::kBFloat16)) == "bfloat16");
  CHECK(*ParseDType("bf16") == DType::kBFloat16);
  CHECK(*ParseDType("half") == DType::kFloat16);
  CHECK(ComputeDType(DType::kBFloat16) == DType::kFloat32);
  CHECK(ComputeDType(DType::kFloat64) == DType::kFloat64);
  CHECK(ConvertibleDTypes(DType::kBFloat16, DType::kFloat32));
  CHECK(ConvertibleDTypes(DType::kFloat32, DType::kFloat16));
  CHECK(!ConvertibleDTypes(DType::kBFloat16, DType::kFloat64));
  CHECK(!ConvertibleDTypes(DType::kFloat64, DType::kFloat32));
}

TEST_CASE("every half value converts to float exactly and back to itself", "[half]") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    uint16_t bits = static_cast<uint16_t>(h);
    bool fp16_nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
    bool bf16_nan = (h & 0x7f80) == 0x7f80 && (h & 0x7f);
    float f16 = Float16ToFloat(bits), b16 = BFloat16ToFloat(bits);
    if (fp16_nan) {
      CHECK(std::isnan(f16));
      CHECK(std::isnan(Float16ToFloat(FloatToFloat16(f16))));
    } else {
      if ((h & 0x7fff) < 0x7c00) {
        double want = ValueOf(kFp16, h & 0x7fff) * ((h & 0x8000) ? -1 : 1);
        if (static_cast<double>(f16) != want) FAIL("float16 " << h << " reads as " << f16 << ", want " << want);
      }
      if (FloatToFloat16(f16) != bits) FAIL("float16 " << h << " does not round-trip");
    }
    if (bf16_nan) {
      CHECK(std::isnan(b16));
      CHECK(std::isnan(BFloat16ToFloat(FloatToBFloat16(b16))));
    } else if (FloatToBFloat16(b16) != bits) {
      FAIL("bfloat16 " << h << " does not round-trip");
    }
  }
}

TEST_CASE("float32 rounds to the nearest half, ties to even", "[half]") {
  std::mt19937 rng(7);
  std::vector<float> xs = {0.0f,
                           -0.0f,
                           1.0f,
                           65504.0f,
                           65519.99f,
                           65520.0f,
                           1e-8f,
                           2.9802322e-08f /*2^-25*/,
                           5.9604645e-08f /*2^-24*/,
                           6.1035156e-05f /*2^-14*/,
                           3.0e38f,
                           -3.4028235e38f};
  // Exact ties: 1 + 2^-11 is halfway between two float16s (1 and 1 + 2^-10): even is 1.
  xs.push_back(1.0f + std::ldexp(1.0f, -11));
  xs.push_back(1.0f + 3 * std::ldexp(1.0f, -11));  // halfway between 1+2^-10 and 1+2^-9: even is up
  xs.push_back(1.0f + std::ldexp(1.0f, -8));       // bfloat16 tie
  xs.push_back(1.0f + 3 * std::ldexp(1.0f, -8));
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    float f = FloatOf(any_bits(rng));
    if (std::isfinite(f)) xs.push_back(f);
    // Values in the halves' normal and subnormal ranges, where rounding matters most.
    xs.push_back(std::ldexp(std::uniform_real_distribution<float>(-1, 1)(rng), static_cast<int>(rng() % 40) - 26));
  }
  for (float x : xs) {
    uint16_t want16 = Reference(kFp16, x), wantb = Reference(kBf16, x);
    if (FloatToFloat16(x) != want16) FAIL("float16 of " << x << ": " << FloatToFloat16(x) << " want " << want16);
    if (FloatToBFloat16(x) != wantb) FAIL("bfloat16 of " << x << ": " << FloatToBFloat16(x) << " want " << wantb);
  }
  CHECK(FloatToFloat16(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(FloatToBFloat16(-std::numeric_limits<float>::infinity()) == 0xff80);
  CHECK(std::isnan(Float16ToFloat(FloatToFloat16(std::nanf("")))));
  CHECK(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
}

TEST_CASE("float64 rounds to a half once, not twice", "[half]") {
  // 1 + 2^-11 + 2^-40 rounds to float32 as the float16 tie 1 + 2^-11 (which would then round to
  // 1); rounded once it is above the tie and must go up to 1 + 2^-10.
  double d = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
  uint16_t h = 0;
  ConvertElements(&d, DType::kFloat64, &h, DType::kFloat16, 1);
  CHECK(Float16ToFloat(h) == 1.0f + std::ldexp(1.0f, -10));
  double e = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);
  ConvertElements(&e, DType::kFloat64, &h, DType::kBFloat16, 1);
  CHECK(BFloat16ToFloat(h) == 1.0f + std::ldexp(1.0f, -7));
  std::mt19937_64 rng(11);
  for (int i = 0; i < 100000; ++i) {
    double x = std::ldexp(std::uniform_real_distribution<double>(-1, 1)(rng), static_cast<int>(rng() % 40) - 26);
    ConvertElements(&x, DType::kFloat64, &h, DType::kFloat16, 1);
    if (h != Reference(kFp16, x)) FAIL("float16 of double " << x);
    ConvertElements(&x, DType::kFloat64, &h, DType::kBFloat16, 1);
    if (h != Reference(kBf16, x)) FAIL("bfloat16 of double " << x);
  }
}

TEST_CASE("ConvertElements converts every pair of dtypes", "[half]") {
  std::vector<float> f = {1.5f, -2.25f, 1e-3f, 3.0f};
  std::vector<uint16_t> b(4), h(4);
  std::vector<double> d(4);
  ConvertElements(f.data(), DType::kFloat32, b.data(), DType::kBFloat16, 4);
  ConvertElements(b.data(), DType::kBFloat16, h.data(), DType::kFloat16, 4);
  ConvertElements(h.data(), DType::kFloat16, d.data(), DType::kFloat64, 4);
  for (int i = 0; i < 4; ++i) {
    float via_b = BFloat16ToFloat(FloatToBFloat16(f[i]));
    CHECK(d[i] == static_cast<double>(Float16ToFloat(FloatToFloat16(via_b))));
  }
  std::vector<float> back(4);
  ConvertElements(d.data(), DType::kFloat64, back.data(), DType::kFloat32, 4);
  ConvertElements(back.data(), DType::kFloat32, back.data(), DType::kFloat32, 4);  // same buffer: no-op
  CHECK(back[0] == 1.5f);
}
