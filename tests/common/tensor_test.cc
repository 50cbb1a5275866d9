#include "psd/tensor.h"

#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include "psd/secret.h"

using namespace psd;

TEST_CASE("shapes print TF-style and count elements", "[tensor]") {
  CHECK(ShapeString({3, 2}) == "[3,2]");
  CHECK(ShapeString({}) == "[]");
  CHECK(NumElements({}) == 1);
  CHECK(NumElements({3, 0, 2}) == 0);
  CHECK(NumElements({4, 5}) == 20);
}

TEST_CASE("shape validation rejects negative and oversized shapes", "[tensor]") {
  CHECK(ValidateShape({3, 2}, DType::kFloat32, 1 << 20).ok());
  CHECK(ValidateShape({-1}, DType::kFloat32, 1 << 20).code() == Code::kInvalidArgument);
  CHECK(ValidateShape({1 << 20, 1 << 20}, DType::kFloat32, 1 << 30).code() == Code::kInvalidArgument);
  // Overflowing products must not wrap around into a small size.
  CHECK(!ValidateShape({int64_t{1} << 40, int64_t{1} << 40, 16}, DType::kFloat64, uint64_t{1} << 40).ok());
  CHECK(ValidateShape({256, 1024}, DType::kFloat64, 2u << 20).ok());
  CHECK(!ValidateShape({256, 1025}, DType::kFloat64, 2u << 20).ok());
}

TEST_CASE("dtype names parse and print", "[tensor]") {
  CHECK(std::string(DTypeName(DType::kFloat64)) == "float64");
  CHECK(*ParseDType("float32") == DType::kFloat32);
  CHECK(ParseDType("int8").status().code() == Code::kInvalidArgument);
  CHECK(DTypeSize(DType::kFloat64) == 8);
}

TEST_CASE("status carries code and message", "[status]") {
  Status s = DeadlineExceeded("no token");
  CHECK(!s.ok());
  CHECK(s.ToString() == "DEADLINE_EXCEEDED: no token");
  Result<int> r(InvalidArgument("bad"));
  CHECK(!r.ok());
  Result<int> v(5);
  CHECK(*v == 5);
}

TEST_CASE("secret files are read without trailing whitespace, empty or missing ones are errors", "[secret]") {
  char path[] = "/tmp/psd-secret-XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  REQUIRE(write(fd, "tok en\n\n", 8) == 8);
  close(fd);
  auto s = ReadSecretFile(path);
  REQUIRE(s.ok());
  CHECK(*s == "tok en");
  fd = open(path, O_WRONLY | O_TRUNC);
  REQUIRE(write(fd, " \n", 2) == 2);
  close(fd);
  CHECK(ReadSecretFile(path).status().code() == Code::kInvalidArgument);
  unlink(path);
  CHECK(ReadSecretFile(path).status().code() == Code::kInvalidArgument);
}
