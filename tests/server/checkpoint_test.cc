#include "checkpoint/checkpoint.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

using namespace psd;
using namespace psd::server;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/psd-ckpt-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string path;
};

std::shared_ptr<const Buffer> Floats(std::vector<float> v) {
  auto b = std::make_shared<Buffer>(v.size() * 4);
  std::memcpy(b->data(), v.data(), v.size() * 4);
  return b;
}

ShardSnapshot Snapshot(int64_t step, float base) {
  ShardSnapshot s;
  s.step = step;
  s.learning_rate = 0.25;
  s.optimizer = "adam";
  VariableSnapshot w;
  w.name = "w";
  w.shape = {2};
  w.average = true;
  w.value = Floats({base, base + 1});
  w.slots = {{"m", Floats({0.5f, 0.25f})}, {"v", Floats({1, 2})}};
  w.shadow = Floats({base / 2, base / 2});
  s.variables.push_back(w);
  VariableSnapshot d;
  d.name = "d";
  d.dtype = DType::kFloat64;
  d.shape = {};
  d.trainable = false;
  auto b = std::make_shared<Buffer>(8);
  *b->as<double>() = 3.5;
  d.value = b;
  s.variables.push_back(d);
  return s;
}

float At(const std::shared_ptr<const Buffer>& b, int i) { return b->as<float>()[i]; }

void FlipByte(const std::string& file, long offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c;
  f.read(&c, 1);
  c ^= 0x5a;
  f.seekp(offset);
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("a checkpoint round-trips values, slots, averages and the step", "[checkpoint]") {
  TempDir dir;
  auto info = WriteCheckpoint(dir.path, Snapshot(40, 7), 0, 1, 3);
  REQUIRE(info.ok());
  CHECK(VerifyCheckpoint(info->path).ok());
  ShardSnapshot back;
  auto loaded = LoadLatestCheckpoint(dir.path, 0, &back);
  REQUIRE(loaded.ok());
  CHECK(loaded->step == 40);
  CHECK(back.step == 40);
  CHECK(back.learning_rate == 0.25);
  CHECK(back.optimizer == "adam");
  REQUIRE(back.variables.size() == 2);
  const VariableSnapshot& w = back.variables[0];
  CHECK(w.name == "w");
  CHECK(w.shape == Shape{2});
  CHECK(At(w.value, 1) == 8);
  REQUIRE(w.slots.size() == 2);
  CHECK(w.slots[1].first == "v");
  CHECK(At(w.slots[0].second, 0) == 0.5f);
  REQUIRE(w.shadow);
  CHECK(At(w.shadow, 0) == 3.5f);
  CHECK_FALSE(back.variables[1].trainable);
  CHECK(*back.variables[1].value->as<double>() == 3.5);
}

TEST_CASE("the newest checkpoint that verifies is used; corrupt or torn ones are skipped", "[checkpoint]") {
  TempDir dir;
  REQUIRE(WriteCheckpoint(dir.path, Snapshot(10, 1), 0, 1, 0).ok());
  auto newest = WriteCheckpoint(dir.path, Snapshot(20, 2), 0, 1, 0);
  REQUIRE(newest.ok());
  std::string part = newest->path + "/shard-0-of-1.psdckpt";

  SECTION("a flipped byte in a part") {
    FlipByte(part, 30);
    CHECK_THAT(VerifyCheckpoint(newest->path).message(), Catch::Contains("checksum"));
  }
  SECTION("a truncated part") { fs::resize_file(part, fs::file_size(part) - 5); }
  SECTION("a manifest that was never written (crash before the rename)") { fs::remove(newest->path + "/MANIFEST"); }
  SECTION("an edited manifest") { FlipByte(newest->path + "/MANIFEST", 20); }
  ShardSnapshot back;
  auto loaded = LoadLatestCheckpoint(dir.path, 0, &back);
  REQUIRE(loaded.ok());
  CHECK(loaded->step == 10);
  CHECK(At(back.variables[0].value, 0) == 1);
}

TEST_CASE("retention keeps the newest checkpoints; an empty directory has none", "[checkpoint]") {
  TempDir dir;
  ShardSnapshot none;
  CHECK(LoadLatestCheckpoint(dir.path, 0, &none).status().code() == Code::kNotFound);
  for (int step = 1; step <= 5; ++step) REQUIRE(WriteCheckpoint(dir.path, Snapshot(step, step), 0, 1, 2).ok());
  int count = 0;
  for (auto& e : fs::directory_iterator(dir.path)) count += e.path().filename().string().rfind("ckpt-", 0) == 0;
  CHECK(count == 2);
  ShardSnapshot back;
  CHECK(LoadLatestCheckpoint(dir.path, 0, &back)->step == 5);
}
