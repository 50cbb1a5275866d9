#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <limits.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <sstream>
#include <system_error>
#include <thread>
#include <utility>

#include "base/mutex.h"
#include "base/scope_exit.h"
#include "checkpoint/part_records.h"
#include "checkpoint/xxh3.h"
#include "psd/cores.h"
#include "psd/half.h"

namespace psd::server {
namespace {

constexpr char kMagicV1[8] = {'P', 'S', 'D', 'C', 'K', 'P', 'T', '1'};
constexpr char kMagicV2[8] = {'P', 'S', 'D', 'C', 'K', 'P', 'T', '2'};  // v2: + placement
constexpr char kMagicV3[8] = {'P', 'S', 'D', 'C', 'K', 'P', 'T', '3'};  // v3: + aggregation, sync-on-read
constexpr char kMagic[8] = {'P', 'S', 'D', 'C', 'K', 'P', 'T', '4'};    // v4: records first, XXH3 blocks

// v4 parts are written and read in blocks of this many bytes, one block per task.
constexpr uint64_t kBlockBytes = 4ull << 20;
// Threads writing or reading one part (the caller's among them).
constexpr unsigned kMaxIoThreads = 4;

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

// A file descriptor closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// --- v4 layout ---------------------------------------------------------------------------------
//   "PSDCKPT4" | u64 R | the records (R bytes) | the payload | u64 checksum (the trailer)
// The records are v3's with every tensor written as its byte count only; the payload is those
// tensors' bytes, in the order the records name them. The body (everything before the trailer)
// is hashed in kBlockBytes blocks: the checksum is XXH3-64 (seed: the body's size) of the blocks'
// XXH3-64 hashes, so blocks are written, read and verified in parallel, each while it is moved.

// Where a stretch of the file lives in memory.
struct Segment {
  uint64_t offset;  // in the file
  uint8_t* data;    // read: filled; write: only read
  uint64_t bytes;
};

// Moves file bytes [begin, end) to (read) or from (write) the segments that hold them with
// preadv/pwritev, hashing them as they pass. `segs` is sorted by offset and covers the range;
// empty (read only): the bytes go through `scratch` (kBlockBytes) and are only hashed.
Status TransferBlock(int fd, bool write, const std::vector<Segment>& segs, uint64_t begin, uint64_t end, uint64_t* hash,
                     uint8_t* scratch) {
  if (segs.empty()) return TransferBlock(fd, write, {{begin, scratch, end - begin}}, begin, end, hash, nullptr);
  auto it =
      std::upper_bound(segs.begin(), segs.end(), begin, [](uint64_t off, const Segment& s) { return off < s.offset; });
  --it;  // the segment holding `begin`
  std::vector<iovec> iov;
  for (auto s = it; s != segs.end() && s->offset < end; ++s) {
    uint64_t a = std::max(begin, s->offset), b = std::min(end, s->offset + s->bytes);
    if (b > a) iov.push_back({s->data + (a - s->offset), static_cast<size_t>(b - a)});
  }
  // Transfer, resuming after short transfers.
  size_t first = 0;
  uint64_t pos = begin;
  while (first < iov.size()) {
    int count = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    ssize_t n = write ? pwritev(fd, iov.data() + first, count, static_cast<off_t>(pos))
                      : preadv(fd, iov.data() + first, count, static_cast<off_t>(pos));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Unavailable(Errno(write ? "write" : "read"));
    if (n == 0) return InvalidArgument("the file is shorter than its records say");
    pos += static_cast<uint64_t>(n);
    size_t left = static_cast<size_t>(n);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  // Hash the block (hot in cache: it was just copied).
  XXH3_state_t* st = XXH3_createState();
  if (st == nullptr) return ResourceExhausted("out of memory hashing a checkpoint block");
  XXH3_64bits_reset(st);
  for (auto s = it; s != segs.end() && s->offset < end; ++s) {
    uint64_t a = std::max(begin, s->offset), b = std::min(end, s->offset + s->bytes);
    if (b > a) XXH3_64bits_update(st, s->data + (a - s->offset), static_cast<size_t>(b - a));
  }
  *hash = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  if (write) {
    // Start the disk write of this block now, so the final fsync has little left to wait for.
    sync_file_range(fd, static_cast<off_t>(begin), static_cast<off_t>(end - begin), SYNC_FILE_RANGE_WRITE);
  }
  return Status::Ok();
}

// Transfers the body [0, body_bytes) block by block on up to kMaxIoThreads threads; returns the
// v4 checksum of the body.
Result<uint64_t> TransferBody(int fd, bool write, const std::vector<Segment>& segs, uint64_t body_bytes) {
  const uint64_t blocks = (body_bytes + kBlockBytes - 1) / kBlockBytes;
  std::vector<uint64_t> hashes(blocks);
  std::atomic<uint64_t> next{0};
  Mutex mu;
  Status first_error;  // guarded by mu while the helpers run (a local cannot be annotated)
  auto work = [&] {
    std::unique_ptr<uint8_t[]> scratch;
    if (segs.empty()) scratch = std::make_unique_for_overwrite<uint8_t[]>(kBlockBytes);
    for (uint64_t b = next.fetch_add(1); b < blocks; b = next.fetch_add(1)) {
      Status s = TransferBlock(fd, write, segs, b * kBlockBytes, std::min(body_bytes, (b + 1) * kBlockBytes),
                               &hashes[b], scratch.get());
      if (!s.ok()) {
        MutexLock lock(&mu);
        if (first_error.ok()) first_error = s;
        next = blocks;  // the others stop at their next block
      }
    }
  };
  // Writes copy into the page cache (CPU-bound: one thread per core); reads also wait on the disk,
  // so they keep kMaxIoThreads requests in flight whatever the core count.
  const auto hw = static_cast<unsigned>(UsableCores());
  const unsigned threads =
      static_cast<unsigned>(std::min<uint64_t>({kMaxIoThreads, write ? hw : kMaxIoThreads, blocks}));
  std::vector<std::thread> helpers;
  for (unsigned i = 1; i < threads; ++i) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // fewer threads: the work still gets done
    }
  }
  work();
  for (auto& t : helpers) t.join();
  if (!first_error.ok()) return first_error;
  return XXH3_64bits_withSeed(hashes.data(), hashes.size() * sizeof(uint64_t), body_bytes);
}

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

// Retention: the newest `keep` step directories with a MANIFEST (complete, or sealed by a
// cluster's chief) stay, and whatever is older than the oldest of them goes. Directories without
// one (a cluster's parts not sealed yet, a write cut off) never push a complete checkpoint out:
// newer ones stay, at most `keep` of them (the oldest unsealed go first). Fewer than `keep`
// complete ones: nothing older is removed.
void PruneCheckpoints(const std::string& dir, int keep) {
  std::vector<std::string> names = ListCheckpoints(dir);
  std::vector<bool> complete(names.size());
  size_t complete_count = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    std::error_code ec;
    complete[i] = std::filesystem::exists(dir + "/" + names[i] + "/MANIFEST", ec);
    complete_count += complete[i] ? 1 : 0;
  }
  auto remove = [&](size_t i) {
    std::error_code ec;
    std::filesystem::remove_all(dir + "/" + names[i], ec);
  };
  size_t first_kept = 0;  // the oldest of the newest `keep` complete ones
  if (complete_count >= static_cast<size_t>(keep)) {
    size_t seen = 0;
    for (size_t i = names.size(); i-- > 0;) {
      if (complete[i] && ++seen == static_cast<size_t>(keep)) {
        first_kept = i;
        break;
      }
    }
    for (size_t i = 0; i < first_kept; ++i) remove(i);
  }
  size_t unsealed = 0;
  for (size_t i = names.size(); i-- > first_kept;) {
    if (!complete[i] && ++unsealed > static_cast<size_t>(keep)) remove(i);
  }
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

// A regular file of at most `max_bytes`, read whole. Anything else in its place (a directory, a
// FIFO, a file a damaged disk or a hand grew huge) is an error, not a hang or an allocation that
// kills the daemon at start.
Status ReadFile(const std::string& path, uint64_t max_bytes, std::vector<uint8_t>* out) {
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));  // (a FIFO would block the open)
  if (fd.get() < 0) return NotFound(Errno("cannot open " + path));
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return Unavailable(Errno("stat " + path));
  if (!S_ISREG(st.st_mode)) return InvalidArgument(path + " is not a regular file");
  const auto n = static_cast<uint64_t>(st.st_size);
  if (n > max_bytes) {
    return InvalidArgument(path + " has " + std::to_string(n) + " bytes, more than the " + std::to_string(max_bytes) +
                           " it may have");
  }
  try {
    out->resize(n);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("no memory to read " + path + " (" + std::to_string(n) + " bytes)");
  }
  for (uint64_t done = 0; done < n;) {
    const ssize_t got = read(fd.get(), out->data() + done, n - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return Unavailable(Errno("cannot read " + path));
    if (got == 0) {
      return Unavailable(path + " ended after " + std::to_string(done) + " of " + std::to_string(n) + " bytes");
    }
    done += static_cast<uint64_t>(got);
  }
  return Status::Ok();
}

