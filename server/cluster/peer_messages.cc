#include "cluster/peer_messages.h"

#include <algorithm>

namespace psd::server::peer {

Blob::Blob(std::string bytes) {
  auto owned = std::make_shared<const std::string>(std::move(bytes));
  data_ = owned->data();
  size_ = owned->size();
  keep_ = std::move(owned);
}

CopyBytes::CopyBytes(std::vector<Blob> pieces) : pieces_(std::move(pieces)) {
  for (const Blob& p : pieces_) size_ += p.size();
}

uint64_t SealDigest(std::vector<PartInfo> parts) {
  std::sort(parts.begin(), parts.end(), [](const PartInfo& x, const PartInfo& y) { return x.shard < y.shard; });
  // FNV-1a: a comparison between authenticated peers, not a defence.
  uint64_t h = 14695981039346656037ull;
  auto mix = [&h](uint64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (const PartInfo& p : parts) {
    mix(static_cast<uint64_t>(p.shard));
    mix(p.bytes);
    mix(p.checksum);
  }
  return h == 0 ? 1 : h;
}

const char* KindName(const Body& body) {
  static constexpr const char* kNames[] = {
      "heartbeat", "prepared",           "commit",        "committed",   "restore",      "restored", "part", "seal",
      "control",   "checkpoint-request", "replica-chunk", "replica-ack", "replica-fetch"};
  static_assert(std::size(kNames) == std::variant_size_v<Body>);
  return kNames[body.index()];
}

}  // namespace psd::server::peer
