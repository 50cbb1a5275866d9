#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace psd::server {
namespace {

constexpr char kMagicV1[8] = {'P', 'S', 'D', 'C', 'K', 'P', 'T', '1'};
constexpr char kMagicV2[8] = {'P', 'S', 'D', 'C', 'K', 'P', 'T', '2'};  // v2: + placement
constexpr char kMagic[8] = {'P', 'S', 'D', 'C', 'K', 'P', 'T', '3'};    // v3: + aggregation, sync-on-read

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

Status MakeDirs(const std::string& path) {
  std::string cur;
  std::stringstream ss(path);
  std::string part;
  if (!path.empty() && path[0] == '/') cur = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    cur += part + "/";
    if (mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) return Unavailable(Errno("mkdir " + cur));
  }
  return Status::Ok();
}

Status FsyncPath(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return Unavailable(Errno("open " + path));
  int rc = fsync(fd);
  close(fd);
  if (rc != 0) return Unavailable(Errno("fsync " + path));
  return Status::Ok();
}

// Streams bytes to a file while hashing them.
class HashingWriter {
 public:
  explicit HashingWriter(FILE* f) : f_(f) {}
  void Bytes(const void* p, size_t n) {
    if (n == 0 || !ok_) return;
    ok_ = std::fwrite(p, 1, n, f_) == n;
    hash_ = Fnv1a64(p, n, hash_);
    size_ += n;
  }
  template <typename T>
  void Pod(T v) {
    Bytes(&v, sizeof(v));
  }
  void Str(const std::string& s) {
    Pod<uint32_t>(static_cast<uint32_t>(s.size()));
    Bytes(s.data(), s.size());
  }
  void Blob(const Buffer* b) {
    Pod<uint64_t>(b ? b->bytes() : 0);
    if (b) Bytes(b->data(), b->bytes());
  }
  bool ok() const { return ok_; }
  uint64_t hash() const { return hash_; }
  uint64_t size() const { return size_; }

 private:
  FILE* f_;
  bool ok_ = true;
  uint64_t hash_ = 1469598103934665603ull;
  uint64_t size_ = 0;
};

