#include "checkpoint/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "checkpoint/serialized_copy.h"
#include "checkpoint/snapshot_delta.h"

// The plain and the dispatched entry points side by side (checkpoint/xxh3.h maps one onto the other).
#define XXH_DISPATCH_DISABLE_REPLACE 1
#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>
#endif
#include <random>

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

TEST_CASE("a shard's state serialized for its replica round-trips, a changed byte or a cut copy is refused",
          "[checkpoint][replicas]") {
  const ShardSnapshot snap = Snapshot(41, 3);
  const std::string bytes = SerializeSnapshot(snap);
  // In pieces (what replication sends): the tensors are the snapshot's own buffers, and the
  // checksum hashed over the pieces is the one a whole copy verifies against.
  const SerializedSnapshot pieces = SerializeSnapshotInPieces(snap);
  std::string joined = pieces.head;
  for (const Buffer* b : pieces.payload) joined.append(static_cast<const char*>(b->data()), b->bytes());
  joined += pieces.trailer;
  CHECK(pieces.bytes == joined.size());
  CHECK(joined == bytes);
  REQUIRE_FALSE(pieces.payload.empty());
  CHECK(pieces.payload.front() == snap.variables[0].value.get());
  int64_t step = -1;
  REQUIRE(VerifySerializedSnapshot(bytes, &step).ok());
  CHECK(step == 41);
  ShardSnapshot back;
  REQUIRE(ParseSnapshot(bytes, &back).ok());
  CHECK(back.step == 41);
  CHECK(back.optimizer == "adam");
  REQUIRE(back.variables.size() == 2);
  CHECK(At(back.variables[0].value, 1) == 4);
  REQUIRE(back.variables[0].slots.size() == 2);
  CHECK(At(back.variables[0].slots[1].second, 1) == 2);
  REQUIRE(back.variables[0].shadow);
  CHECK(*back.variables[1].value->as<double>() == 3.5);
  // Any byte changed (the records, a tensor, the checksum itself) fails the checksum; nothing is parsed.
  for (size_t at : {size_t{3}, size_t{20}, bytes.size() / 2, bytes.size() - 1}) {
    std::string bad = bytes;
    bad[at] = static_cast<char>(bad[at] ^ 0x5a);
    ShardSnapshot none;
    CHECK(ParseSnapshot(bad, &none).code() == Code::kInvalidArgument);
    CHECK(VerifySerializedSnapshot(bad, &step).code() == Code::kInvalidArgument);
    CHECK(none.variables.empty());
  }
  ShardSnapshot none;
  CHECK(ParseSnapshot(bytes.substr(0, bytes.size() - 9), &none).code() == Code::kInvalidArgument);
  CHECK(ParseSnapshot("", &none).code() == Code::kInvalidArgument);
  // A checkpoint part's magic (or an older psd's copy): refused, saying so.
  std::string part = bytes;
  part.replace(0, 8, "PSDCKPT4");
  CHECK_THAT(VerifySerializedSnapshot(part, &step).message(), Catch::Contains("another version"));
}

TEST_CASE("the newest checkpoint that verifies is used, corrupt or torn ones are skipped", "[checkpoint]") {
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
  // Before, these were read whole first: the daemon died at start (std::bad_alloc) or hung.
  SECTION("a manifest grown huge (sparse)") { fs::resize_file(newest->path + "/MANIFEST", 100ull << 30); }
  SECTION("a directory where the manifest was") {
    fs::remove(newest->path + "/MANIFEST");
    fs::create_directory(newest->path + "/MANIFEST");
  }
  SECTION("a FIFO where the manifest was") {
    fs::remove(newest->path + "/MANIFEST");
    REQUIRE(::mkfifo((newest->path + "/MANIFEST").c_str(), 0600) == 0);
  }
  SECTION("a FIFO where the part was") {
    fs::remove(part);
    REQUIRE(::mkfifo(part.c_str(), 0600) == 0);
  }
  SECTION("a checkpoint directory renamed to a newer step") {
    fs::rename(newest->path, dir.path + "/ckpt-00000000000000000099");  // still step 20 inside
    ShardSnapshot back;
    auto loaded = LoadLatestCheckpoint(dir.path, 0, &back);
    REQUIRE(loaded.ok());
    CHECK(loaded->step == 10);  // not restored as step 99
  }
  ShardSnapshot back;
  auto loaded = LoadLatestCheckpoint(dir.path, 0, &back);
  REQUIRE(loaded.ok());
  CHECK(loaded->step == 10);
  CHECK(At(back.variables[0].value, 0) == 1);
}

TEST_CASE("retention keeps the newest checkpoints, an empty directory has none", "[checkpoint]") {
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

namespace {

// The steps of `dir`'s step directories, and of those with a MANIFEST.
std::pair<std::vector<int64_t>, std::vector<int64_t>> StepDirs(const std::string& dir) {
  std::vector<int64_t> all, complete;
  for (auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("ckpt-", 0) != 0) continue;
    all.push_back(std::stoll(n.substr(5)));
    if (fs::exists(e.path() / "MANIFEST")) complete.push_back(all.back());
  }
  std::sort(all.begin(), all.end());
  std::sort(complete.begin(), complete.end());
  return {all, complete};
}

void MakeStepDir(const std::string& dir, int64_t step) {  // a write cut off: a part's .tmp, no manifest
  char name[64];
  std::snprintf(name, sizeof(name), "ckpt-%020lld", static_cast<long long>(step));
  fs::create_directories(dir + "/" + name);
  std::ofstream(dir + "/" + name + "/shard-0-of-1.psdckpt.tmp") << "cut off";
}

}  // namespace

TEST_CASE("a checkpoint write that fails leaves no temporary file", "[checkpoint]") {
  TempDir dir;
  REQUIRE(WriteCheckpoint(dir.path, Snapshot(1, 1), 0, 1, 0).ok());
  // Step 2's part cannot be renamed into place: a directory holds its name.
  char name[64];
  std::snprintf(name, sizeof(name), "ckpt-%020d", 2);
  const std::string step_dir = dir.path + "/" + name;
  fs::create_directories(step_dir + "/shard-0-of-1.psdckpt/x");
  auto failed = WriteCheckpoint(dir.path, Snapshot(2, 2), 0, 1, 0);
  REQUIRE_FALSE(failed.ok());
  CHECK_THAT(failed.status().message(), Catch::Contains("rename"));
  CHECK_FALSE(fs::exists(step_dir + "/shard-0-of-1.psdckpt.tmp"));
  ShardSnapshot back;
  CHECK(LoadLatestCheckpoint(dir.path, 0, &back)->step == 1);
}

