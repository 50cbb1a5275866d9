// A serialized copy's block checksum (copy_checksum.h).
#include "checkpoint/copy_checksum.h"

#include <algorithm>
#include <cstring>

#include "checkpoint/xxh3.h"

namespace psd::server {

void PayloadPieces::Add(const void* data, uint64_t bytes) {
  if (bytes == 0) return;
  pieces_.push_back({bytes_, static_cast<const char*>(data), bytes});
  bytes_ += bytes;
}

uint64_t PayloadPieces::HashBlock(uint64_t b) const {
  const uint64_t from = b * kCopyBlockBytes, to = std::min(bytes_, from + kCopyBlockBytes);
  // The piece holding `from`.
  auto it =
      std::upper_bound(pieces_.begin(), pieces_.end(), from, [](uint64_t at, const Piece& p) { return at < p.at; });
  --it;
  if (to <= it->at + it->bytes) return XXH3_64bits(it->data + (from - it->at), to - from);
  // The block spans pieces: its bytes gathered first.
  char joined[kCopyBlockBytes];
  uint64_t n = 0;
  for (uint64_t pos = from; pos < to; ++it) {
    const uint64_t take = std::min(to, it->at + it->bytes) - pos;
    std::memcpy(joined + n, it->data + (pos - it->at), take);
    n += take;
    pos += take;
  }
  return XXH3_64bits(joined, n);
}

CopyBlockHashes PayloadPieces::HashAll() const {
  CopyBlockHashes out(blocks());
  for (uint64_t b = 0; b < out.size(); ++b) out[b] = HashBlock(b);
  return out;
}

CopyBlockHashes RehashChangedBlocks(const CopyBlockHashes& before, const PayloadPieces& now,
                                    const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  CopyBlockHashes out = before;
  std::vector<std::pair<uint64_t, uint64_t>> sorted = ranges;
  std::sort(sorted.begin(), sorted.end());
  // Ranges sorted by start: every block from a range's first to the last one hashed was hashed.
  uint64_t next = 0;  // the first block not hashed yet at or after the ranges so far
  for (const auto& [from, to] : sorted) {
    if (to <= from || from >= now.bytes()) continue;
    const uint64_t last = (std::min(to, now.bytes()) - 1) / kCopyBlockBytes;
    for (uint64_t b = std::max(next, from / kCopyBlockBytes); b <= last; ++b) out[b] = now.HashBlock(b);
    next = std::max(next, last + 1);
  }
  return out;
}

uint64_t CopyChecksum(const char* head, uint64_t head_bytes, const CopyBlockHashes& blocks, uint64_t body_bytes) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset_withSeed(st, body_bytes);
  const uint64_t head_hash = XXH3_64bits(head, head_bytes);
  XXH3_64bits_update(st, &head_hash, sizeof(head_hash));
  XXH3_64bits_update(st, blocks.data(), blocks.size() * sizeof(uint64_t));
  const uint64_t sum = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return sum;
}

uint64_t CopyChecksum(const std::string& head, const CopyBlockHashes& blocks, uint64_t body_bytes) {
  return CopyChecksum(head.data(), head.size(), blocks, body_bytes);
}

}  // namespace psd::server