// How a manifest checksums itself and its parts: version 1 (parts v1-v3) FNV-1a 64 over whole
// files; version 2 (parts v4) names its algorithm, "hash xxh3-64": XXH3-64 for its own text and
// the v4 block checksum (== the part's trailer) for each part.
enum class HashAlgo { kFnv1a64, kXxh3Blocks };

constexpr char kXxh3Name[] = "xxh3-64";

struct Manifest {
  int64_t step = -1;
  int shards = 0;
  HashAlgo hash = HashAlgo::kFnv1a64;
  struct Part {
    int shard;
    std::string file;
    uint64_t bytes;
    uint64_t checksum;
  };
  std::vector<Part> parts;
};

// A manifest is a line per part; far more than any cluster's fits here.
constexpr uint64_t kMaxManifestBytes = 16 << 20;

Result<Manifest> ReadManifest(const std::string& path) {
  std::vector<uint8_t> raw;
  PSD_RETURN_IF_ERROR(ReadFile(path + "/MANIFEST", kMaxManifestBytes, &raw));
  std::string text(raw.begin(), raw.end());
  size_t last = text.rfind("checksum ");
  if (last == std::string::npos) return InvalidArgument("manifest has no checksum line");
  uint64_t want = std::strtoull(text.c_str() + last + 9, nullptr, 16);
  Manifest m;
  std::istringstream in(text.substr(0, last));
  std::string word;
  in >> word;
  int version = 0;
  in >> version;
  if (word != "psd-checkpoint" || (version != 1 && version != 2)) {
    return InvalidArgument("not a psd checkpoint manifest (versions 1 and 2 are known): a newer psd wrote it?");
  }
  if (version == 2) {
    std::string algo;
    in >> word >> algo;
    if (word != "hash") return InvalidArgument("manifest version 2 has no hash line");
    if (algo != kXxh3Name) {
      return InvalidArgument("manifest uses checksum '" + algo +
                             "', which this psd does not know: a newer psd wrote it?");
    }
    m.hash = HashAlgo::kXxh3Blocks;
  }
  const uint64_t got = m.hash == HashAlgo::kXxh3Blocks ? XXH3_64bits(text.data(), last) : Fnv1a64(text.data(), last);
  if (got != want) return InvalidArgument("manifest checksum mismatch");
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

// A v1-v3 part (tensors inline, FNV-1a trailer), already read whole.
Status ParseOldPart(const std::vector<uint8_t>& data, ShardSnapshot* out) {
  if (data.size() < sizeof(kMagic) + 8) return BadPart("too short");
  uint64_t trailer = 0;
  std::memcpy(&trailer, data.data() + data.size() - 8, 8);
  if (Fnv1a64(data.data(), data.size() - 8) != trailer) return BadPart("checksum mismatch");
  int version = 0;
  if (std::memcmp(data.data(), kMagicV1, 8) == 0) version = 1;
  if (std::memcmp(data.data(), kMagicV2, 8) == 0) version = 2;
  if (std::memcmp(data.data(), kMagicV3, 8) == 0) version = 3;
  if (version == 0) return BadPart("bad magic");
  const size_t body = data.size() - 8 - sizeof(kMagic);
  RecordReader r(data.data() + sizeof(kMagic), body, /*inline_blobs=*/true);
  PSD_RETURN_IF_ERROR(ParseRecords(r, version, out));
  if (r.pos() != body) return BadPart("trailing bytes");
  return Status::Ok();
}

Status PreadAll(int fd, void* out, size_t n, uint64_t offset) {
  uint8_t* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    ssize_t got = pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return Unavailable(Errno("read"));
    if (got == 0) return InvalidArgument("the file is shorter than its records say");
    p += got;
    n -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return Status::Ok();
}

// Reads a v4 part (`bytes` long) from `fd`, verifying it against its trailer and `checksum`
// while it is read; parses it into *out, or only verifies it when out is null.
Status ReadV4Part(int fd, uint64_t bytes, uint64_t checksum, ShardSnapshot* out) {
  uint8_t header[16];
  if (bytes < sizeof(header) + 8) return BadPart("too short");
  PSD_RETURN_IF_ERROR(PreadAll(fd, header, sizeof(header), 0));
  if (std::memcmp(header, kMagic, 8) != 0) return BadPart("bad magic (not a version 4 part)");
  uint64_t records_bytes = 0;
  std::memcpy(&records_bytes, header + 8, 8);
  const uint64_t body = bytes - 8;
  if (records_bytes > body - sizeof(header)) return BadPart("records larger than the file");
  std::vector<Segment> segs;
  std::vector<uint8_t> records;  // only to parse them: verifying reads the file through TransferBody
  ShardSnapshot snap;
  if (out != nullptr) {
    // The records first (small; read again below, hashed with their block), then the payload
    // goes straight into the tensors they describe. Their size is not checked yet (the checksum
    // comes with the whole part): a damaged one fails here, not the process.
    try {
      records.resize(static_cast<size_t>(sizeof(header) + records_bytes));
    } catch (const std::bad_alloc&) {
      return BadPart("records of " + std::to_string(records_bytes) + " bytes (damaged?) do not fit in memory");
    }
    PSD_RETURN_IF_ERROR(PreadAll(fd, records.data(), records.size(), 0));
    RecordReader r(records.data() + sizeof(header), records_bytes, /*inline_blobs=*/false,
                   body - sizeof(header) - records_bytes);
    PSD_RETURN_IF_ERROR(ParseRecords(r, 4, &snap));
    if (r.pos() != records_bytes) return BadPart("trailing bytes in the records");
    if (r.payload_left() != 0) return BadPart("the file holds more than its records name");
    segs.push_back({0, records.data(), records.size()});
    uint64_t off = records.size();
    for (const auto& b : r.payload()) {
      segs.push_back({off, static_cast<uint8_t*>(b->data()), b->bytes()});
      off += b->bytes();
    }
  }
  auto sum = TransferBody(fd, /*write=*/false, segs, body);
  if (!sum.ok()) return sum.status();
  uint64_t trailer = 0;
  PSD_RETURN_IF_ERROR(PreadAll(fd, &trailer, sizeof(trailer), body));
  if (*sum != trailer) return BadPart("checksum mismatch (the part's trailer)");
  if (*sum != checksum) return InvalidArgument("checksum mismatch (the manifest's)");
  if (out != nullptr) *out = std::move(snap);
  return Status::Ok();
}

// Reads part `p` of checkpoint `path` as manifest `m` records it: checks its size, verifies its
// checksum while it is read, and parses it into *out (null: verify only).
Status ReadPart(const std::string& path, const Manifest& m, const Manifest::Part& p, ShardSnapshot* out) {
  const std::string file = path + "/" + p.file;
  if (m.hash == HashAlgo::kFnv1a64) {
    // v1-v3: read whole, FNV-1a over the file.
    std::vector<uint8_t> data;  // (no bigger than the manifest says: checked before it is read)
    PSD_RETURN_IF_ERROR(ReadFile(file, p.bytes, &data));
    if (data.size() != p.bytes) {
      return InvalidArgument(p.file + " has " + std::to_string(data.size()) + " bytes, the manifest says " +
                             std::to_string(p.bytes));
    }
    if (Fnv1a64(data.data(), data.size()) != p.checksum) return InvalidArgument(p.file + " checksum mismatch");
    return out != nullptr ? ParseOldPart(data, out) : Status::Ok();
  }
  Fd fd(open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));  // (a FIFO would block the open)
  if (fd.get() < 0) return NotFound(Errno("cannot open " + file));
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return Unavailable(Errno("stat " + file));
  if (!S_ISREG(st.st_mode)) return InvalidArgument(p.file + " is not a regular file");
  if (static_cast<uint64_t>(st.st_size) != p.bytes) {
    return InvalidArgument(p.file + " has " + std::to_string(st.st_size) + " bytes, the manifest says " +
                           std::to_string(p.bytes));
  }
  posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  Status s = ReadV4Part(fd.get(), p.bytes, p.checksum, out);
  if (!s.ok()) return Status(s.code(), p.file + ": " + s.message());
  return Status::Ok();
}

