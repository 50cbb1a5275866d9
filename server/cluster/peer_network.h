// PeerNetwork: how a ClusterCoordinator reaches the other shards of its cluster. The model is
// Cap'n Proto's VatNetwork: the protocol (cluster/coordinator.h) is written against this
// interface, the daemon plugs in real links (net/peer_link.h: TCP/TLS, the cluster-secret
// handshake, encoding by service/peer_codec.h) and the tests an in-memory network that drops,
// delays, reorders, duplicates and partitions (tests/support/cluster_sim.h).
//
// Delivery is one-way and best-effort: a message may be lost (a link down, a peer that reads
// nothing), and messages on one link arrive in the order sent. What arrives is handed to the
// coordinator as events: OnPeerUp(shard) when a link from `shard` is proven, OnPeerDown(shard)
// when it closes, OnMessage(from, message) for each message, `from` being the link's shard.
#ifndef PSD_SERVER_CLUSTER_PEER_NETWORK_H_
#define PSD_SERVER_CLUSTER_PEER_NETWORK_H_

#include <functional>
#include <optional>
#include <string>

#include "cluster/peer_messages.h"

namespace psd::server {

// What a PeerNetwork reports to (the coordinator).
class PeerEvents {
 public:
  virtual ~PeerEvents() = default;
  // A link from `shard` is up and proven to be that shard's.
  virtual void OnPeerUp(int shard) = 0;
  // That link closed.
  virtual void OnPeerDown(int shard) = 0;
  // A message came from `from` (the link's shard, or this shard itself).
  virtual void OnMessage(int from, const peer::Message& message) = 0;
};

class PeerNetwork {
 public:
  virtual ~PeerNetwork() = default;

  // Sends `message` to `shard`. This shard itself is a valid target: the message comes back
  // through OnMessage(me, message) later, never inside this call. Never blocks; thread-safe.
  virtual void Send(int shard, const peer::Message& message) = 0;
  // Messages made on demand: each call gives the next one, nullopt after the last. A replica copy
  // of any size is sent as one (its chunks share the copy's memory), so that a link holds only the
  // chunk it is writing instead of the whole copy's chunks at once.
  using MessageStream = std::function<std::optional<peer::Message>()>;
  // Sends the stream's messages to `shard`, in order, after what was sent to it before and before
  // what is sent after. A network may call `next` later, on its own threads (one call at a time),
  // or drop the rest when the link goes down, like any message. This default makes them all now.
  virtual void SendStream(int shard, MessageStream next) {
    while (std::optional<peer::Message> message = next()) Send(shard, *message);
  }
  // From now on, messages to `shard` go to `address` (host:port): a stand-in serves it there after
  // a takeover, or its own process at its --cluster entry again. Messages given before the new
  // link is up wait for it. A network without addresses (the simulation) ignores it.
  virtual void Retarget(int /*shard*/, const std::string& /*address*/) {}
  // Sends to every other shard (and to this one if `include_self`). An implementation may encode
  // once for all links.
  virtual void SendToAll(const peer::Message& message, bool include_self, int shards, int me) {
    for (int i = 0; i < shards; ++i) {
      if (i != me || include_self) Send(i, message);
    }
  }
};

}  // namespace psd::server

#endif  // PSD_SERVER_CLUSTER_PEER_NETWORK_H_
