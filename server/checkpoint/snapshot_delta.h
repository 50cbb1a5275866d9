// Replication's differences between serialized copies of a part (serialized_copy.h):
// a copy of a part that changed in places (the rows a sparse step touched) goes as the runs that
// differ from a copy the receiver keeps, and is rebuilt there bit for bit.
#ifndef PSD_SERVER_CHECKPOINT_SNAPSHOT_DELTA_H_
#define PSD_SERVER_CHECKPOINT_SNAPSHOT_DELTA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/serialized_copy.h"

namespace psd::server {

// A copy as the difference from an older one that the receiver keeps serialized (replication of a
// part that changed in places: the rows a sparse step touched). `next_pieces`: the new copy in pieces
// (its checksum is the rebuilt copy's). Holds the new head, the runs of the payload that differ
// from `base`'s (compared in 256-byte blocks; a buffer `base` shares is unchanged; a copy of
// `base`'s buffer that lists what was written since, Buffer::changes(), is compared there only —
// a write it does not list is missed, and the receiver's check of the rebuilt copy refuses it), `base_id` (the
// receiver's name for the base: two numbers it gives back from IsSnapshotDelta), and the whole
// copy's size and checksum, so what the receiver rebuilds is checked bit for bit. Empty when a
// delta does not pay: the tensors differ in number or size, or more than half of the bytes changed.
std::string SerializeSnapshotDelta(const ShardSnapshot& base, const SerializedSnapshot& next_pieces, uint64_t base_id_a,
                                   int64_t base_id_b);
// Whether `bytes` is such a delta; if so, the base it names.
bool IsSnapshotDelta(const std::string& bytes, uint64_t* base_id_a, int64_t* base_id_b);
// The whole serialized copy: `base` (a serialized copy) with `delta` applied, verified against the
// checksum the delta carries (as VerifySerializedSnapshot does: `step` is the step it holds).
// `base_blocks` (if given): the block hashes of `base`'s payload (copy_checksum.h), so only the
// blocks the delta writes are hashed; otherwise every block is. *blocks (if given): the result's.
// INVALID_ARGUMENT: a malformed delta, or one of another base. The copy is built in *out's storage
// (what it held is discarded; on an error *out is left empty).
Status ApplySnapshotDelta(const std::string& base, const std::string& delta, std::string* out, int64_t* step,
                          const CopyBlockHashes* base_blocks = nullptr, CopyBlockHashes* blocks = nullptr);
// The same copy built in place, without copying its base: `*copy` holds a serialized copy C, and
// `deltas` lead from C (the first one's base) to the copy the last one describes, each the
// difference from the one before's result. Their runs are written over C's payload, the last
// one's head over C's, and the result is verified as ApplySnapshotDelta's is (`step`;
// `copy_blocks`: C's block hashes, if known — every block any of the deltas writes is hashed anew).
// FAILED_PRECONDITION (nothing written): a delta changes the payload's place or size.
// INVALID_ARGUMENT: a malformed delta, or a result that does not match (the deltas were not a
// chain from C); *copy is then garbage, to be rebuilt by ApplySnapshotDelta.
Status ReplaySnapshotDeltas(const std::vector<const std::string*>& deltas, std::string* copy, int64_t* step,
                            const CopyBlockHashes* copy_blocks = nullptr, CopyBlockHashes* blocks = nullptr);

// `next` serialized in pieces (SerializeSnapshotInPieces), its checksum made from `base`'s payload
// block hashes (`base_blocks`, hashed from base's bytes) and a hash of the blocks that may differ:
// those of the tensors that are not base's buffers, and of a copy of base's buffer only the blocks
// its list of changes names (Buffer::changes(); a write it does not list is missed, as by
// SerializeSnapshotDelta). Every block is hashed when the layouts differ.
SerializedSnapshot SerializeSnapshotSince(const ShardSnapshot& base, const CopyBlockHashes& base_blocks,
                                          const ShardSnapshot& next);

// What a shard sends the next one for its state `next`: `pieces` (SerializeSnapshotInPieces) and,
// when `base` is given (the copy it sent before, which the next shard keeps as `base_id_a`,
// `base_id_b`), `delta`: the difference from it (SerializeSnapshotDelta; empty when it does not
// pay). With `base_blocks` (base's payload block hashes) the checksum is SerializeSnapshotSince's;
// `audit` then hashes every block as well and compares: a write that no list of changes names (a
// bug: the difference misses it, and so would the checksum) shows as `unlisted_write`, and the
// copy is made of its bytes' own hashes with no difference (to be sent whole).
struct ReplicaCopy {
  SerializedSnapshot pieces;
  std::string delta;
  bool unlisted_write = false;
};
ReplicaCopy SerializeReplicaCopy(const ShardSnapshot& next, const ShardSnapshot* base,
                                 const CopyBlockHashes* base_blocks, uint64_t base_id_a, int64_t base_id_b, bool audit);

}  // namespace psd::server

#endif  // PSD_SERVER_CHECKPOINT_SNAPSHOT_DELTA_H_
