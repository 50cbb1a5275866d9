// A shard's state as bytes in memory: what a shard sends to the shard that keeps its live copy
// (replication), checked before it is ever used. The records are a checkpoint part's
// (part_records.h); the checksum is copy_checksum.h's, so a copy rebuilt from an older one and a
// delta (snapshot_delta.h) is verified from block hashes instead of a pass over all of it.
//
// Thread-safety: free functions; no shared state.
#ifndef PSD_SERVER_CHECKPOINT_SERIALIZED_COPY_H_
#define PSD_SERVER_CHECKPOINT_SERIALIZED_COPY_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "checkpoint/copy_checksum.h"
#include "core/buffer.h"
#include "core/snapshot.h"
#include "psd/status.h"

namespace psd::server {

// A part's state as bytes in memory: a part's v4 layout (records size, records, payload) after the
// magic "PSDCOPY1" instead of a file's, then the copy's checksum (copy_checksum.h: XXH3 of the
// head's and the payload blocks' hashes): what a shard sends to the shard that keeps its live copy
// (replication). ParseSnapshot verifies the checksum and every record; INVALID_ARGUMENT otherwise.
std::string SerializeSnapshot(const ShardSnapshot& snapshot);
// The same bytes in pieces, the tensors not copied: `head` (magic, records size, records), each
// tensor's bytes in order (`payload`: the snapshot's own buffers, valid while it is), `trailer`
// (the checksum), and the payload's block hashes it was made from (`blocks`).
struct SerializedSnapshot {
  std::string head;
  std::vector<const Buffer*> payload;
  std::string trailer;
  uint64_t bytes = 0;  // in all
  CopyBlockHashes blocks;
};
// Every block hashed.
SerializedSnapshot SerializeSnapshotInPieces(const ShardSnapshot& snapshot);
// The payload's block hashes from `hash_blocks` (given the payload's buffers and their bytes as
// pieces), which must hash what they hold (snapshot_delta.h: a copy's blocks from an older copy's).
using HashPayloadBlocks = std::function<CopyBlockHashes(const std::vector<const Buffer*>&, const PayloadPieces&)>;
SerializedSnapshot SerializeSnapshotInPieces(const ShardSnapshot& snapshot, const HashPayloadBlocks& hash_blocks);

// The layout, for the differences of snapshot_delta.h: the tensors a serialized copy's payload
// holds, in order (the snapshot's own buffers); and where the payload lies in a serialized copy
// (INVALID_ARGUMENT: not a serialized copy).
std::vector<const Buffer*> SnapshotPayload(const ShardSnapshot& snapshot);
Status SerializedPayload(const std::string& bytes, uint64_t* offset, uint64_t* size);
Status ParseSnapshot(const std::string& bytes, ShardSnapshot* out);
// Checks the layout and checksum only (every block hashed, no copy) and reads the step it holds;
// `blocks` (if given): the payload's block hashes, for the next copy rebuilt from this one.
Status VerifySerializedSnapshot(const std::string& bytes, int64_t* step, CopyBlockHashes* blocks = nullptr);
// The same check with the payload's block hashes known (`blocks`: those of these bytes, hashed
// from them, e.g. a rebuilt copy's from its base's and the blocks a delta wrote).
Status VerifySerializedSnapshotBlocks(const std::string& bytes, const CopyBlockHashes& blocks, int64_t* step);

}  // namespace psd::server

#endif  // PSD_SERVER_CHECKPOINT_SERIALIZED_COPY_H_
