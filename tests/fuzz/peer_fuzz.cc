// Fuzz target `peer_message`: the shard-to-shard protocol (server/cluster/coordinator.cc, formation.cc,
// replication.cc; the shard runs --replicas-per-shard 2). The
// input is the byte stream of a peer link: its frames are read with wire::ReadFrame and every
// Request that carries a PeerMessage is decoded (service/peer_codec.h) and, if valid, goes to
// ClusterCoordinator::OnMessage, as Connection hands it over from a proven peer link. The coordinator is shard 0 of a
// 3-shard cluster whose other shards (1 and 2) have live links; its Server is not started, so nothing runs but the
// messages (its own sends stay queued and nothing ticks): a run is deterministic except for a restore, which runs on
// the host's thread and is joined when the server stops. A fresh Server per input. Nothing may crash, leak or hit
// undefined behaviour.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "daemon/server.h"
#include "fuzz_support.h"
#include "service/peer_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  psd::server::ServerConfig config = psd::fuzz::FuzzConfig();
  config.cluster = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
  config.shard_index = 0;
  config.replicas_per_shard = 2;  // the replication messages are acted on too
  std::unique_ptr<psd::server::Server> server = psd::fuzz::MakeServer(std::move(config), /*start=*/false);
  psd::server::ClusterCoordinator* coordinator = server->coordinator();
  coordinator->Start();  // scans (no) checkpoints
  coordinator->OnPeerUp(1);
  coordinator->OnPeerUp(2);
  psd::fuzz::ForEachFrame(data, size, 1 << 20, /*max_frames=*/64, [&](capnp::MessageReader& reader) {
    auto req = reader.getRoot<psd::proto::Request>();
    if (!req.isPeer()) return;
    // The link it arrives on is a proven shard: here the sender field (which psd does not trust)
    // picks it, 2 for shard 2's link and anything else for shard 1's.
    auto msg = req.getPeer();
    auto decoded = psd::server::PeerMessageFromWire(msg, 3);
    if (decoded.ok()) coordinator->OnMessage(msg.getFrom() == 2 ? 2 : 1, *decoded);
  });
  coordinator->OnPeerDown(1);
  coordinator->OnPeerDown(2);
  server->Stop();
  return 0;
}