const Manifest::Part* FindPart(const Manifest& m, int shard) {
  auto it = std::find_if(m.parts.begin(), m.parts.end(), [&](const auto& p) { return p.shard == shard; });
  return it == m.parts.end() ? nullptr : &*it;
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
  RecordWriter w;
  WriteRecords(snap, &w);
  // The file: magic, records size, records, payload, trailer.
  uint8_t header[16];
  std::memcpy(header, kMagic, 8);
  const uint64_t records_bytes = w.records().size();
  std::memcpy(header + 8, &records_bytes, 8);
  std::vector<Segment> segs;
  segs.push_back({0, header, sizeof(header)});
  segs.push_back({sizeof(header), reinterpret_cast<uint8_t*>(const_cast<char*>(w.records().data())), records_bytes});
  uint64_t off = sizeof(header) + records_bytes;
  for (const Buffer* b : w.payload()) {
    segs.push_back({off, static_cast<uint8_t*>(const_cast<void*>(b->data())), b->bytes()});
    off += b->bytes();
  }
  const uint64_t body = off;
  Fd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Unavailable(Errno("create " + tmp));
  // A write that fails leaves no temporary behind (its space preallocated below).
  ScopeExit cleanup([&tmp] { ::unlink(tmp.c_str()); });
  // Reserve the space up front: parallel writers then fill one contiguous extent, and a full disk
  // fails here rather than midway.
  if (int rc = posix_fallocate(fd.get(), 0, static_cast<off_t>(body + 8)); rc != 0 && rc != EOPNOTSUPP) {
    errno = rc;
    return Unavailable(Errno("allocate " + std::to_string(body + 8) + " bytes for " + tmp));
  }
  auto sum = TransferBody(fd.get(), /*write=*/true, segs, body);
  if (!sum.ok()) return Status(sum.status().code(), tmp + ": " + sum.status().message());
  const uint64_t trailer = *sum;  // the checksum of everything before it
  bool ok =
      pwrite(fd.get(), &trailer, sizeof(trailer), static_cast<off_t>(body)) == sizeof(trailer) && fsync(fd.get()) == 0;
  if (!ok) return Unavailable(Errno("write " + tmp));
  if (close(fd.Release()) != 0) return Unavailable(Errno("close " + tmp));
  // The step written again (an operator's request with no step between, a cluster counting up
  // through a step it sealed before): its manifest goes first, durably, so that no crash leaves
  // the old manifest beside the new part — a checkpoint that verifies nowhere yet counts as
  // complete. Until the new manifest, the step is unsealed (not restored, not counted).
  if (::unlink((path + "/MANIFEST").c_str()) == 0) PSD_RETURN_IF_ERROR(FsyncPath(path));
  if (std::rename(tmp.c_str(), (path + "/" + part).c_str()) != 0) return Unavailable(Errno("rename " + tmp));
  cleanup.Dismiss();
  const uint64_t part_bytes = body + sizeof(trailer);
  const uint64_t part_sum = trailer;  // v4: what the manifest records is the trailer's checksum
  if (shards == 1) {
    PSD_RETURN_IF_ERROR(FsyncPath(path));  // the part's rename is durable before the manifest names it
    PSD_RETURN_IF_ERROR(WriteManifest(dir, snap.step, 1, {{0, part, part_bytes, part_sum}}));
  } else {
    PSD_RETURN_IF_ERROR(FsyncPath(path));
    PSD_RETURN_IF_ERROR(FsyncPath(dir));
  }
  if (keep > 0) PruneCheckpoints(dir, keep);
  return CheckpointInfo{snap.step, path, part, part_bytes, part_sum};
}

