// WorkerSession: a shard's peer link saying who it is (the hello, and with --cluster-secret-file
// the challenge and proof of server/net/peer_auth.h).
#include <spdlog/spdlog.h>

#include "cluster/coordinator.h"
#include "net/peer_auth.h"
#include "psd/secret.h"
#include "service/service_host.h"
#include "service/worker_session.h"

namespace psd::server {

void WorkerSession::LogSpoof(const std::string& what) {
  int64_t suppressed = host_.spoof_log().Allow();
  if (suppressed < 0) return;
  boost::system::error_code ec;
  auto remote = conn_->stream().lowest().remote_endpoint(ec);
  spdlog::warn("connection {} from {}: {}; refused{}", id_, ec ? std::string("?") : remote.address().to_string(), what,
               peer_auth::LogLimiter::SuppressedNote(suppressed));
}

peer_auth::Transcript WorkerSession::PendingTranscript() const {
  const ServerConfig& cfg = host_.config();
  std::string_view nonces(peer_nonces_);
  return {static_cast<uint32_t>(cfg.shards()), static_cast<uint32_t>(peer_claim_),
          static_cast<uint32_t>(cfg.shard_index), nonces.substr(0, peer_auth::kNonceBytes),
          nonces.substr(peer_auth::kNonceBytes)};
}

void WorkerSession::HandlePeerHello(uint64_t id, proto::Hello::Reader r) {
  ClusterCoordinator* c = host_.coordinator();
  const ServerConfig& cfg = host_.config();
  if (c == nullptr) return FailStream(FailedPrecondition("this psd is a single daemon, not a cluster shard"), id);
  int idx = static_cast<int>(r.getShardIndex());
  if (r.getClusterSize() != static_cast<uint32_t>(cfg.shards()) || r.getShardIndex() >= r.getClusterSize() ||
      idx == cfg.shard_index) {
    LogSpoof("said hello as shard " + std::to_string(r.getShardIndex()) + " of " + std::to_string(r.getClusterSize()));
    return FailStream(
        InvalidArgument("a peer says it is shard " + std::to_string(idx) + " of " + std::to_string(r.getClusterSize()) +
                        "; this is shard " + std::to_string(cfg.shard_index) + " of " + std::to_string(cfg.shards()) +
                        ": check --cluster and --shard-index"),
        id);
  }
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  auto h = resp.initHello();
  h.setProtocolVersion(proto::PROTOCOL_VERSION);
  if (cfg.cluster_secret.empty()) {
    // No cluster secret (loopback only, or --insecure): the hello's index is believed, and binds
    // the link's messages to it.
    peer_shard_ = idx;
    conn_->set_role(Connection::Role::kShard);
    c->OnPeerUp(idx);
    return Send(std::move(frame));
  }
  auto theirs = r.getPeerNonce();
  if (theirs.size() != peer_auth::kNonceBytes) {
    LogSpoof("said hello as shard " + std::to_string(idx) + " without a challenge");
    return FailStream(Unauthenticated("this shard runs with --cluster-secret-file: a peer must prove it knows the "
                                      "cluster secret (give every shard the same --cluster-secret-file)"),
                      id);
  }
  auto mine = peer_auth::NewNonce();
  if (!mine.ok()) return FailStream(mine.status(), id);
  peer_claim_ = idx;
  peer_nonces_.assign(reinterpret_cast<const char*>(theirs.begin()), theirs.size());
  peer_nonces_ += *mine;
  std::string proof = peer_auth::Proof(cfg.cluster_secret, peer_auth::Role::kAcceptor, PendingTranscript());
  h.setShardIndex(static_cast<uint32_t>(cfg.shard_index));
  h.setShards(static_cast<uint32_t>(cfg.shards()));
  h.setPeerNonce(kj::arrayPtr(reinterpret_cast<const kj::byte*>(mine->data()), mine->size()));
  h.setPeerProof(kj::arrayPtr(reinterpret_cast<const kj::byte*>(proof.data()), proof.size()));
  Send(std::move(frame));
}

void WorkerSession::HandlePeerProof(uint64_t id, capnp::Data::Reader proof) {
  const ServerConfig& cfg = host_.config();
  if (peer_claim_ < 0 || greeted() || cfg.cluster_secret.empty()) {
    LogSpoof("sent a peer proof without a pending challenge");
    return FailStream(FailedPrecondition("a peer proof answers this shard's challenge to a peer hello; closing"), id);
  }
  std::string_view got(reinterpret_cast<const char*>(proof.begin()), proof.size());
  if (!peer_auth::Verify(cfg.cluster_secret, peer_auth::Role::kDialer, PendingTranscript(), got)) {
    LogSpoof("failed the cluster-secret proof as shard " + std::to_string(peer_claim_) +
             " (a wrong --cluster-secret-file, or not a shard)");
    return FailStream(Unauthenticated("wrong cluster secret: give every shard the same --cluster-secret-file"), id);
  }
  peer_shard_ = peer_claim_;
  peer_claim_ = -1;
  peer_nonces_.clear();
  authenticated_ = true;  // the cluster secret, in place of the workers' token
  conn_->set_role(Connection::Role::kShard);
  host_.coordinator()->OnPeerUp(peer_shard_);
}

}  // namespace psd::server
