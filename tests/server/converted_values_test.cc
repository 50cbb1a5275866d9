// ConvertedValues: one conversion per published value and dtype, shared by every reader.
#include "core/converted_values.h"

#include <catch2/catch.hpp>

#include "psd/half.h"

using namespace psd;
using psd::server::Buffer;
using psd::server::ConvertedValues;

namespace {

std::shared_ptr<const Buffer> Floats(std::initializer_list<float> v) {
  auto b = std::make_shared<Buffer>(v.size() * sizeof(float));
  std::copy(v.begin(), v.end(), b->as<float>());
  return b;
}

}  // namespace

TEST_CASE("a published value is converted once per dtype and shared", "[converted]") {
  ConvertedValues cache;
  auto v1 = Floats({1.5f, -2.0f, 1.0f + 1.0f / 512});
  auto a = cache.Get("w", v1, DType::kFloat32, DType::kBFloat16);
  auto b = cache.Get("w", v1, DType::kFloat32, DType::kBFloat16);
  CHECK(a == b);  // the same buffer: converted once
  REQUIRE(a->bytes() == 3 * 2);
  const uint16_t* h = static_cast<const uint16_t*>(a->data());
  CHECK(h[0] == FloatToBFloat16(1.5f));
  CHECK(h[2] == FloatToBFloat16(1.0f + 1.0f / 512));
  // Another dtype, another variable: their own conversions.
  auto f16 = cache.Get("w", v1, DType::kFloat32, DType::kFloat16);
  CHECK(f16 != a);
  CHECK(static_cast<const uint16_t*>(f16->data())[1] == FloatToFloat16(-2.0f));
  CHECK(cache.Get("v", v1, DType::kFloat32, DType::kBFloat16) != a);
  // The variable's next value replaces the conversion (readers of the old one keep theirs).
  auto v2 = Floats({3.0f, 4.0f, 5.0f});
  auto c = cache.Get("w", v2, DType::kFloat32, DType::kBFloat16);
  CHECK(c != a);
  CHECK(static_cast<const uint16_t*>(c->data())[0] == FloatToBFloat16(3.0f));
  CHECK(h[0] == FloatToBFloat16(1.5f));
}

TEST_CASE("a new value at a freed value's address is converted again", "[converted]") {
  ConvertedValues cache;
  std::shared_ptr<const Buffer> first;
  {
    auto v = Floats({1.0f, 2.0f});
    first = cache.Get("w", v, DType::kFloat32, DType::kFloat16);
  }
  // Whatever the allocator hands out now (possibly the same address), the old source is gone.
  auto v = Floats({7.0f, 8.0f});
  auto again = cache.Get("w", v, DType::kFloat32, DType::kFloat16);
  CHECK(static_cast<const uint16_t*>(again->data())[0] == FloatToFloat16(7.0f));
}