Status WriteManifest(const std::string& dir, int64_t step, int shards, const std::vector<ManifestPart>& parts) {
  std::string path = dir + "/" + StepDirName(step);
  PSD_RETURN_IF_ERROR(MakeDirs(path));
  std::vector<ManifestPart> sorted = parts;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.shard < b.shard; });
  std::string text = std::string("psd-checkpoint 2\nhash ") + kXxh3Name + "\nstep " + std::to_string(step) +
                     "\nshards " + std::to_string(shards) + "\n";
  for (const ManifestPart& p : sorted) {
    text +=
        "part " + std::to_string(p.shard) + " " + p.file + " " + std::to_string(p.bytes) + " " + Hex(p.checksum) + "\n";
  }
  text += "checksum " + Hex(XXH3_64bits(text.data(), text.size())) + "\n";
  // A name of its own per process: shards sharing the directory may seal the same step at once.
  PSD_RETURN_IF_ERROR(WriteFileDurably(path + "/MANIFEST", path + "/MANIFEST.tmp." + std::to_string(getpid()), text));
  return FsyncPath(dir);
}

Status WriteFileDurably(const std::string& path, const std::string& tmp, const std::string& text) {
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Unavailable(Errno("create " + tmp));
  bool wrote = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && fsync(fd) == 0;
  close(fd);
  if (!wrote) return Unavailable(Errno("write " + tmp));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return Unavailable(Errno("rename " + tmp));
  return FsyncPath(std::filesystem::path(path).parent_path().string());
}