TEST_CASE("retention counts complete checkpoints only: a cut-off or unsealed one never pushes them out",
          "[checkpoint]") {
  TempDir dir;
  SECTION("a single daemon with a cut-off write at a later step") {
    for (int step = 1; step <= 2; ++step) REQUIRE(WriteCheckpoint(dir.path, Snapshot(step, step), 0, 1, 2).ok());
    MakeStepDir(dir.path, 9);  // then restarted from step 2
    REQUIRE(WriteCheckpoint(dir.path, Snapshot(3, 3), 0, 1, 2).ok());
    CHECK(StepDirs(dir.path).second == std::vector<int64_t>{2, 3});
    CHECK(StepDirs(dir.path).first == std::vector<int64_t>{2, 3, 9});
    ShardSnapshot back;
    CHECK(LoadLatestCheckpoint(dir.path, 0, &back)->step == 3);
    // Once two newer complete ones exist, the cut-off one is older than both and goes.
    for (int step = 10; step <= 11; ++step) REQUIRE(WriteCheckpoint(dir.path, Snapshot(step, step), 0, 1, 2).ok());
    CHECK(StepDirs(dir.path).first == std::vector<int64_t>{10, 11});
  }
  SECTION("a cluster shard whose parts are not sealed") {
    // Steps 1 and 2 sealed; then only this shard writes (the chief seals nothing more).
    for (int64_t step = 1; step <= 2; ++step) {
      auto info = WriteCheckpoint(dir.path, Snapshot(step, 1), 0, 3, 2);
      REQUIRE(info.ok());
      REQUIRE(WriteManifest(dir.path, step, 3, {{0, info->part_file, info->part_bytes, info->part_checksum}}).ok());
    }
    for (int64_t step = 3; step <= 6; ++step) REQUIRE(WriteCheckpoint(dir.path, Snapshot(step, 1), 0, 3, 2).ok());
    // The sealed ones stay; of the unsealed, the newest two.
    CHECK(StepDirs(dir.path).second == std::vector<int64_t>{1, 2});
    CHECK(StepDirs(dir.path).first == std::vector<int64_t>{1, 2, 5, 6});
  }
}

// --- cluster checkpoints: parts written by each shard, sealed by the chief's manifest ----------

namespace {

// Writes step `step` as shard k of 3 for every k, and seals it (as the chief does).
void WriteClusterCheckpoint(const std::string& dir, int64_t step) {
  std::vector<ManifestPart> parts;
  for (int k = 0; k < 3; ++k) {
    ShardSnapshot s = Snapshot(step, static_cast<float>(10 * k + step));
    s.variables[0].placement = {"w", DType::kFloat32, {6}, true, {{2, 0, 2}, {0, 2, 4}, {1, 4, 6}}, true};
    auto info = WriteCheckpoint(dir, s, k, 3, 0);
    REQUIRE(info.ok());
    CHECK(info->part_file == "shard-" + std::to_string(k) + "-of-3.psdckpt");
    parts.push_back({k, info->part_file, info->part_bytes, info->part_checksum});
  }
  REQUIRE(WriteManifest(dir, step, 3, parts).ok());
}

}  // namespace

TEST_CASE("a cluster checkpoint is restorable only once sealed, per shard", "[checkpoint][cluster]") {
  TempDir dir;
  WriteClusterCheckpoint(dir.path, 10);
  // Parts of step 20 written, but never sealed (the chief died before every part was in).
  for (int k = 0; k < 3; ++k) REQUIRE(WriteCheckpoint(dir.path, Snapshot(20, 1), k, 3, 0).ok());
  for (int k = 0; k < 3; ++k) CHECK(RestorableSteps(dir.path, k, 3) == std::vector<int64_t>{10});
  // Another cluster size cannot use it.
  CHECK(RestorableSteps(dir.path, 0, 2).empty());

  ShardSnapshot back;
  REQUIRE(LoadCheckpointAt(dir.path, 10, 1, &back).ok());
  CHECK(back.step == 10);
  CHECK(At(back.variables[0].value, 0) == 20);  // shard 1's own part
  const VarPlacement& p = back.variables[0].placement;
  CHECK(p.name == "w");
  CHECK(p.sliced);
  REQUIRE(p.parts.size() == 3);
  CHECK(p.parts[2].shard == 1);
  CHECK(p.parts[2].row_begin == 4);
  CHECK(LoadCheckpointAt(dir.path, 20, 1, &back).code() == Code::kNotFound);
}

TEST_CASE("a single daemon never restores a cluster's checkpoint (half a model)", "[checkpoint][cluster]") {
  TempDir dir;
  REQUIRE(WriteCheckpoint(dir.path, Snapshot(1, 1), 0, 1, 0).ok());  // its own, older
  WriteClusterCheckpoint(dir.path, 2);                               // a cluster's, sharing the directory
  ShardSnapshot back;
  auto loaded = LoadLatestCheckpoint(dir.path, 0, &back);
  REQUIRE(loaded.ok());
  CHECK(loaded->step == 1);
}

TEST_CASE("a corrupt part makes that step unrestorable for its shard only", "[checkpoint][cluster]") {
  TempDir dir;
  WriteClusterCheckpoint(dir.path, 10);
  WriteClusterCheckpoint(dir.path, 20);
  std::string part = dir.path + "/ckpt-00000000000000000020/shard-2-of-3.psdckpt";
  FlipByte(part, 40);
  CHECK(RestorableSteps(dir.path, 2, 3) == std::vector<int64_t>{10});
  CHECK(RestorableSteps(dir.path, 0, 3) == (std::vector<int64_t>{20, 10}));
  // Present but unusable (not lost: the cluster falls back without asking an operator).
  std::vector<int64_t> unusable;
  CHECK(RestorableSteps(dir.path, 2, 3, &unusable) == std::vector<int64_t>{10});
  CHECK(unusable == std::vector<int64_t>{20});
  unusable.clear();
  RestorableSteps(dir.path, 0, 3, &unusable);
  CHECK(unusable.empty());
  ShardSnapshot back;
  CHECK(LoadCheckpointAt(dir.path, 20, 2, &back).code() == Code::kInvalidArgument);
  // A tampered manifest is rejected as a whole.
  FlipByte(dir.path + "/ckpt-00000000000000000010/MANIFEST", 20);
  CHECK(RestorableSteps(dir.path, 0, 3) == std::vector<int64_t>{20});
}

