#include "cluster/peer_messages.h"

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

const char* KindName(const Body& body) {
  static constexpr const char* kNames[] = {
      "heartbeat", "prepared",           "commit",        "committed",   "restore",      "restored", "part", "seal",
      "control",   "checkpoint-request", "replica-chunk", "replica-ack", "replica-fetch"};
  static_assert(std::size(kNames) == std::variant_size_v<Body>);
  return kNames[body.index()];
}

}  // namespace psd::server::peer