namespace {

// The manifest of checkpoint directory `path`, which must be of the step the directory is named
// for and name each shard's part as psd does: a directory copied or renamed by hand is refused,
// not restored as another step's (or another shard's part taken as this one's).
Result<Manifest> ReadOwnManifest(const std::string& path) {
  auto m = ReadManifest(path);
  if (!m.ok()) return m.status();
  const std::string name = std::filesystem::path(path).filename().string();
  if (name != StepDirName(m->step)) {
    return InvalidArgument("its manifest is of step " + std::to_string(m->step) + ", not of " + name);
  }
  for (const Manifest::Part& p : m->parts) {
    if (p.file != PartName(p.shard, m->shards)) {
      return InvalidArgument("its manifest names " + p.file + " as shard " + std::to_string(p.shard) + "'s part");
    }
  }
  return m;
}

// Verifies the manifest of `path` and shard `shard`'s part.
Status VerifyOwnPart(const std::string& path, int shard, int shards) {
  auto m = ReadOwnManifest(path);
  if (!m.ok()) return m.status();
  if (m->shards != shards) {
    return FailedPrecondition("written by a cluster of " + std::to_string(m->shards) + " shard(s), not " +
                              std::to_string(shards));
  }
  const Manifest::Part* part = FindPart(*m, shard);
  if (part == nullptr) return NotFound("no part for shard " + std::to_string(shard));
  Status s = ReadPart(path, *m, *part, nullptr);
  // A part the manifest names but that is gone is damage, not "not this shard's".
  if (s.code() == Code::kNotFound) return InvalidArgument(s.message());
  return s;
}

// Loads shard `shard`'s part of checkpoint `path`: the manifest verifies, and the part is read
// once, verified while it is read.
Status LoadPart(const std::string& path, int shard, ShardSnapshot* out) {
  auto m = ReadOwnManifest(path);
  if (!m.ok()) return m.status();
  const Manifest::Part* part = FindPart(*m, shard);
  if (part == nullptr) return NotFound("no part for shard " + std::to_string(shard));
  ShardSnapshot snap;
  PSD_RETURN_IF_ERROR(ReadPart(path, *m, *part, &snap));
  if (snap.step != m->step) return InvalidArgument("part step differs from the manifest's");
  *out = std::move(snap);
  return Status::Ok();
}

}  // namespace