TEST_CASE("a shard that missed a seal writes it from the chief's parts only if its own part matches",
          "[checkpoint][cluster]") {
  TempDir chief, lagging;
  // Every shard wrote its part of step 30 into its own directory; only the chief's is sealed.
  std::vector<ManifestPart> parts;
  for (int k = 0; k < 3; ++k) {
    auto info = WriteCheckpoint(k == 1 ? lagging.path : chief.path, Snapshot(30, static_cast<float>(k)), k, 3, 0);
    REQUIRE(info.ok());
    parts.push_back({k, info->part_file, info->part_bytes, info->part_checksum});
  }
  REQUIRE(WriteManifest(chief.path, 30, 3, parts).ok());
  std::vector<int64_t> unusable;
  CHECK(RestorableSteps(lagging.path, 1, 3, &unusable).empty());
  CHECK(unusable == std::vector<int64_t>{30});  // present, unsealed
  // A seal that names another part for shard 1 (another timeline's step 30) is refused, and nothing is written.
  std::vector<ManifestPart> other = parts;
  other[1].checksum ^= 1;
  CHECK(SealOwnPart(lagging.path, 30, 1, 3, other).code() == Code::kFailedPrecondition);
  CHECK(RestorableSteps(lagging.path, 1, 3).empty());
  // So is a seal without a part for it, and one for a step it has no part of.
  CHECK(SealOwnPart(lagging.path, 30, 1, 3, {parts[0], parts[2]}).code() == Code::kFailedPrecondition);
  CHECK(SealOwnPart(lagging.path, 40, 1, 3, parts).code() == Code::kFailedPrecondition);
  // The chief's own seal: restorable there now.
  REQUIRE(SealOwnPart(lagging.path, 30, 1, 3, parts).ok());
  CHECK(RestorableSteps(lagging.path, 1, 3) == std::vector<int64_t>{30});
  ShardSnapshot back;
  REQUIRE(LoadCheckpointAt(lagging.path, 30, 1, &back).ok());
  CHECK(At(back.variables[0].value, 0) == 1);
}

// --- format v4: XXH3 block checksums, parallel writes, and the older formats still read ----------