// Reads a verified part back; every read is bounds-checked (a corrupt file is an error, not a
// crash).
class Reader {
 public:
  Reader(const std::vector<uint8_t>& data) : data_(data) {}
  bool Bytes(void* out, size_t n) {
    if (n > data_.size() - pos_) return false;
    std::memcpy(out, data_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  bool Pod(T* v) {
    return Bytes(v, sizeof(T));
  }
  bool Str(std::string* s) {
    uint32_t n = 0;
    if (!Pod(&n) || n > data_.size() - pos_) return false;
    s->assign(reinterpret_cast<const char*>(data_.data() + pos_), n);
    pos_ += n;
    return true;
  }
  bool Blob(std::shared_ptr<const Buffer>* out) {
    uint64_t n = 0;
    if (!Pod(&n) || n > data_.size() - pos_) return false;
    auto b = std::make_shared<Buffer>(n);
    std::memcpy(b->data(), data_.data() + pos_, n);
    pos_ += n;
    *out = std::move(b);
    return true;
  }
  size_t pos() const { return pos_; }

 private:
  const std::vector<uint8_t>& data_;
  size_t pos_ = 0;
};

// The checkpoint directories in `dir` ("ckpt-" + 20 digits), oldest first.
std::vector<std::string> ListCheckpoints(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(dir, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    std::string n = it->path().filename().string();
    if (n.rfind("ckpt-", 0) == 0 && n.size() == 25) names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string StepDirName(int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "ckpt-%020" PRId64, step);
  return buf;
}

std::string PartName(int shard, int shards) {
  return "shard-" + std::to_string(shard) + "-of-" + std::to_string(shards) + ".psdckpt";
}

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, v);
  return buf;
}

Status ReadFile(const std::string& path, std::vector<uint8_t>* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return NotFound("cannot open " + path);
  f.seekg(0, std::ios::end);
  std::streamoff n = f.tellg();
  if (n < 0) return Unavailable("cannot read " + path);
  f.seekg(0);
  out->resize(static_cast<size_t>(n));
  if (n > 0 && !f.read(reinterpret_cast<char*>(out->data()), n)) return Unavailable("cannot read " + path);
  return Status::Ok();
}

struct Manifest {
  int64_t step = -1;
  int shards = 0;
  struct Part {
    int shard;
    std::string file;
    uint64_t bytes;
    uint64_t checksum;
  };
  std::vector<Part> parts;
};

Result<Manifest> ReadManifest(const std::string& path) {
  std::vector<uint8_t> raw;
  PSD_RETURN_IF_ERROR(ReadFile(path + "/MANIFEST", &raw));
  std::string text(raw.begin(), raw.end());
  size_t last = text.rfind("checksum ");
  if (last == std::string::npos) return InvalidArgument("manifest has no checksum line");
  uint64_t want = std::strtoull(text.c_str() + last + 9, nullptr, 16);
  if (Fnv1a64(text.data(), last) != want) return InvalidArgument("manifest checksum mismatch");
  Manifest m;
  std::istringstream in(text.substr(0, last));
  std::string word;
  in >> word;
  int version = 0;
  in >> version;
  if (word != "psd-checkpoint" || version != 1) return InvalidArgument("not a psd checkpoint manifest (version 1)");
  while (in >> word) {
    if (word == "step") {
      in >> m.step;
    } else if (word == "shards") {
      in >> m.shards;
    } else if (word == "part") {
      Manifest::Part p{};
      std::string sum;
      in >> p.shard >> p.file >> p.bytes >> sum;
      p.checksum = std::strtoull(sum.c_str(), nullptr, 16);
      if (p.file.find('/') != std::string::npos) return InvalidArgument("manifest names a file outside the checkpoint");
      m.parts.push_back(p);
    } else {
      return InvalidArgument("unknown manifest line '" + word + "'");
    }
  }
  if (m.step < 0 || m.shards < 1 || static_cast<int>(m.parts.size()) != m.shards) {
    return InvalidArgument("manifest is incomplete");
  }
  return m;
}

Status ParsePart(const std::vector<uint8_t>& data, ShardSnapshot* out) {
  auto bad = [](const std::string& why) { return InvalidArgument("checkpoint part is malformed: " + why); };
  if (data.size() < sizeof(kMagic) + 8) return bad("too short");
  uint64_t trailer = 0;
  std::memcpy(&trailer, data.data() + data.size() - 8, 8);
  if (Fnv1a64(data.data(), data.size() - 8) != trailer) return bad("checksum mismatch");
  std::vector<uint8_t> body(data.begin(), data.end() - 8);
  Reader r(body);
  char magic[8];
  if (!r.Bytes(magic, 8)) return bad("bad magic");
  const bool v3 = std::memcmp(magic, kMagic, 8) == 0;
  const bool v2 = v3 || std::memcmp(magic, kMagicV2, 8) == 0;
  if (!v2 && std::memcmp(magic, kMagicV1, 8) != 0) return bad("bad magic");
  uint32_t nvars = 0;
  if (!r.Pod(&out->step) || !r.Pod(&out->learning_rate) || !r.Str(&out->optimizer) || !r.Pod(&nvars)) {
    return bad("header");
  }
  out->variables.clear();
  for (uint32_t i = 0; i < nvars; ++i) {
    VariableSnapshot v;
    uint8_t dtype = 0, trainable = 0, average = 0, has_shadow = 0;
    uint32_t rank = 0, nslots = 0;
    if (!r.Str(&v.name) || !r.Pod(&dtype) || dtype > 1 || !r.Pod(&rank) || rank > 32) return bad("variable header");
    v.dtype = static_cast<DType>(dtype);
    for (uint32_t k = 0; k < rank; ++k) {
      int64_t d = 0;
      if (!r.Pod(&d) || d < 0) return bad("shape");
      v.shape.push_back(d);
    }
    if (!r.Pod(&trainable) || !r.Pod(&average) || !r.Str(&v.optimizer) || !r.Blob(&v.value)) return bad("value");
    v.trainable = trainable != 0;
    v.average = average != 0;
    uint64_t want = static_cast<uint64_t>(NumElements(v.shape)) * DTypeSize(v.dtype);
    if (v.value->bytes() != want) return bad("value size of '" + v.name + "'");
    if (!r.Pod(&nslots) || nslots > 16) return bad("slots");
    for (uint32_t k = 0; k < nslots; ++k) {
      std::string name;
      std::shared_ptr<const Buffer> b;
      if (!r.Str(&name) || !r.Blob(&b) || b->bytes() != want) return bad("slot of '" + v.name + "'");
      v.slots.emplace_back(std::move(name), std::move(b));
    }
    if (!r.Pod(&has_shadow)) return bad("shadow");
    if (has_shadow) {
      if (!r.Blob(&v.shadow) || v.shadow->bytes() != want) return bad("shadow of '" + v.name + "'");
    }
    uint8_t placed = 0;
    if (v2 && !r.Pod(&placed)) return bad("placement");
    if (placed) {
      VarPlacement& p = v.placement;
      uint8_t pd = 0, sliced = 0;
      uint32_t prank = 0, nparts = 0;
      if (!r.Str(&p.name) || !r.Pod(&pd) || pd > 1 || !r.Pod(&prank) || prank > 32) return bad("placement");
      p.dtype = static_cast<DType>(pd);
      for (uint32_t k = 0; k < prank; ++k) {
        int64_t d = 0;
        if (!r.Pod(&d) || d < 0) return bad("placement shape");
        p.shape.push_back(d);
      }
      if (!r.Pod(&sliced) || !r.Pod(&nparts) || nparts == 0 || nparts > 4096) return bad("placement parts");
      p.sliced = sliced != 0;
      for (uint32_t k = 0; k < nparts; ++k) {
        int32_t shard = 0;
        SlicePart part;
        if (!r.Pod(&shard) || !r.Pod(&part.row_begin) || !r.Pod(&part.row_end)) return bad("placement part");
        part.shard = shard;
        p.parts.push_back(part);
      }
    }
    if (v3) {
      uint8_t agg = 0, sor = 0;
      if (!r.Pod(&agg) || agg > 3 || !r.Pod(&sor)) return bad("aggregation of '" + v.name + "'");
      v.aggregation = agg;
      v.sync_on_read = sor != 0;
    }
    out->variables.push_back(std::move(v));
  }
  if (r.pos() != body.size()) return bad("trailing bytes");
  return Status::Ok();
}

}  // namespace