Status SealOwnPart(const std::string& dir, int64_t step, int shard, int shards,
                   const std::vector<ManifestPart>& parts) {
  Manifest m;
  m.step = step;
  m.shards = shards;
  m.hash = HashAlgo::kXxh3Blocks;  // what WriteManifest records
  for (const ManifestPart& p : parts) m.parts.push_back({p.shard, p.file, p.bytes, p.checksum});
  const Manifest::Part* own = FindPart(m, shard);
  if (own == nullptr)
    return FailedPrecondition("the seal of step " + std::to_string(step) + " has no part for shard " +
                              std::to_string(shard));
  Status s = ReadPart(dir + "/" + StepDirName(step), m, *own, nullptr);
  if (!s.ok()) {
    return FailedPrecondition("this shard's part of checkpoint step " + std::to_string(step) +
                              " does not match the chief's seal: " + s.message());
  }
  return WriteManifest(dir, step, shards, parts);
}

std::vector<int64_t> RestorableSteps(const std::string& dir, int shard, int shards, std::vector<int64_t>* unusable,
                                     std::map<int64_t, std::vector<ManifestPart>>* manifests) {
  std::vector<int64_t> steps;
  std::vector<std::string> names = ListCheckpoints(dir);
  std::reverse(names.begin(), names.end());
  for (const std::string& n : names) {
    Status ok = VerifyOwnPart(dir + "/" + n, shard, shards);
    int64_t step = std::strtoll(n.c_str() + 5, nullptr, 10);
    if (ok.ok()) {
      steps.push_back(step);
      if (manifests == nullptr) continue;
      auto m = ReadManifest(dir + "/" + n);  // verified just now
      if (!m.ok()) continue;
      auto& parts = (*manifests)[step];
      for (const Manifest::Part& p : m->parts) parts.push_back({p.shard, p.file, p.bytes, p.checksum});
      continue;
    }
    if (unusable != nullptr) unusable->push_back(step);
    if (ok.code() != Code::kNotFound) {
      spdlog::warn("checkpoint {}/{} is unusable for shard {}: {}", dir, n, shard, ok.message());
    }
  }
  return steps;
}