namespace {

std::string ReadText(const std::string& file) {
  std::ifstream f(file, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// A buffer of `bytes` deterministic pseudo-random bytes (any bit pattern, NaNs included).
std::shared_ptr<const Buffer> Noise(size_t bytes, uint64_t seed) {
  auto b = std::make_shared<Buffer>(bytes);
  uint8_t* p = static_cast<uint8_t*>(b->data());
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < bytes; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<uint8_t>(x);
  }
  return b;
}

bool SameBytes(const std::shared_ptr<const Buffer>& a, const std::shared_ptr<const Buffer>& b) {
  return a && b && a->bytes() == b->bytes() && std::memcmp(a->data(), b->data(), a->bytes()) == 0;
}

// About 20 MB over several variables whose sizes cross the 4 MiB I/O blocks at odd offsets, with
// Adam-style slots: several blocks, so several writer threads.
ShardSnapshot LargeSnapshot(int64_t step) {
  ShardSnapshot s;
  s.step = step;
  s.learning_rate = 0.01;
  s.optimizer = "adam";
  const int64_t rows[] = {300001, 7, 250000, 1, 123457};
  for (int i = 0; i < 5; ++i) {
    VariableSnapshot v;
    v.name = "layer" + std::to_string(i);
    v.shape = {rows[i], 4};
    const size_t bytes = static_cast<size_t>(rows[i]) * 16;
    v.value = Noise(bytes, static_cast<uint64_t>(3 * i + 1));
    v.slots = {{"m", Noise(bytes, static_cast<uint64_t>(3 * i + 2))},
               {"v", Noise(bytes, static_cast<uint64_t>(3 * i + 3))}};
    s.variables.push_back(std::move(v));
  }
  return s;
}

void CheckSameState(const ShardSnapshot& a, const ShardSnapshot& b) {
  CHECK(a.step == b.step);
  CHECK(a.learning_rate == b.learning_rate);
  CHECK(a.optimizer == b.optimizer);
  REQUIRE(a.variables.size() == b.variables.size());
  for (size_t i = 0; i < a.variables.size(); ++i) {
    const VariableSnapshot& x = a.variables[i];
    const VariableSnapshot& y = b.variables[i];
    CHECK(x.name == y.name);
    CHECK(x.shape == y.shape);
    CHECK(SameBytes(x.value, y.value));
    REQUIRE(x.slots.size() == y.slots.size());
    for (size_t k = 0; k < x.slots.size(); ++k) {
      CHECK(x.slots[k].first == y.slots[k].first);
      CHECK(SameBytes(x.slots[k].second, y.slots[k].second));
    }
  }
}

std::string FixtureV3() { return std::string(PSD_TEST_FIXTURES_DIR) + "/ckpt-v3"; }

}  // namespace

TEST_CASE("checkpoint v4: the part and manifest name the format and XXH3, values come back bit-identical",
          "[checkpoint]") {
  TempDir dir;
  auto info = WriteCheckpoint(dir.path, Snapshot(40, 7), 0, 1, 0);
  REQUIRE(info.ok());
  CHECK(ReadText(info->path + "/shard-0-of-1.psdckpt").rfind("PSDCKPT4", 0) == 0);
  std::string manifest = ReadText(info->path + "/MANIFEST");
  CHECK(manifest.rfind("psd-checkpoint 2\nhash xxh3-64\n", 0) == 0);
  // The manifest records the part's trailer (its XXH3 block checksum).
  std::string part = ReadText(info->path + "/shard-0-of-1.psdckpt");
  uint64_t trailer = 0;
  std::memcpy(&trailer, part.data() + part.size() - 8, 8);
  CHECK(trailer == info->part_checksum);
  CHECK(info->part_bytes == part.size());
  ShardSnapshot back;
  REQUIRE(LoadLatestCheckpoint(dir.path, 0, &back).ok());
  CheckSameState(Snapshot(40, 7), back);
  CHECK(SameBytes(back.variables[0].shadow, Snapshot(40, 7).variables[0].shadow));
}

TEST_CASE("checkpoint v4: a large multi-variable part is written in parallel blocks and round-trips", "[checkpoint]") {
  TempDir dir;
  ShardSnapshot big = LargeSnapshot(7);
  auto info = WriteCheckpoint(dir.path, big, 0, 1, 0);
  REQUIRE(info.ok());
  CHECK(info->part_bytes > 20'000'000);  // 5+ blocks of 4 MiB
  CHECK(VerifyCheckpoint(info->path).ok());
  ShardSnapshot back;
  REQUIRE(LoadLatestCheckpoint(dir.path, 0, &back).ok());
  CheckSameState(big, back);
  ShardSnapshot at;
  REQUIRE(LoadCheckpointAt(dir.path, 7, 0, &at).ok());
  CheckSameState(big, at);
}

TEST_CASE("checkpoint v4: one corrupted byte anywhere in a part is detected", "[checkpoint]") {
  TempDir dir;
  REQUIRE(WriteCheckpoint(dir.path, LargeSnapshot(1), 0, 1, 0).ok());
  auto newest = WriteCheckpoint(dir.path, LargeSnapshot(2), 0, 1, 0);
  REQUIRE(newest.ok());
  std::string part = newest->path + "/shard-0-of-1.psdckpt";
  long where = 0;
  SECTION("in the records") { where = 20; }
  SECTION("in a tensor, mid-file (a later I/O block)") { where = 13'000'001; }
  SECTION("in the last tensor byte") { where = static_cast<long>(newest->part_bytes) - 9; }
  SECTION("in the trailer") { where = static_cast<long>(newest->part_bytes) - 3; }
  FlipByte(part, where);
  CHECK_THAT(VerifyCheckpoint(newest->path).message(), Catch::Contains("checksum"));
  ShardSnapshot back;
  CHECK(LoadCheckpointAt(dir.path, 2, 0, &back).code() == Code::kInvalidArgument);
  CHECK(RestorableSteps(dir.path, 0, 1) == std::vector<int64_t>{1});
  auto loaded = LoadLatestCheckpoint(dir.path, 0, &back);
  REQUIRE(loaded.ok());
  CHECK(loaded->step == 1);  // the older one, which verifies
  CheckSameState(LargeSnapshot(1), back);
}

TEST_CASE("a v3 checkpoint (FNV-1a, written by the old writer) still verifies and restores", "[checkpoint]") {
  TempDir dir;
  fs::copy(FixtureV3(), dir.path, fs::copy_options::recursive);
  const std::string step40 = dir.path + "/ckpt-00000000000000000040";
  CHECK(ReadText(step40 + "/MANIFEST").rfind("psd-checkpoint 1\n", 0) == 0);
  CHECK(ReadText(step40 + "/shard-0-of-1.psdckpt").rfind("PSDCKPT3", 0) == 0);
  CHECK(VerifyCheckpoint(step40).ok());
  CHECK(RestorableSteps(dir.path, 0, 1) == std::vector<int64_t>{40});

  auto check = [](const ShardSnapshot& back) {
    CHECK(back.step == 40);
    CHECK(back.learning_rate == 0.25);
    CHECK(back.optimizer == "adam");
    REQUIRE(back.variables.size() == 2);
    const VariableSnapshot& w = back.variables[0];
    CHECK(At(w.value, 0) == 7);
    CHECK(At(w.value, 1) == 8);
    REQUIRE(w.slots.size() == 2);
    CHECK(At(w.slots[0].second, 1) == 0.25f);
    REQUIRE(w.shadow);
    CHECK(At(w.shadow, 0) == 3.5f);
    CHECK(w.placement.name == "w");
    CHECK(w.aggregation == 1);
    CHECK(back.variables[1].sync_on_read);
    CHECK(*back.variables[1].value->as<double>() == 3.5);
  };
  ShardSnapshot back;
  auto loaded = LoadLatestCheckpoint(dir.path, 0, &back);
  REQUIRE(loaded.ok());
  check(back);
  ShardSnapshot at;
  REQUIRE(LoadCheckpointAt(dir.path, 40, 0, &at).ok());
  check(at);

  // A v4 checkpoint written after it is the newest; a corrupt v3 part is still caught.
  REQUIRE(WriteCheckpoint(dir.path, Snapshot(50, 1), 0, 1, 0).ok());
  CHECK(RestorableSteps(dir.path, 0, 1) == (std::vector<int64_t>{50, 40}));
  FlipByte(step40 + "/shard-0-of-1.psdckpt", 60);
  CHECK_THAT(VerifyCheckpoint(step40).message(), Catch::Contains("checksum"));
  CHECK(RestorableSteps(dir.path, 0, 1) == std::vector<int64_t>{50});
}

TEST_CASE("a part's size and checksum are read from its file without the manifest", "[checkpoint][cluster]") {
  TempDir dir;
  // Parts of step 20 of a 3-shard cluster, never sealed: each names what a seal would record.
  for (int k = 0; k < 3; ++k) {
    auto info = WriteCheckpoint(dir.path, Snapshot(20, static_cast<float>(k)), k, 3, 0);
    REQUIRE(info.ok());
    auto peek = PeekOwnPart(dir.path, 20, k, 3);
    REQUIRE(peek.ok());
    CHECK(peek->shard == k);
    CHECK(peek->file == info->part_file);
    CHECK(peek->bytes == info->part_bytes);
    CHECK(peek->checksum == info->part_checksum);
  }
  // Written again with other values (another timeline's part of that step): another checksum.
  auto before = PeekOwnPart(dir.path, 20, 1, 3);
  REQUIRE(WriteCheckpoint(dir.path, Snapshot(20, 9), 1, 3, 0).ok());
  auto after = PeekOwnPart(dir.path, 20, 1, 3);
  REQUIRE(after.ok());
  CHECK(after->checksum != before->checksum);
  // No part: NotFound. An older format (its trailer is no checksum): refused.
  CHECK(PeekOwnPart(dir.path, 30, 1, 3).status().code() == Code::kNotFound);
  fs::copy(FixtureV3(), dir.path + "/v3", fs::copy_options::recursive);
  CHECK(PeekOwnPart(dir.path + "/v3", 40, 0, 1).status().code() == Code::kInvalidArgument);
}

namespace {

// A part at step 10 (SGD) holding an embedding of 4096 rows of 16 floats.
ShardSnapshot EmbeddingAtStep10() {
  ShardSnapshot base;
  base.step = 10;
  base.optimizer = "sgd";
  VariableSnapshot emb;
  emb.name = "emb";
  emb.shape = {4096, 16};
  auto table = std::make_shared<Buffer>(4096 * 16 * sizeof(float));
  for (int i = 0; i < 4096 * 16; ++i) table->as<float>()[i] = static_cast<float>(i) * 0.5f;
  emb.value = table;
  base.variables.push_back(emb);
  return base;
}

}  // namespace

TEST_CASE("a difference compares only the rows a copy lists as written since the base's buffer",
          "[checkpoint][replicas]") {
  ShardSnapshot base = EmbeddingAtStep10();
  const std::shared_ptr<const Buffer> table = base.variables[0].value;
  const std::string base_bytes = SerializeSnapshot(base);

  // The engine's way: a copy of the base's buffer, then rows written and listed.
  ShardSnapshot next = base;
  next.step = 11;
  auto listed = std::make_shared<Buffer>(*table);
  listed->MarkCopiedFrom(*table);
  auto* rows = static_cast<float*>(listed->listed_data());
  for (int row : {5, 6, 1000, 4095}) {
    listed->MarkChanged(row * 64, 64);
    rows[row * 16 + 3] += 1.0f;
  }
  next.variables[0].value = listed;
  const std::string delta = SerializeSnapshotDelta(base, SerializeSnapshotInPieces(next), 7, 10);
  REQUIRE_FALSE(delta.empty());
  // The same difference as comparing the whole buffer finds (a copy of it lists nothing).
  ShardSnapshot next_whole = next;
  next_whole.variables[0].value = std::make_shared<Buffer>(*listed);
  CHECK(delta == SerializeSnapshotDelta(base, SerializeSnapshotInPieces(next_whole), 7, 10));
  std::string rebuilt;
  int64_t step = -1;
  REQUIRE(ApplySnapshotDelta(base_bytes, delta, &rebuilt, &step).ok());
  CHECK(rebuilt == SerializeSnapshot(next));

  // Only the listed rows are compared: a write behind the list's back is not in the difference, and
  // the copy rebuilt from it does not match its owner's checksum (sent again whole, in the cluster).
  rows[2000 * 16] = -1.0f;
  const std::string blind = SerializeSnapshotDelta(base, SerializeSnapshotInPieces(next), 7, 10);
  REQUIRE_FALSE(blind.empty());
  CHECK_THAT(ApplySnapshotDelta(base_bytes, blind, &rebuilt, &step).message(),
             Catch::Contains("does not match its owner's"));
  // A list of changes from another buffer than the base's is not used: the whole buffer is compared.
  ShardSnapshot other_base = base;
  other_base.variables[0].value = std::make_shared<Buffer>(*table);
  const std::string whole = SerializeSnapshotDelta(other_base, SerializeSnapshotInPieces(next), 7, 10);
  REQUIRE(ApplySnapshotDelta(SerializeSnapshot(other_base), whole, &rebuilt, &step).ok());
  CHECK(rebuilt == SerializeSnapshot(next));
  // Nor once a write that says nothing ended the list.
  static_cast<float*>(listed->data())[0] = 0;
  const std::string unlisted = SerializeSnapshotDelta(base, SerializeSnapshotInPieces(next), 7, 10);
  REQUIRE(ApplySnapshotDelta(base_bytes, unlisted, &rebuilt, &step).ok());
  CHECK(rebuilt == SerializeSnapshot(next));
}

TEST_CASE("a chain of differences replayed over the copy it starts from rebuilds the last one in place",
          "[checkpoint][replicas]") {
  // Steps 10 -> 11 -> 12 -> 13, a few rows each; the next shard still has step 10's bytes (the
  // storage of a copy it let go) and the differences since.
  std::vector<ShardSnapshot> steps{EmbeddingAtStep10()};
  std::vector<std::string> deltas;
  for (int k = 1; k <= 3; ++k) {
    ShardSnapshot next = steps.back();
    next.step = 10 + k;
    auto changed = std::make_shared<Buffer>(*next.variables[0].value);
    for (int row : {k, 100 * k, 4000 + k}) changed->as<float>()[row * 16] += static_cast<float>(k);
    next.variables[0].value = changed;
    deltas.push_back(SerializeSnapshotDelta(steps.back(), SerializeSnapshotInPieces(next), 7, next.step - 1));
    REQUIRE_FALSE(deltas.back().empty());
    steps.push_back(next);
  }
  const std::string want = SerializeSnapshot(steps.back());
  std::string copy = SerializeSnapshot(steps[0]);
  const char* storage = copy.data();
  int64_t step = -1;
  REQUIRE(ReplaySnapshotDeltas({&deltas[0], &deltas[1], &deltas[2]}, &copy, &step).ok());
  CHECK(step == 13);
  CHECK(copy == want);
  CHECK(copy.data() == storage);  // in place
  // One missing from the chain: the result is not the owner's copy, and it says so.
  copy = SerializeSnapshot(steps[0]);
  CHECK_THAT(ReplaySnapshotDeltas({&deltas[0], &deltas[2]}, &copy, &step).message(),
             Catch::Contains("does not match its owner's"));
  // A head of another size (a renamed variable) would move the payload: refused, nothing written.
  ShardSnapshot renamed = steps[0];
  renamed.variables[0].name = "embedding";
  const std::string before = SerializeSnapshot(renamed);
  copy = before;
  CHECK(ReplaySnapshotDeltas({&deltas[0]}, &copy, &step).code() == Code::kFailedPrecondition);
  CHECK(copy == before);
}

TEST_CASE("a copy sent as the difference from the one before rebuilds it bit for bit, and only on that base",
          "[checkpoint][replicas]") {
  // An embedding of 4096 rows of 16 floats and a small variable; the next step changes a few rows
  // (two of them adjacent, the last one too) of the embedding and leaves the other variable as it was.
  ShardSnapshot base = EmbeddingAtStep10();
  const std::shared_ptr<const Buffer> table = base.variables[0].value;
  VariableSnapshot bias;
  bias.name = "bias";
  bias.shape = {3};
  bias.value = Floats({1, 2, 3});
  base.variables.push_back(bias);

  ShardSnapshot next = base;
  next.step = 11;
  auto changed = std::make_shared<Buffer>(*table);
  for (int row : {5, 6, 1000, 4095}) changed->as<float>()[row * 16 + 3] += 1.0f;
  next.variables[0].value = changed;
  const SerializedSnapshot pieces = SerializeSnapshotInPieces(next);
  const std::string whole = SerializeSnapshot(next);
  const std::string base_bytes = SerializeSnapshot(base);

  const std::string delta = SerializeSnapshotDelta(base, pieces, 7, 10);
  REQUIRE_FALSE(delta.empty());
  CHECK(delta.size() < whole.size() / 20);  // 3 runs of 256 bytes, against a 256 KiB table
  uint64_t lineage = 0;
  int64_t step = 0;
  REQUIRE(IsSnapshotDelta(delta, &lineage, &step));
  CHECK(lineage == 7);
  CHECK(step == 10);
  CHECK_FALSE(IsSnapshotDelta(whole, &lineage, &step));
  std::string rebuilt;
  int64_t rebuilt_step = -1;
  REQUIRE(ApplySnapshotDelta(base_bytes, delta, &rebuilt, &rebuilt_step).ok());
  CHECK(rebuilt_step == 11);
  CHECK(rebuilt == whole);
  // Rebuilt in the storage it is given (the next shard reuses a let-go copy's: no new pages).
  std::string storage(whole.size() + 64, 'z');
  const char* where = storage.data();
  REQUIRE(ApplySnapshotDelta(base_bytes, delta, &storage, &rebuilt_step).ok());
  CHECK(storage.data() == where);
  CHECK(storage == whole);

  // On another base of the same layout the rebuilt copy does not match its owner's checksum.
  ShardSnapshot other = base;
  auto moved = std::make_shared<Buffer>(*table);
  moved->as<float>()[2000] = -1;  // a row the delta does not carry
  other.variables[0].value = moved;
  std::string out;
  CHECK_THAT(ApplySnapshotDelta(SerializeSnapshot(other), delta, &out, &step).message(),
             Catch::Contains("does not match its owner's"));
  CHECK(out.empty());
  // A changed or missing byte of the delta is refused before anything is rebuilt.
  for (size_t at : {size_t{30}, delta.size() / 2, delta.size() - 1}) {
    std::string bad = delta;
    bad[at] = static_cast<char>(bad[at] ^ 0x5a);
    CHECK(ApplySnapshotDelta(base_bytes, bad, &out, &step).code() == Code::kInvalidArgument);
  }
  CHECK(ApplySnapshotDelta(base_bytes, delta.substr(0, delta.size() - 9), &out, &step).code() ==
        Code::kInvalidArgument);
  CHECK(out.empty());

  // A part with no tensors (a shard that holds no variable yet): the difference is its records.
  ShardSnapshot empty;
  empty.step = 3;
  empty.optimizer = "sgd";
  ShardSnapshot empty_next = empty;
  empty_next.step = 4;
  const std::string empty_delta = SerializeSnapshotDelta(empty, SerializeSnapshotInPieces(empty_next), 7, 3);
  REQUIRE_FALSE(empty_delta.empty());
  REQUIRE(ApplySnapshotDelta(SerializeSnapshot(empty), empty_delta, &out, &step).ok());
  CHECK(out == SerializeSnapshot(empty_next));

  // No delta when it does not pay or cannot be applied: more than half of the bytes changed, or
  // a tensor of another size.
  ShardSnapshot most = base;
  auto rewritten = std::make_shared<Buffer>(*table);
  for (int i = 0; i < 4096 * 16; ++i) rewritten->as<float>()[i] += 1.0f;
  most.variables[0].value = rewritten;
  CHECK(SerializeSnapshotDelta(base, SerializeSnapshotInPieces(most), 7, 10).empty());
  ShardSnapshot grown = next;
  grown.variables[1].value = Floats({1, 2, 3, 4});
  grown.variables[1].shape = {4};
  CHECK(SerializeSnapshotDelta(base, SerializeSnapshotInPieces(grown), 7, 10).empty());
}

TEST_CASE("a tensor rewritten almost whole is sent whole without being compared, a partly changed one as a difference",
          "[checkpoint][replicas]") {
  // A 2 MiB tensor in a new buffer (a dense step's value: no list of changes, so all of it may differ).
  constexpr int kFloats = 1 << 19;
  ShardSnapshot base;
  base.step = 10;
  base.optimizer = "sgd";
  VariableSnapshot w;
  w.name = "w";
  w.shape = {kFloats};
  auto values = std::make_shared<Buffer>(kFloats * sizeof(float));
  for (int i = 0; i < kFloats; ++i) values->as<float>()[i] = static_cast<float>(i % 1000) * 0.25f;
  w.value = values;
  base.variables.push_back(w);
  const std::string base_bytes = SerializeSnapshot(base);
  auto next_with = [&](const std::function<bool(int)>& changes) {
    ShardSnapshot next = base;
    next.step = 11;
    auto v = std::make_shared<Buffer>(*values);  // a new buffer, not listed as a copy of the base's
    for (int i = 0; i < kFloats; ++i) {
      if (changes(i)) v->as<float>()[i] += 1.0f;
    }
    next.variables[0].value = v;
    return next;
  };
  auto delta_of = [&](const ShardSnapshot& next) {
    return SerializeSnapshotDelta(base, SerializeSnapshotInPieces(next), 7, 10);
  };
  // Rewritten whole, or three quarters of it: no difference (sent whole).
  CHECK(delta_of(next_with([](int) { return true; })).empty());
  CHECK(delta_of(next_with([](int i) { return i % 4 != 0; })).empty());
  // 40% of it, in one run, and one float in every eighth 256-byte block (the fourth): differences
  // that rebuild it.
  for (const ShardSnapshot& next : {next_with([](int i) { return i < kFloats / 10 * 4; }),
                                    next_with([](int i) { return i % (64 * 8) == 64 * 3 + 5; })}) {
    const std::string delta = delta_of(next);
    REQUIRE_FALSE(delta.empty());
    CHECK(delta.size() < SerializeSnapshot(next).size() / 2);
    std::string rebuilt;
    int64_t step = -1;
    REQUIRE(ApplySnapshotDelta(base_bytes, delta, &rebuilt, &step).ok());
    CHECK(rebuilt == SerializeSnapshot(next));
  }
  // The guess is made from 64 evenly spread 256-byte blocks: a change that hits nearly all of them
  // (one block in every 16 KiB) is sent whole though it is small — bytes on the wire, never a
  // wrong copy.
  CHECK(delta_of(next_with([](int i) { return i % 4096 == 0; })).empty());
}

TEST_CASE("copy block hashes: only the blocks that may differ are hashed again, to what hashing all gives",
          "[checkpoint][replicas]") {
  // Payloads in pieces of odd sizes (blocks span pieces), changed in random places; the ranges
  // given cover every change. Deterministic.
  uint64_t seed = 12345;
  auto next = [&seed](uint64_t n) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return (seed >> 33) % n;
  };
  for (int round = 0; round < 50; ++round) {
    std::vector<std::string> before;
    for (uint64_t k = 0, pieces = 1 + next(5); k < pieces; ++k) {
      std::string piece(next(5000), '\0');
      for (char& c : piece) c = static_cast<char>(next(256));
      before.push_back(piece);
    }
    std::vector<std::string> after = before;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    uint64_t at = 0;
    for (std::string& piece : after) {
      for (uint64_t w = 0, writes = next(4); w < writes && !piece.empty(); ++w) {
        const uint64_t from = next(piece.size()), len = 1 + next(std::min<uint64_t>(300, piece.size() - from));
        for (uint64_t i = from; i < from + len; ++i) piece[i] = static_cast<char>(piece[i] + 1);
        ranges.emplace_back(at + from, at + from + len);
      }
      at += piece.size();
    }
    PayloadPieces was, now;
    for (const std::string& p : before) was.Add(p.data(), p.size());
    for (const std::string& p : after) now.Add(p.data(), p.size());
    CHECK(RehashChangedBlocks(was.HashAll(), now, ranges) == now.HashAll());
  }
  // A change the ranges leave out keeps its block's old hash: the ranges are trusted.
  std::string before(8 * kCopyBlockBytes, 'a'), after = before;
  after[5 * kCopyBlockBytes + 10] = 'b';
  after[1 * kCopyBlockBytes] = 'c';
  PayloadPieces was, now;
  was.Add(before.data(), before.size());
  now.Add(after.data(), after.size());
  CopyBlockHashes listed = RehashChangedBlocks(was.HashAll(), now, {{kCopyBlockBytes, kCopyBlockBytes + 1}});
  CHECK(listed[1] == now.HashAll()[1]);
  CHECK(listed[5] == was.HashAll()[5]);
  CHECK(listed != now.HashAll());
}