uint64_t Fnv1a64(const void* data, size_t bytes, uint64_t seed) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t h = seed;
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

Result<CheckpointInfo> WriteCheckpoint(const std::string& dir, const ShardSnapshot& snap, int shard, int shards,
                                       int keep) {
  std::string path = dir + "/" + StepDirName(snap.step);
  PSD_RETURN_IF_ERROR(MakeDirs(path));
  std::string part = PartName(shard, shards);
  std::string tmp = path + "/" + part + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) return Unavailable(Errno("create " + tmp));
  HashingWriter w(f);
  w.Bytes(kMagic, sizeof(kMagic));
  w.Pod<int64_t>(snap.step);
  w.Pod<double>(snap.learning_rate);
  w.Str(snap.optimizer);
  w.Pod<uint32_t>(static_cast<uint32_t>(snap.variables.size()));
  for (const VariableSnapshot& v : snap.variables) {
    w.Str(v.name);
    w.Pod<uint8_t>(static_cast<uint8_t>(v.dtype));
    w.Pod<uint32_t>(static_cast<uint32_t>(v.shape.size()));
    for (int64_t d : v.shape) w.Pod<int64_t>(d);
    w.Pod<uint8_t>(v.trainable);
    w.Pod<uint8_t>(v.average);
    w.Str(v.optimizer);
    w.Blob(v.value.get());
    w.Pod<uint32_t>(static_cast<uint32_t>(v.slots.size()));
    for (auto& [name, buf] : v.slots) {
      w.Str(name);
      w.Blob(buf.get());
    }
    w.Pod<uint8_t>(v.shadow != nullptr);
    if (v.shadow) w.Blob(v.shadow.get());
    const VarPlacement& p = v.placement;
    w.Pod<uint8_t>(!p.name.empty());
    if (!p.name.empty()) {
      w.Str(p.name);
      w.Pod<uint8_t>(static_cast<uint8_t>(p.dtype));
      w.Pod<uint32_t>(static_cast<uint32_t>(p.shape.size()));
      for (int64_t d : p.shape) w.Pod<int64_t>(d);
      w.Pod<uint8_t>(p.sliced);
      w.Pod<uint32_t>(static_cast<uint32_t>(p.parts.size()));
      for (const SlicePart& part : p.parts) {
        w.Pod<int32_t>(part.shard);
        w.Pod<int64_t>(part.row_begin);
        w.Pod<int64_t>(part.row_end);
      }
    }
    w.Pod<uint8_t>(static_cast<uint8_t>(v.aggregation));
    w.Pod<uint8_t>(v.sync_on_read);
  }
  uint64_t sum = w.hash();
  w.Pod<uint64_t>(sum);  // trailer: the checksum of everything before it
  bool ok = w.ok() && std::fflush(f) == 0 && fsync(fileno(f)) == 0;
  std::fclose(f);
  if (!ok) return Unavailable(Errno("write " + tmp));
  if (std::rename(tmp.c_str(), (path + "/" + part).c_str()) != 0) return Unavailable(Errno("rename " + tmp));
  const uint64_t part_bytes = w.size();
  const uint64_t part_sum = w.hash();  // the whole file, trailer included
  if (shards == 1) {
    PSD_RETURN_IF_ERROR(WriteManifest(dir, snap.step, 1, {{0, part, part_bytes, part_sum}}));
  } else {
    PSD_RETURN_IF_ERROR(FsyncPath(path));
    PSD_RETURN_IF_ERROR(FsyncPath(dir));
  }
  if (keep > 0) {
    // Retention: drop the oldest beyond `keep`.
    std::vector<std::string> names = ListCheckpoints(dir);
    for (size_t i = 0; i + static_cast<size_t>(keep) < names.size(); ++i) {
      std::error_code ec;
      std::filesystem::remove_all(dir + "/" + names[i], ec);
    }
  }
  return CheckpointInfo{snap.step, path, part, part_bytes, part_sum};
}

