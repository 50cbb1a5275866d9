// The wire form of the cluster's messages (schema/psd.capnp PeerMessage, VariablePlacement) and
// the typed values the cluster layer uses (cluster/peer_messages.h, cluster/placement.h): the one
// place where they meet. Decoding validates everything a peer or a client sent — names, dtypes,
// shapes, shard indexes, part tilings, checkpoint file names — so nothing past it needs to.
//
// Thread-safety: stateless functions.
#ifndef PSD_SERVER_SERVICE_PEER_CODEC_H_
#define PSD_SERVER_SERVICE_PEER_CODEC_H_

#include "cluster/peer_messages.h"
#include "cluster/placement.h"
#include "psd.capnp.h"
#include "psd/status.h"

namespace psd::server {

// A placement from a peer (Restored) or a worker (CreateVariable) of a `shards`-shard cluster.
// INVALID_ARGUMENT: what is wrong with it.
Result<VarPlacement> PlacementFromWire(proto::VariablePlacement::Reader r, int shards);
void PlacementToWire(proto::VariablePlacement::Builder b, const VarPlacement& p);

// A peer message of a `shards`-shard cluster. INVALID_ARGUMENT: a malformed message (a bad
// placement, a checkpoint file name that is a path, a shard out of range, an unknown kind); the
// receiver drops it. A replica chunk's data is borrowed from `r` (valid while its frame is).
Result<peer::Message> PeerMessageFromWire(proto::PeerMessage::Reader r, int shards);
// A replica chunk's data of whole words, 4 KiB and more, is referenced, not copied: the builder's
// message reads it from `m`'s blob, which must stay alive (its keep()) until the message is
// written or dropped.
void PeerMessageToWire(proto::PeerMessage::Builder b, const peer::Message& m);

}  // namespace psd::server

#endif  // PSD_SERVER_SERVICE_PEER_CODEC_H_
