#include "checkpoint/serialized_copy.h"

#include <cstring>
#include <string>
#include <utility>

#include "checkpoint/part_records.h"

namespace psd::server {
namespace {

// A serialized copy: a v4 part's records and payload after this magic, the copy checksum last.
constexpr char kCopyMagic[8] = {'P', 'S', 'D', 'C', 'O', 'P', 'Y', '1'};

}  // namespace

SerializedSnapshot SerializeSnapshotInPieces(const ShardSnapshot& snap, const HashPayloadBlocks& hash_blocks) {
  RecordWriter w;
  WriteRecords(snap, &w);
  const uint64_t records_bytes = w.records().size();
  SerializedSnapshot out;
  out.head.reserve(16 + records_bytes);
  out.head.append(kCopyMagic, 8);
  out.head.append(reinterpret_cast<const char*>(&records_bytes), 8);
  out.head += w.records();
  out.payload = w.payload();
  PayloadPieces pieces;
  for (const Buffer* b : out.payload) pieces.Add(b->data(), b->bytes());
  out.blocks = hash_blocks(out.payload, pieces);
  const uint64_t sum = CopyChecksum(out.head, out.blocks, out.head.size() + pieces.bytes());
  out.trailer.assign(reinterpret_cast<const char*>(&sum), 8);
  out.bytes = out.head.size() + w.payload_bytes() + out.trailer.size();
  return out;
}

SerializedSnapshot SerializeSnapshotInPieces(const ShardSnapshot& snap) {
  return SerializeSnapshotInPieces(
      snap, [](const std::vector<const Buffer*>&, const PayloadPieces& pieces) { return pieces.HashAll(); });
}

std::string SerializeSnapshot(const ShardSnapshot& snap) {
  SerializedSnapshot pieces = SerializeSnapshotInPieces(snap);
  std::string out;
  out.reserve(pieces.bytes);
  out += pieces.head;
  for (const Buffer* b : pieces.payload) out.append(static_cast<const char*>(b->data()), b->bytes());
  out += pieces.trailer;
  return out;
}

std::vector<const Buffer*> SnapshotPayload(const ShardSnapshot& snap) {
  RecordWriter w;
  WriteRecords(snap, &w);
  return w.payload();
}

Status SerializedPayload(const std::string& bytes, uint64_t* offset, uint64_t* size) {
  uint64_t records = 0;
  if (bytes.size() < 32 || std::memcmp(bytes.data(), kCopyMagic, 8) != 0) return InvalidArgument("the base is no copy");
  std::memcpy(&records, bytes.data() + 8, 8);
  if (records > bytes.size() - 24) return InvalidArgument("the base is no copy: its records overrun it");
  *offset = 16 + records;
  *size = bytes.size() - 24 - records;
  return Status::Ok();
}

namespace {

// A serialized copy's layout checked, its payload as pieces (one) and the step it holds.
Status CopyLayout(const std::string& bytes, PayloadPieces* payload, int64_t* step) {
  // Header (16), the records' first field (the step, 8), the checksum (8).
  if (bytes.size() < 32) return BadPart("too short");
  if (std::memcmp(bytes.data(), kCopyMagic, 8) != 0) {
    return BadPart(
        "bad magic (not a replica's copy, or one from a psd of another version: run one version across a cluster)");
  }
  const uint64_t body = bytes.size() - 8;
  uint64_t records_bytes = 0;
  std::memcpy(&records_bytes, bytes.data() + 8, 8);
  if (records_bytes < 8 || records_bytes > body - 16) return BadPart("records larger than the copy");
  payload->Add(bytes.data() + 16 + records_bytes, body - 16 - records_bytes);
  std::memcpy(step, bytes.data() + 16, 8);
  return Status::Ok();
}

// Whether `bytes`' trailer is the checksum of its head and these payload block hashes.
Status CopyChecksumMatches(const std::string& bytes, const PayloadPieces& payload, const CopyBlockHashes& blocks) {
  const uint64_t body = bytes.size() - 8;
  uint64_t sum = 0;
  std::memcpy(&sum, bytes.data() + body, 8);
  if (blocks.size() != payload.blocks()) return BadPart("block hashes of another size");
  if (CopyChecksum(bytes.data(), body - payload.bytes(), blocks, body) != sum) return BadPart("checksum mismatch");
  return Status::Ok();
}

}  // namespace

Status VerifySerializedSnapshot(const std::string& bytes, int64_t* step, CopyBlockHashes* blocks) {
  PayloadPieces payload;
  PSD_RETURN_IF_ERROR(CopyLayout(bytes, &payload, step));
  CopyBlockHashes hashed = payload.HashAll();
  PSD_RETURN_IF_ERROR(CopyChecksumMatches(bytes, payload, hashed));
  if (blocks != nullptr) *blocks = std::move(hashed);
  return Status::Ok();
}

Status VerifySerializedSnapshotBlocks(const std::string& bytes, const CopyBlockHashes& blocks, int64_t* step) {
  PayloadPieces payload;
  PSD_RETURN_IF_ERROR(CopyLayout(bytes, &payload, step));
  return CopyChecksumMatches(bytes, payload, blocks);
}

Status ParseSnapshot(const std::string& bytes, ShardSnapshot* out) {
  int64_t step = 0;
  PSD_RETURN_IF_ERROR(VerifySerializedSnapshot(bytes, &step));
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  const uint64_t body = bytes.size() - 8;
  uint64_t records_bytes = 0;
  std::memcpy(&records_bytes, data + 8, 8);
  RecordReader r(data + 16, records_bytes, /*inline_blobs=*/false, body - 16 - records_bytes);
  ShardSnapshot snap;
  PSD_RETURN_IF_ERROR(ParseRecords(r, 4, &snap));
  if (r.pos() != records_bytes) return BadPart("trailing bytes in the records");
  if (r.payload_left() != 0) return BadPart("the copy holds more than its records name");
  uint64_t off = 16 + records_bytes;
  for (const auto& b : r.payload()) {
    std::memcpy(b->data(), data + off, b->bytes());
    off += b->bytes();
  }
  *out = std::move(snap);
  return Status::Ok();
}

}  // namespace psd::server