namespace {

// EmbeddingAtStep10 with a 3-float variable before the table (so the table's rows straddle blocks).
ShardSnapshot BiasAndEmbeddingAtStep10() {
  ShardSnapshot s = EmbeddingAtStep10();
  VariableSnapshot bias;
  bias.name = "bias";
  bias.shape = {3};
  bias.value = Floats({1, 2, 3});
  s.variables.insert(s.variables.begin(), bias);
  return s;
}

// `base` at the next step, some rows of its table written in a copy that lists them.
ShardSnapshot RowsWritten(const ShardSnapshot& base, std::vector<int> rows, float* unlisted_row = nullptr) {
  ShardSnapshot next = base;
  next.step = base.step + 1;
  const std::shared_ptr<const Buffer>& table = base.variables[1].value;
  auto listed = std::make_shared<Buffer>(*table);
  listed->MarkCopiedFrom(*table);
  auto* values = static_cast<float*>(listed->listed_data());
  for (int row : rows) {
    listed->MarkChanged(row * 64, 64);
    values[row * 16 + 5] -= 0.25f;
  }
  if (unlisted_row != nullptr) values[2000 * 16] = *unlisted_row;  // behind the list's back
  next.variables[1].value = listed;
  return next;
}

}  // namespace

TEST_CASE("a copy is checksummed from the one before's block hashes, and the next shard's rebuild from its base's",
          "[checkpoint][replicas]") {
  const ShardSnapshot base = BiasAndEmbeddingAtStep10();
  const SerializedSnapshot base_pieces = SerializeSnapshotInPieces(base);
  const std::string base_bytes = SerializeSnapshot(base);
  CopyBlockHashes verified;
  int64_t step = -1;
  REQUIRE(VerifySerializedSnapshot(base_bytes, &step, &verified).ok());
  CHECK(verified == base_pieces.blocks);  // the receiver's hashes of a whole copy are the owner's

  const ShardSnapshot next = RowsWritten(base, {0, 1, 511, 4095});
  const SerializedSnapshot full = SerializeSnapshotInPieces(next);
  SerializedSnapshot since = SerializeSnapshotSince(base, base_pieces.blocks, next);
  CHECK(since.blocks == full.blocks);
  CHECK(since.trailer == full.trailer);
  // A tensor that is a new buffer (no list) is hashed whole; another layout: every block.
  ShardSnapshot new_bias = next;
  new_bias.variables[0].value = Floats({1, 2, 4});
  CHECK(SerializeSnapshotSince(base, base_pieces.blocks, new_bias).trailer ==
        SerializeSnapshotInPieces(new_bias).trailer);
  ShardSnapshot longer = next;
  longer.variables[0].value = Floats({1, 2, 3, 4});
  CHECK(SerializeSnapshotSince(base, base_pieces.blocks, longer).trailer == SerializeSnapshotInPieces(longer).trailer);

  // What the owner sends, and what the next shard rebuilds with its base's block hashes: the
  // owner's copy, with the hashes a whole verification of it gives.
  ReplicaCopy r = SerializeReplicaCopy(next, &base, &base_pieces.blocks, 7, 10, /*audit=*/false);
  CHECK_FALSE(r.unlisted_write);
  REQUIRE_FALSE(r.delta.empty());
  std::string rebuilt;
  CopyBlockHashes rebuilt_blocks;
  REQUIRE(ApplySnapshotDelta(base_bytes, r.delta, &rebuilt, &step, &verified, &rebuilt_blocks).ok());
  CHECK(step == 11);
  CHECK(rebuilt == SerializeSnapshot(next));
  CHECK(rebuilt_blocks == full.blocks);
  // A base that differs where the delta does not write, with its own (true) hashes: refused.
  ShardSnapshot other = base;
  auto moved = std::make_shared<Buffer>(*base.variables[1].value);
  moved->as<float>()[3000 * 16] = -7;
  other.variables[1].value = moved;
  const std::string other_bytes = SerializeSnapshot(other);
  CopyBlockHashes other_blocks;
  REQUIRE(VerifySerializedSnapshot(other_bytes, &step, &other_blocks).ok());
  CHECK_THAT(ApplySnapshotDelta(other_bytes, r.delta, &rebuilt, &step, &other_blocks, &rebuilt_blocks).message(),
             Catch::Contains("does not match its owner's"));

  // A write no list names: the difference misses it and, from the lists, so does the checksum (the
  // next shard's rebuild passes but is not the owner's state) — the audit finds it and the copy
  // goes whole, hashed from its bytes.
  float minus_one = -1;
  const ShardSnapshot blind = RowsWritten(base, {7}, &minus_one);
  ReplicaCopy trusted = SerializeReplicaCopy(blind, &base, &base_pieces.blocks, 7, 10, /*audit=*/false);
  REQUIRE_FALSE(trusted.delta.empty());
  REQUIRE(ApplySnapshotDelta(base_bytes, trusted.delta, &rebuilt, &step, &verified, &rebuilt_blocks).ok());
  CHECK(rebuilt != SerializeSnapshot(blind));
  ReplicaCopy audited = SerializeReplicaCopy(blind, &base, &base_pieces.blocks, 7, 10, /*audit=*/true);
  CHECK(audited.unlisted_write);
  CHECK(audited.delta.empty());
  CHECK(audited.pieces.trailer == SerializeSnapshotInPieces(blind).trailer);
  // Audited with complete lists: the same copy as without.
  ReplicaCopy clean = SerializeReplicaCopy(next, &base, &base_pieces.blocks, 7, 10, /*audit=*/true);
  CHECK_FALSE(clean.unlisted_write);
  CHECK(clean.delta == r.delta);
  // No base: the copy whole; a base without hashes: hashed whole, still sent as a difference.
  CHECK(SerializeReplicaCopy(next, nullptr, nullptr, 0, 0, false).delta.empty());
  ReplicaCopy unhashed = SerializeReplicaCopy(next, &base, nullptr, 7, 10, false);
  CHECK(unhashed.delta == r.delta);
  CHECK(unhashed.pieces.blocks == full.blocks);
}