Status WriteManifest(const std::string& dir, int64_t step, int shards, const std::vector<ManifestPart>& parts) {
  std::string path = dir + "/" + StepDirName(step);
  PSD_RETURN_IF_ERROR(MakeDirs(path));
  std::vector<ManifestPart> sorted = parts;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.shard < b.shard; });
  std::string text = "psd-checkpoint 1\nstep " + std::to_string(step) + "\nshards " + std::to_string(shards) + "\n";
  for (const ManifestPart& p : sorted) {
    text +=
        "part " + std::to_string(p.shard) + " " + p.file + " " + std::to_string(p.bytes) + " " + Hex(p.checksum) + "\n";
  }
  text += "checksum " + Hex(Fnv1a64(text.data(), text.size())) + "\n";
  // A name of its own per process: shards sharing the directory may seal the same step at once.
  std::string mtmp = path + "/MANIFEST.tmp." + std::to_string(getpid());
  int fd = open(mtmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return Unavailable(Errno("create " + mtmp));
  bool wrote = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && fsync(fd) == 0;
  close(fd);
  if (!wrote) return Unavailable(Errno("write " + mtmp));
  if (std::rename(mtmp.c_str(), (path + "/MANIFEST").c_str()) != 0) return Unavailable(Errno("rename " + mtmp));
  PSD_RETURN_IF_ERROR(FsyncPath(path));
  return FsyncPath(dir);
}

