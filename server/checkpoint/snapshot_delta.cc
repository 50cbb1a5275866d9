// Replication's differences between serialized copies (snapshot_delta.h).
#include "checkpoint/snapshot_delta.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "checkpoint/xxh3.h"

namespace psd::server {

namespace {

constexpr char kDeltaMagic[8] = {'P', 'S', 'D', 'D', 'L', 'T', 'A', '1'};
constexpr uint64_t kDeltaBlock = 256;

void PutU64(std::string* out, uint64_t v) { out->append(reinterpret_cast<const char*>(&v), 8); }

// Reads a delta's fields in order, bounds-checked.
struct DeltaReader {
  const char* p;
  uint64_t left;
  bool U64(uint64_t* v) {
    if (left < 8) return false;
    std::memcpy(v, p, 8);
    p += 8;
    left -= 8;
    return true;
  }
  const char* Take(uint64_t n) {
    if (left < n) return nullptr;
    const char* at = p;
    p += n;
    left -= n;
    return at;
  }
};

// Where `after` may differ from `before` (a tensor at the same place of two copies' payloads), as
// byte ranges of the buffer appended to *spans: nothing when it is the same buffer; the runs its list
// of changes names when it is a copy of `before`'s that lists what was written since (a sparse step's
// rows; each range's start rounded down to `align`); otherwise all of it.
void MayDiffer(const Buffer* before, const Buffer* after, uint64_t align,
               std::vector<std::pair<uint64_t, uint64_t>>* spans) {
  if (before == after) return;
  const uint64_t n = after->bytes();
  if (after->copied_from() == 0 || after->copied_from() != before->id()) {
    spans->emplace_back(0, n);
    return;
  }
  for (const auto& [offset, length] : after->changes()) {
    if (offset < n) spans->emplace_back(offset / align * align, std::min(n, offset + length));
  }
}

// Whether two payloads hold tensors of the same sizes, in order.
bool SameLayout(const std::vector<const Buffer*>& before, const std::vector<const Buffer*>& after) {
  if (before.size() != after.size()) return false;
  for (size_t i = 0; i < after.size(); ++i) {
    if (before[i]->bytes() != after[i]->bytes()) return false;
  }
  return true;
}

}  // namespace

SerializedSnapshot SerializeSnapshotSince(const ShardSnapshot& base, const CopyBlockHashes& base_blocks,
                                          const ShardSnapshot& next) {
  const std::vector<const Buffer*> before = SnapshotPayload(base);
  return SerializeSnapshotInPieces(next, [&](const std::vector<const Buffer*>& after, const PayloadPieces& pieces) {
    if (!SameLayout(before, after) || base_blocks.size() != pieces.blocks()) return pieces.HashAll();
    std::vector<std::pair<uint64_t, uint64_t>> ranges, spans;
    uint64_t at = 0;
    for (size_t i = 0; i < after.size(); at += after[i]->bytes(), ++i) {
      spans.clear();
      MayDiffer(before[i], after[i], 1, &spans);
      for (const auto& [from, to] : spans) ranges.emplace_back(at + from, at + to);
    }
    return RehashChangedBlocks(base_blocks, pieces, ranges);
  });
}

std::string SerializeSnapshotDelta(const ShardSnapshot& base, const SerializedSnapshot& next_pieces, uint64_t base_id_a,
                                   int64_t base_id_b) {
  const std::vector<const Buffer*> before = SnapshotPayload(base);
  const std::vector<const Buffer*>& after = next_pieces.payload;
  if (!SameLayout(before, after)) return {};
  std::vector<uint64_t> starts(after.size() + 1, 0);  // where each buffer starts in the payload
  for (size_t i = 0; i < after.size(); ++i) starts[i + 1] = starts[i] + after[i]->bytes();
  const uint64_t payload = starts.back();
  // Where each buffer may differ, in whole blocks: (buffer, from, to), merged per buffer.
  struct Span {
    size_t buffer;
    uint64_t from, to;
  };
  std::vector<Span> may;
  uint64_t may_bytes = 0;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (size_t i = 0; i < after.size(); ++i) {
    spans.clear();
    MayDiffer(before[i], after[i], kDeltaBlock, &spans);
    std::sort(spans.begin(), spans.end());
    for (const auto& [from, to] : spans) {
      if (!may.empty() && may.back().buffer == i && from <= may.back().to) {
        may_bytes += std::max(may.back().to, to) - may.back().to;
        may.back().to = std::max(may.back().to, to);
      } else {
        may.push_back({i, from, to});
        may_bytes += to - from;
      }
    }
  }
  auto block_differs = [&](const Span& sp, uint64_t off) {
    const uint64_t len = std::min(kDeltaBlock, after[sp.buffer]->bytes() - off);
    return std::memcmp(static_cast<const char*>(before[sp.buffer]->data()) + off,
                       static_cast<const char*>(after[sp.buffer]->data()) + off, len) != 0;
  };
  // A step that rewrote most of what may differ (a dense apply writes a whole tensor into a new
  // buffer) is not worth comparing block by block up to the half where it would be given up: a few
  // evenly spread blocks say so first. (A wrong guess costs bytes on the wire, never a wrong copy.)
  constexpr uint64_t kSamples = 64;
  if (may_bytes * 2 > payload && may_bytes >= kSamples * 64 * kDeltaBlock) {
    uint64_t differ = 0, seen = 0, sample = 0;
    const uint64_t stride = may_bytes / kSamples / kDeltaBlock * kDeltaBlock;
    for (const Span& sp : may) {
      for (; sample < seen + (sp.to - sp.from); sample += stride)
        differ += block_differs(sp, sp.from + (sample - seen));
      seen += sp.to - sp.from;
    }
    // More than 3/4 of the samples: the changed bytes are well past half the payload.
    if (differ * 4 > kSamples * 3 && may_bytes * 3 > payload * 2) return {};
  }
  // The runs of blocks that differ, as (offset in the payload, length); given up past half.
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  uint64_t changed = 0;
  for (const Span& sp : may) {
    const uint64_t at = starts[sp.buffer], n = after[sp.buffer]->bytes();
    for (uint64_t off = sp.from; off < sp.to; off += kDeltaBlock) {
      if (!block_differs(sp, off)) continue;
      const uint64_t len = std::min(kDeltaBlock, n - off);
      if (!runs.empty() && runs.back().first + runs.back().second == at + off) {
        runs.back().second += len;
      } else {
        runs.emplace_back(at + off, len);
      }
      changed += len;
      if (changed * 2 > payload) return {};
    }
  }
  std::string out;
  out.reserve(8 * 8 + next_pieces.head.size() + runs.size() * 16 + changed + 8);
  out.append(kDeltaMagic, 8);
  PutU64(&out, base_id_a);
  PutU64(&out, static_cast<uint64_t>(base_id_b));
  uint64_t sum = 0;
  std::memcpy(&sum, next_pieces.trailer.data(), 8);
  PutU64(&out, next_pieces.bytes);
  PutU64(&out, sum);
  PutU64(&out, next_pieces.head.size());
  out += next_pieces.head;
  PutU64(&out, payload);
  PutU64(&out, runs.size());
  // A run lies in one buffer or spans several: copied from wherever its bytes are.
  size_t buf = 0;
  uint64_t buf_at = 0;  // where after[buf] starts in the payload
  for (const auto& [offset, length] : runs) {
    PutU64(&out, offset);
    PutU64(&out, length);
    for (uint64_t pos = offset, end = offset + length; pos < end;) {
      while (buf_at + after[buf]->bytes() <= pos) buf_at += after[buf++]->bytes();
      const uint64_t take = std::min(end, buf_at + after[buf]->bytes()) - pos;
      out.append(static_cast<const char*>(after[buf]->data()) + (pos - buf_at), take);
      pos += take;
    }
  }
  PutU64(&out, XXH3_64bits(out.data(), out.size()));
  return out;
}

ReplicaCopy SerializeReplicaCopy(const ShardSnapshot& next, const ShardSnapshot* base,
                                 const CopyBlockHashes* base_blocks, uint64_t base_id_a, int64_t base_id_b,
                                 bool audit) {
  ReplicaCopy out;
  if (base != nullptr && base_blocks != nullptr) {
    out.pieces = SerializeSnapshotSince(*base, *base_blocks, next);
    if (audit) {
      SerializedSnapshot hashed = SerializeSnapshotInPieces(next);
      if (hashed.blocks != out.pieces.blocks) {
        out.pieces = std::move(hashed);
        out.unlisted_write = true;
        return out;
      }
    }
  } else {
    out.pieces = SerializeSnapshotInPieces(next);
  }
  if (base != nullptr) out.delta = SerializeSnapshotDelta(*base, out.pieces, base_id_a, base_id_b);
  return out;
}

bool IsSnapshotDelta(const std::string& bytes, uint64_t* base_id_a, int64_t* base_id_b) {
  if (bytes.size() < 24 || std::memcmp(bytes.data(), kDeltaMagic, 8) != 0) return false;
  std::memcpy(base_id_a, bytes.data() + 8, 8);
  std::memcpy(base_id_b, bytes.data() + 16, 8);
  return true;
}

namespace {

// A delta's fields, checked: its checksum, its sizes, and every run inside the payload.
struct ParsedDelta {
  uint64_t full = 0, full_sum = 0, payload = 0;
  const char* head = nullptr;
  uint64_t head_size = 0;
  struct Run {
    uint64_t offset;  // in the payload
    uint64_t length;
    const char* data;
  };
  std::vector<Run> runs;
};

Status ParseDelta(const std::string& delta, ParsedDelta* d) {
  auto bad = [](const std::string& why) { return InvalidArgument("a copy's delta is malformed: " + why); };
  if (delta.size() < 8 * 8 + 8 || std::memcmp(delta.data(), kDeltaMagic, 8) != 0) return bad("too short");
  const uint64_t body = delta.size() - 8;
  uint64_t sum = 0;
  std::memcpy(&sum, delta.data() + body, 8);
  if (XXH3_64bits(delta.data(), body) != sum) return bad("checksum mismatch");
  DeltaReader r{delta.data() + 24, body - 24};
  uint64_t runs = 0;
  if (!r.U64(&d->full) || !r.U64(&d->full_sum) || !r.U64(&d->head_size)) return bad("cut short");
  d->head = r.Take(d->head_size);
  if (d->head == nullptr || !r.U64(&d->payload) || !r.U64(&runs)) return bad("cut short");
  if (d->head_size < 16 || d->full != d->head_size + d->payload + 8) return bad("its sizes do not add up");
  for (uint64_t i = 0; i < runs; ++i) {
    uint64_t offset = 0, length = 0;
    if (!r.U64(&offset) || !r.U64(&length)) return bad("cut short");
    const char* data = r.Take(length);
    if (data == nullptr || offset > d->payload || length > d->payload - offset) return bad("a run outside the payload");
    d->runs.push_back({offset, length, data});
  }
  if (r.left != 0) return bad("trailing bytes");
  return Status::Ok();
}

// Writes `d`'s runs over a payload that starts at `payload`.
void ApplyRuns(const ParsedDelta& d, char* payload) {
  for (const ParsedDelta::Run& run : d.runs) std::memcpy(payload + run.offset, run.data, run.length);
}

// *out (head, payload) finished as the copy `parsed.back()` describes: its checksum, then verified.
// `from_blocks` (if given): the block hashes of the payload the deltas' runs were written over
// (only the blocks they wrote are hashed anew); *blocks (if given): the result's.
Status FinishRebuilt(const std::vector<ParsedDelta>& parsed, const CopyBlockHashes* from_blocks, std::string* out,
                     int64_t* step, CopyBlockHashes* blocks) {
  const ParsedDelta& d = parsed.back();
  PutU64(out, d.full_sum);
  PayloadPieces payload;
  payload.Add(out->data() + d.head_size, d.payload);
  CopyBlockHashes hashed;
  if (from_blocks != nullptr && from_blocks->size() == payload.blocks()) {
    std::vector<std::pair<uint64_t, uint64_t>> written;
    for (const ParsedDelta& one : parsed) {
      for (const ParsedDelta::Run& run : one.runs) written.emplace_back(run.offset, run.offset + run.length);
    }
    hashed = RehashChangedBlocks(*from_blocks, payload, written);
  } else {
    hashed = payload.HashAll();
  }
  Status s = VerifySerializedSnapshotBlocks(*out, hashed, step);
  if (!s.ok()) return InvalidArgument("a copy rebuilt from its delta does not match its owner's: " + s.message());
  if (blocks != nullptr) *blocks = std::move(hashed);
  return Status::Ok();
}

}  // namespace

Status ApplySnapshotDelta(const std::string& base, const std::string& delta, std::string* out, int64_t* step,
                          const CopyBlockHashes* base_blocks, CopyBlockHashes* blocks) {
  std::vector<ParsedDelta> parsed(1);
  PSD_RETURN_IF_ERROR(ParseDelta(delta, &parsed[0]));
  const ParsedDelta& d = parsed[0];
  // The base's payload. (The base was verified when it was kept; what is rebuilt is verified below.)
  uint64_t base_head = 0, base_payload = 0;
  PSD_RETURN_IF_ERROR(SerializedPayload(base, &base_head, &base_payload));
  if (base_payload != d.payload) {
    return InvalidArgument("a copy's delta is of another base's layout (its payload: " + std::to_string(d.payload) +
                           " bytes; the base's: " + std::to_string(base_payload) + ")");
  }
  std::string rebuilt = std::move(*out);  // its storage: a copy of the same size needs no new pages
  rebuilt.clear();
  rebuilt.reserve(d.full);
  rebuilt.append(d.head, d.head_size);
  rebuilt.append(base, base_head, d.payload);
  ApplyRuns(d, rebuilt.data() + d.head_size);
  PSD_RETURN_IF_ERROR(FinishRebuilt(parsed, base_blocks, &rebuilt, step, blocks));
  *out = std::move(rebuilt);
  return Status::Ok();
}

Status ReplaySnapshotDeltas(const std::vector<const std::string*>& deltas, std::string* copy, int64_t* step,
                            const CopyBlockHashes* copy_blocks, CopyBlockHashes* blocks) {
  if (deltas.empty()) return InvalidArgument("no delta to replay");
  std::vector<ParsedDelta> parsed(deltas.size());
  for (size_t i = 0; i < deltas.size(); ++i) PSD_RETURN_IF_ERROR(ParseDelta(*deltas[i], &parsed[i]));
  uint64_t head = 0, payload = 0;
  PSD_RETURN_IF_ERROR(SerializedPayload(*copy, &head, &payload));
  const ParsedDelta& last = parsed.back();
  // In place only when the payload stays where it is and keeps its size all along.
  for (const ParsedDelta& d : parsed) {
    if (d.payload != payload) return FailedPrecondition("the deltas change the copy's layout");
  }
  if (last.head_size != head) return FailedPrecondition("the deltas change the copy's layout");
  for (const ParsedDelta& d : parsed) ApplyRuns(d, copy->data() + head);
  std::memcpy(copy->data(), last.head, head);
  copy->resize(head + payload);
  return FinishRebuilt(parsed, copy_blocks, copy, step, blocks);
}

}  // namespace psd::server