TEST_CASE("a chain replayed with the block hashes of the copy it starts from hashes only what it wrote",
          "[checkpoint][replicas]") {
  std::vector<ShardSnapshot> steps{BiasAndEmbeddingAtStep10()};
  std::vector<std::string> deltas;
  for (int k = 1; k <= 3; ++k) {
    steps.push_back(RowsWritten(steps.back(), {k, 100 * k, 4000 + k}));
    deltas.push_back(SerializeSnapshotDelta(steps[k - 1], SerializeSnapshotInPieces(steps[k]), 7, steps[k - 1].step));
    REQUIRE_FALSE(deltas.back().empty());
  }
  const SerializedSnapshot last = SerializeSnapshotInPieces(steps.back());
  std::string copy = SerializeSnapshot(steps[0]);
  CopyBlockHashes copy_blocks, blocks;
  int64_t step = -1;
  REQUIRE(VerifySerializedSnapshot(copy, &step, &copy_blocks).ok());
  REQUIRE(ReplaySnapshotDeltas({&deltas[0], &deltas[1], &deltas[2]}, &copy, &step, &copy_blocks, &blocks).ok());
  CHECK(step == 13);
  CHECK(copy == SerializeSnapshot(steps.back()));
  CHECK(blocks == last.blocks);
  // One missing from the chain: the rows it wrote keep the first copy's bytes and hashes, so the
  // result is not the owner's, and it says so.
  copy = SerializeSnapshot(steps[0]);
  CHECK_THAT(ReplaySnapshotDeltas({&deltas[0], &deltas[2]}, &copy, &step, &copy_blocks, &blocks).message(),
             Catch::Contains("does not match its owner's"));
}

