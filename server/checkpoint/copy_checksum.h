// The checksum of a serialized copy of a part (serialized_copy.h, what replication
// sends and keeps): XXH3-64, seeded with the body's size (all but the checksum), of the XXH3-64 of
// the head (magic, records size, records) followed by the XXH3-64 of each kCopyBlockBytes block of
// the payload (the last one shorter).
//
// So a copy whose bytes differ from another's in a few places — the rows a sparse step wrote — is
// checksummed from the other's block hashes and a hash of the blocks that may differ, not from a
// pass over all of it: the blocks' hashes travel with the bytes they describe (the owner's copy,
// the copy the next shard keeps) and only ever come from hashing those bytes.
#ifndef PSD_SERVER_CHECKPOINT_COPY_CHECKSUM_H_
#define PSD_SERVER_CHECKPOINT_COPY_CHECKSUM_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace psd::server {

inline constexpr uint64_t kCopyBlockBytes = 1024;

// The hashes of a payload's blocks, in order.
using CopyBlockHashes = std::vector<uint64_t>;

// A payload as it lies: one or more pieces (a serialized copy's tensors, or one string), in order.
class PayloadPieces {
 public:
  void Add(const void* data, uint64_t bytes);
  uint64_t bytes() const { return bytes_; }
  uint64_t blocks() const { return (bytes_ + kCopyBlockBytes - 1) / kCopyBlockBytes; }
  // The hash of block `b` (< blocks()), wherever its bytes lie.
  uint64_t HashBlock(uint64_t b) const;
  // Every block's hash.
  CopyBlockHashes HashAll() const;

 private:
  struct Piece {
    uint64_t at;  // in the payload
    const char* data;
    uint64_t bytes;
  };
  std::vector<Piece> pieces_;
  uint64_t bytes_ = 0;
};

// The blocks of a payload that may differ from another's of the same size, as sorted payload byte
// ranges [from, to) (they may overlap or touch), turned into the new payload's block hashes: the
// other's for every block no range touches, those hashed anew from `now` for the rest.
// `before.size()` must be now.blocks().
CopyBlockHashes RehashChangedBlocks(const CopyBlockHashes& before, const PayloadPieces& now,
                                    const std::vector<std::pair<uint64_t, uint64_t>>& ranges);

// The checksum of a copy with this head and these payload block hashes, `body_bytes` in all
// (head and payload).
uint64_t CopyChecksum(const std::string& head, const CopyBlockHashes& blocks, uint64_t body_bytes);
uint64_t CopyChecksum(const char* head, uint64_t head_bytes, const CopyBlockHashes& blocks, uint64_t body_bytes);

}  // namespace psd::server

#endif  // PSD_SERVER_CHECKPOINT_COPY_CHECKSUM_H_
