#include "wire/frame.h"

#include <catch2/catch.hpp>
#include <cstring>

using namespace psd;

TEST_CASE("frame headers are checked before allocation", "[frame]") {
  uint32_t count = 0;
  size_t rest = 0;
  uint32_t one[2] = {0, 10};
  REQUIRE(wire::ParseFirstWord(one, &count, &rest).ok());
  CHECK(count == 1);
  CHECK(rest == 0);
  uint32_t three[2] = {2, 10};
  REQUIRE(wire::ParseFirstWord(three, &count, &rest).ok());
  CHECK(count == 3);
  CHECK(rest == 8);  // two more sizes, table padded to a word
  uint32_t huge[2] = {100000, 1};
  CHECK(wire::ParseFirstWord(huge, &count, &rest).code() == Code::kResourceExhausted);

  std::vector<uint32_t> sizes;
  uint64_t total = 0;
  uint32_t big[1] = {0x10000000};  // 2 GiB of words
  CHECK(wire::ParseSegmentSizes(big, 1, 1 << 20, &sizes, &total).code() == Code::kResourceExhausted);
  uint32_t zero[1] = {0};
  CHECK(wire::ParseSegmentSizes(zero, 1, 1 << 20, &sizes, &total).code() == Code::kInvalidArgument);
  uint32_t ok[2] = {4, 6};
  REQUIRE(wire::ParseSegmentSizes(ok, 2, 1 << 20, &sizes, &total).ok());
  CHECK(total == 10);
}

TEST_CASE("an out frame reads back through an in frame, external data included", "[frame]") {
  std::vector<uint64_t> storage(2048, 0);  // 8 KiB: referenced in place, not copied
  float* values = reinterpret_cast<float*>(storage.data());
  for (int i = 0; i < 4096; ++i) values[i] = static_cast<float>(i) * 0.5f;

  wire::OutFrame out;
  auto req = out.builder.initRoot<proto::Request>();
  req.setId(42);
  auto g = req.initPush().initGrads(1)[0];
  g.setName("w");
  wire::SetTensor(out.builder, g.initGrad(), DType::kFloat32, {2, 2048}, values, 16384);
  std::string bytes;
  for (auto& b : out.Buffers()) bytes.append(static_cast<const char*>(b.data()), b.size());

  uint32_t first[2];
  std::memcpy(first, bytes.data(), 8);
  uint32_t count = 0;
  size_t rest = 0;
  REQUIRE(wire::ParseFirstWord(first, &count, &rest).ok());
  std::vector<uint32_t> table(1 + rest / 4);
  table[0] = first[1];
  std::memcpy(table.data() + 1, bytes.data() + 8, rest);
  std::vector<uint32_t> sizes;
  uint64_t total = 0;
  REQUIRE(wire::ParseSegmentSizes(table.data(), count, 1 << 20, &sizes, &total).ok());
  REQUIRE(8 + rest + total * 8 == bytes.size());
  wire::InFrame in;
  std::memcpy(in.Prepare(sizes, total), bytes.data() + 8 + rest, total * 8);
  auto reader = in.Reader();
  auto r = reader->getRoot<proto::Request>();
  CHECK(r.getId() == 42);
  auto t = wire::ReadTensor(r.getPush().getGrads()[0].getGrad(), 1 << 20);
  REQUIRE(t.ok());
  CHECK(t->shape == Shape{2, 2048});
  REQUIRE(t->bytes == 16384);
  CHECK(std::memcmp(t->data, values, 16384) == 0);
  CHECK(out.builder.getSegmentsForOutput().size() >= 2);  // the tensor travelled as its own segment
}

TEST_CASE("wire tensors with unknown dtypes or bad shapes are rejected", "[frame]") {
  capnp::MallocMessageBuilder msg;
  auto t = msg.initRoot<proto::Tensor>();
  t.setDtype(static_cast<proto::DType>(7));
  CHECK(wire::ReadTensor(t.asReader(), 1 << 20).status().code() == Code::kInvalidArgument);
  t.setDtype(proto::DType::FLOAT32);
  auto shape = t.initShape(1);
  shape.set(0, -3);
  CHECK(wire::ReadTensor(t.asReader(), 1 << 20).status().code() == Code::kInvalidArgument);
}