#if defined(__x86_64__)
TEST_CASE("XXH3 through libxxhash's x86 dispatch gives the plain build's values", "[checkpoint]") {
  // Checkpoints and copies written with one must verify with the other (another machine, another psd).
  std::mt19937_64 rng(7);
  std::vector<unsigned char> data(70000);
  for (auto& c : data) c = static_cast<unsigned char>(rng());
  CHECK(XXH3_64bits_dispatch(data.data(), 0) == 0x2D06800538D394C2ull);  // the published empty-input value
  for (size_t len : {size_t{0}, size_t{1}, size_t{3}, size_t{16}, size_t{17}, size_t{128}, size_t{129}, size_t{240},
                     size_t{241}, size_t{1000}, size_t{1024}, size_t{4096}, size_t{65537}, size_t{70000}}) {
    for (size_t at : {size_t{0}, size_t{1}, size_t{13}}) {
      if (at + len > data.size()) continue;
      const uint64_t seed = rng();
      INFO("length " << len << " at " << at);
      CHECK(XXH3_64bits_dispatch(data.data() + at, len) == XXH3_64bits(data.data() + at, len));
      CHECK(XXH3_64bits_withSeed_dispatch(data.data() + at, len, seed) ==
            XXH3_64bits_withSeed(data.data() + at, len, seed));
      XXH3_state_t* a = XXH3_createState();
      XXH3_state_t* b = XXH3_createState();
      XXH3_64bits_reset_withSeed(a, seed);
      XXH3_64bits_reset_withSeed(b, seed);
      for (size_t off = 0; off < len; off += 777) {  // pieces of odd sizes
        const size_t n = std::min<size_t>(777, len - off);
        XXH3_64bits_update_dispatch(a, data.data() + at + off, n);
        XXH3_64bits_update(b, data.data() + at + off, n);
      }
      CHECK(XXH3_64bits_digest(a) == XXH3_64bits_digest(b));
      XXH3_freeState(a);
      XXH3_freeState(b);
    }
  }
}
#endif
