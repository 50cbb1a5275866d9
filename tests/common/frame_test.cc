#include "wire/frame.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <thread>

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

TEST_CASE("a one-tensor reply's data segment lands straight in the destination, or is read as usual", "[frame]") {
  std::vector<uint64_t> storage(2048);  // 16 KiB of float32: referenced as its own segment
  float* values = reinterpret_cast<float*>(storage.data());
  for (int i = 0; i < 4096; ++i) values[i] = static_cast<float>(i) * 0.25f - 3.0f;
  wire::OutFrame out;
  auto resp = out.builder.initRoot<proto::Response>();
  resp.setId(7);
  auto pull = resp.initPull();
  pull.setStep(3);
  wire::SetTensor(out.builder, pull.initValues(1)[0], DType::kFloat32, {4096}, values, 16384);
  std::string bytes;
  for (auto& b : out.Buffers()) bytes.append(static_cast<const char*>(b.data()), b.size());
  auto read_from = [&](size_t* at) {
    return [&bytes, at](void* p, size_t n) {
      if (*at + n > bytes.size()) return Unavailable("short");
      std::memcpy(p, bytes.data() + *at, n);
      *at += n;
      return Status::Ok();
    };
  };
  std::vector<uint64_t> view(2048, 0);  // the caller's memory
  {
    size_t at = 0;
    wire::InFrame in;
    wire::Landing landing{view.data(), 16384};
    REQUIRE(wire::ReadFrameWith(read_from(&at), in, 1 << 20, "limit", &landing).ok());
    CHECK(at == bytes.size());
    CHECK(in.capacity_bytes() < 16384);  // the data did not go through the receive buffer
    auto reader = in.Reader();
    auto r = reader->getRoot<proto::Response>();
    CHECK(r.getPull().getStep() == 3);
    auto t = wire::ReadTensor(r.getPull().getValues()[0], 1 << 20);
    REQUIRE(t.ok());
    CHECK(t->data == static_cast<const void*>(view.data()));
    CHECK(std::memcmp(view.data(), values, 16384) == 0);
  }
  // A landing of another size (or a frame of another shape) is ignored: the frame is read whole.
  std::fill(view.begin(), view.end(), 0);
  size_t at = 0;
  wire::InFrame in;
  wire::Landing wrong{view.data(), 8192};
  REQUIRE(wire::ReadFrameWith(read_from(&at), in, 1 << 20, "limit", &wrong).ok());
  auto reader = in.Reader();
  auto t = wire::ReadTensor(reader->getRoot<proto::Response>().getPull().getValues()[0], 1 << 20);
  REQUIRE(t.ok());
  CHECK(t->data != static_cast<const void*>(view.data()));
  CHECK(std::memcmp(t->data, values, 16384) == 0);
  CHECK(view[0] == 0);
}

TEST_CASE("frames read through a read-ahead: back to back, landed, bigger than it, each whole", "[frame]") {
  // One reply of `floats` float32 values (step = id) as bytes on the wire.
  auto reply = [](uint64_t id, size_t floats, std::vector<float>* values) {
    values->resize(floats);
    for (size_t i = 0; i < floats; ++i) (*values)[i] = static_cast<float>(id * 1000 + i);
    wire::OutFrame out;
    auto resp = out.builder.initRoot<proto::Response>();
    resp.setId(id);
    auto pull = resp.initPull();
    pull.setStep(static_cast<int64_t>(id));
    wire::SetTensor(out.builder, pull.initValues(1)[0], DType::kFloat32, {static_cast<int64_t>(floats)}, values->data(),
                    floats * 4);
    std::string bytes;
    for (auto& b : out.Buffers()) bytes.append(static_cast<const char*>(b.data()), b.size());
    return bytes;
  };
  // Small, landed (16 KiB), bigger than half the read-ahead (256 KiB, read in place), small.
  const std::vector<size_t> sizes = {3, 4096, 65536, 5};
  std::vector<std::vector<float>> values(sizes.size());
  std::string wire_bytes;
  for (size_t i = 0; i < sizes.size(); ++i) wire_bytes += reply(i + 1, sizes[i], &values[i]);

  asio::io_context io;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  tcp::socket writer(io);
  writer.connect(acceptor.local_endpoint());
  tcp::socket reader = acceptor.accept();
  // All four in one write, from a thread (the reader drains what the socket buffers cannot hold).
  std::thread write_all([&] { asio::write(writer, asio::buffer(wire_bytes)); });

  wire::ReadAhead ahead;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::vector<uint64_t> landing_view(2048, 0);  // 16 KiB: the second reply's destination
  for (size_t i = 0; i < sizes.size(); ++i) {
    wire::InFrame in;
    wire::Landing landing{landing_view.data(), 16384};
    REQUIRE(wire::ReadFrame(reader, in, 1 << 20, deadline, "limit", i == 1 ? &landing : nullptr, 0, &ahead).ok());
    auto root = in.Reader();
    auto r = root->getRoot<proto::Response>();
    CHECK(r.getId() == i + 1);
    auto t = wire::ReadTensor(r.getPull().getValues()[0], 1 << 20);
    REQUIRE(t.ok());
    REQUIRE(t->bytes == sizes[i] * 4);
    CHECK(std::memcmp(t->data, values[i].data(), sizes[i] * 4) == 0);
    if (i == 1) CHECK(t->data == static_cast<const void*>(landing_view.data()));
  }
  write_all.join();
  CHECK(ahead.held() == 0);  // nothing past the last frame was read
}