Result<ManifestPart> PeekOwnPart(const std::string& dir, int64_t step, int shard, int shards) {
  const std::string file = PartName(shard, shards);
  const std::string path = dir + "/" + StepDirName(step) + "/" + file;
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return NotFound(Errno("cannot open " + path));
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return Unavailable(Errno("stat " + path));
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  uint8_t header[8];
  if (bytes < 16 + 8) return InvalidArgument(path + ": too short for a part");
  PSD_RETURN_IF_ERROR(PreadAll(fd.get(), header, sizeof(header), 0));
  if (std::memcmp(header, kMagic, 8) != 0) return InvalidArgument(path + ": not a version 4 part");
  uint64_t trailer = 0;
  PSD_RETURN_IF_ERROR(PreadAll(fd.get(), &trailer, sizeof(trailer), bytes - sizeof(trailer)));
  return ManifestPart{shard, file, bytes, trailer};
}

Status LoadCheckpointAt(const std::string& dir, int64_t step, int shard, ShardSnapshot* out) {
  return LoadPart(dir + "/" + StepDirName(step), shard, out);
}

Status VerifyCheckpoint(const std::string& path) {
  auto m = ReadManifest(path);
  if (!m.ok()) return m.status();
  for (const auto& p : m->parts) PSD_RETURN_IF_ERROR(ReadPart(path, *m, p, nullptr));
  return Status::Ok();
}

Result<CheckpointInfo> LoadLatestCheckpoint(const std::string& dir, int shard, ShardSnapshot* out) {
  std::vector<std::string> names = ListCheckpoints(dir);
  std::reverse(names.begin(), names.end());  // newest first
  for (const std::string& n : names) {
    std::string path = dir + "/" + n;
    // Every other shard's part verifies (a checkpoint is whole or unused); this shard's is
    // verified while it is loaded.
    auto m = ReadManifest(path);
    Status s = m.status();
    if (s.ok() && m->shards != 1) {
      // A cluster's checkpoint (the directory was shared): one shard's part would be half a model.
      s = FailedPrecondition("written by a cluster of " + std::to_string(m->shards) +
                             " shards; a single psd restores only a single psd's checkpoints");
    }
    for (size_t i = 0; s.ok() && i < m->parts.size(); ++i) {
      if (m->parts[i].shard != shard) s = ReadPart(path, *m, m->parts[i], nullptr);
    }
    if (s.ok()) s = LoadPart(path, shard, out);
    if (s.ok()) return CheckpointInfo{out->step, path, {}, 0, 0};
    spdlog::warn("checkpoint {} is unusable ({}); trying an older one", path, s.message());
  }
  return NotFound("no usable checkpoint in " + dir);
}

}  // namespace psd::server