namespace {

// Verifies the manifest of `path` and shard `shard`'s part; returns the part's file name.
Result<std::string> VerifyOwnPart(const std::string& path, int shard, int shards) {
  auto m = ReadManifest(path);
  if (!m.ok()) return m.status();
  if (m->shards != shards) {
    return FailedPrecondition("written by a cluster of " + std::to_string(m->shards) + " shard(s), not " +
                              std::to_string(shards));
  }
  auto part = std::find_if(m->parts.begin(), m->parts.end(), [&](const auto& p) { return p.shard == shard; });
  if (part == m->parts.end()) return NotFound("no part for shard " + std::to_string(shard));
  std::vector<uint8_t> data;
  PSD_RETURN_IF_ERROR(ReadFile(path + "/" + part->file, &data));
  if (data.size() != part->bytes) return InvalidArgument(part->file + " has a wrong size");
  if (Fnv1a64(data.data(), data.size()) != part->checksum) return InvalidArgument(part->file + " checksum mismatch");
  return part->file;
}

}  // namespace

std::vector<int64_t> RestorableSteps(const std::string& dir, int shard, int shards) {
  std::vector<int64_t> steps;
  std::vector<std::string> names = ListCheckpoints(dir);
  std::reverse(names.begin(), names.end());
  for (const std::string& n : names) {
    auto ok = VerifyOwnPart(dir + "/" + n, shard, shards);
    if (ok.ok()) {
      steps.push_back(std::strtoll(n.c_str() + 5, nullptr, 10));
    } else if (ok.status().code() != Code::kNotFound) {
      spdlog::warn("checkpoint {}/{} is unusable for shard {}: {}", dir, n, shard, ok.status().message());
    }
  }
  return steps;
}

Status LoadCheckpointAt(const std::string& dir, int64_t step, int shard, ShardSnapshot* out) {
  std::string path = dir + "/" + StepDirName(step);
  auto m = ReadManifest(path);
  if (!m.ok()) return m.status();
  auto file = VerifyOwnPart(path, shard, m->shards);
  if (!file.ok()) return file.status();
  std::vector<uint8_t> data;
  PSD_RETURN_IF_ERROR(ReadFile(path + "/" + *file, &data));
  PSD_RETURN_IF_ERROR(ParsePart(data, out));
  if (out->step != step) return InvalidArgument("part step differs from the manifest's");
  return Status::Ok();
}

Status VerifyCheckpoint(const std::string& path) {
  auto m = ReadManifest(path);
  if (!m.ok()) return m.status();
  for (const auto& p : m->parts) {
    std::vector<uint8_t> data;
    PSD_RETURN_IF_ERROR(ReadFile(path + "/" + p.file, &data));
    if (data.size() != p.bytes)
      return InvalidArgument(p.file + " has " + std::to_string(data.size()) +
                             " bytes, "
                             "the manifest says " +
                             std::to_string(p.bytes));
    if (Fnv1a64(data.data(), data.size()) != p.checksum) return InvalidArgument(p.file + " checksum mismatch");
  }
  return Status::Ok();
}

Result<CheckpointInfo> LoadLatestCheckpoint(const std::string& dir, int shard, ShardSnapshot* out) {
  std::vector<std::string> names = ListCheckpoints(dir);
  std::reverse(names.begin(), names.end());  // newest first
  for (const std::string& n : names) {
    std::string path = dir + "/" + n;
    Status s = VerifyCheckpoint(path);
    auto m = ReadManifest(path);
    if (s.ok() && m.ok()) {
      auto part = std::find_if(m->parts.begin(), m->parts.end(), [&](const auto& p) { return p.shard == shard; });
      if (part == m->parts.end()) {
        s = NotFound("no part for shard " + std::to_string(shard));
      } else {
        std::vector<uint8_t> data;
        s = ReadFile(path + "/" + part->file, &data);
        if (s.ok()) s = ParsePart(data, out);
        if (s.ok() && out->step != m->step) s = InvalidArgument("part step differs from the manifest's");
      }
    }
    if (s.ok()) return CheckpointInfo{out->step, path, {}, 0, 0};
    spdlog::warn("checkpoint {} is unusable ({}); trying an older one", path, s.message());
  }
  return NotFound("no usable checkpoint in " + dir);
}

}  // namespace psd::server
