// The shard-to-shard messages of a psd cluster as plain values: what the ClusterCoordinator sends
// and receives over a PeerNetwork (cluster/peer_network.h). No wire types here: the service layer
// (service/peer_codec.h) turns them into schema/psd.capnp PeerMessages and back, and validates
// what a peer sent before it becomes one of these. See coordinator.h for the protocol.
//
// Every message carries the sender's term (fencing) and its shard index; a receiver trusts the
// index only as far as its link proves it (the coordinator is told `from` separately).
#ifndef PSD_SERVER_CLUSTER_PEER_MESSAGES_H_
#define PSD_SERVER_CLUSTER_PEER_MESSAGES_H_

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "cluster/placement.h"

namespace psd::server::peer {

// A live copy of one shard's state (replication, --replicas-per-shard 2): the state its engine of
// epoch `lineage` held at global step `step` (committed there, or restored by that epoch's
// formation). Copies of one lineage are of one timeline; two epochs' copies of a step may differ
// (the workers recompute the steps after a formation).
struct LiveCopy {
  uint64_t lineage = 0;
  int64_t step = 0;
  auto operator<=>(const LiveCopy&) const = default;
};

// Async/ssp replicas: the newest epoch known to have served workers with a shard's part, and
// whether a stand-in served it then (its newest copies are then on the stand-in's host alone).
// Ordered by epoch; within one epoch a stand-in's says more.
struct PartServed {
  uint64_t epoch = 0;  // 0: not known
  bool stand_in = false;
  auto operator<=>(const PartServed&) const = default;
};

// Immutable bytes that the copies of a message share: a piece of a serialized shard copy goes
// out without being copied (the encoder references it, `keep` holds it until it is written).
// A Blob without an owner borrows: the decoder's view into a received frame, valid only during
// the call that hands the message over (ClusterCoordinator::OnMessage copies what it keeps).
class Blob {
 public:
  Blob() = default;
  explicit Blob(std::string bytes);  // owns them
  Blob(std::shared_ptr<const void> keep, const char* data, size_t size)
      : keep_(std::move(keep)), data_(data), size_(size) {}
  static Blob Borrow(const char* data, size_t size) { return Blob(nullptr, data, size); }

  const char* data() const { return data_; }
  size_t size() const { return size_; }
  std::string_view view() const { return {data_, size_}; }
  // What keeps data() valid (null: borrowed).
  const std::shared_ptr<const void>& keep() const { return keep_; }
  bool operator==(const Blob& other) const { return view() == other.view(); }

 private:
  std::shared_ptr<const void> keep_;
  const char* data_ = nullptr;
  size_t size_ = 0;
};

// A shard's serialized copy as the pieces it lies in (ShardHost): their bytes, one after another,
// are the copy. Its owner's copy shares the engine's tensors; a copy kept as it came is one piece.
class CopyBytes {
 public:
  CopyBytes() = default;
  explicit CopyBytes(std::vector<Blob> pieces);
  explicit CopyBytes(std::string whole) : CopyBytes(std::vector<Blob>{Blob(std::move(whole))}) {}
  const std::vector<Blob>& pieces() const { return pieces_; }
  uint64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  std::vector<Blob> pieces_;
  uint64_t size_ = 0;
};

// One shard's file of a checkpoint (a file name, never a path: the codec checks).
struct PartInfo {
  int shard = 0;
  std::string file;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
  bool operator==(const PartInfo&) const = default;
};

// A digest of a checkpoint's manifest (its parts, in any order): the shard, size and checksum of
// each, as ClusterCoordinator::SameParts compares them. Never 0 (a heartbeat's 0: not known).
uint64_t SealDigest(std::vector<PartInfo> parts);

// From the chief: every part of checkpoint `step` is written; write the manifest.
struct Seal {
  uint64_t epoch = 0;  // the chief's term when it sealed: the epoch whose engines wrote the parts
  int64_t step = 0;
  std::vector<PartInfo> parts;
  bool operator==(const Seal&) const = default;
};

// Periodic, from every shard to every other one: who it thinks is chief and what it can restore.
// A heartbeat lists at most this many sealed (and as many unusable) steps, the newest: a formation
// restores a recent one, and the chief matches the lists of every shard each tick (a longer list
// is a malformed message; with --keep-checkpoints 0 older steps stay on disk, not offered).
inline constexpr size_t kMaxListedSteps = 1024;
// Terms count elections from 1, and epochs and lineages are terms: no cluster comes near this. A
// peer naming one beyond it would have a shard adopt and save it and overflow its next term.
inline constexpr uint64_t kMaxTerm = uint64_t{1} << 62;
// Steps count global steps from 0 (-1: none): no job comes near this either. A peer naming one
// beyond it would have a shard compute the step after it, or next to it, past int64.
inline constexpr int64_t kMaxStep = int64_t{1} << 62;

struct Heartbeat {
  int chief = -1;                       // -1: nobody known (a peer may send any value: election.h copes)
  uint64_t epoch = 0;                   // the epoch the sender's state belongs to
  bool running = false;                 // from the chief: the cluster serves workers at `epoch`
  std::vector<int64_t> sealed_steps;    // checkpoints the sender can restore, newest first
  bool ready = false;                   // the sender has scanned its checkpoints
  int required = 0;                     // from the chief: fresh gradients a step needs
  bool allow_state_loss = false;        // the sender runs with --allow-state-loss or --no-restore
  std::string waiting;                  // from the chief: why it does not form ("": it may)
  std::vector<int64_t> unusable_steps;  // checkpoint directories the sender has but cannot restore
  std::vector<LiveCopy> own_copies;     // replication: the sender's own committed states it keeps
  std::vector<LiveCopy> held_copies;    // replication: its predecessor's states it keeps (the chain)
  bool listening = false;               // the sender started less than an election timeout ago: it
                                        // does not claim the chief role yet (nor block others' claims)
  std::string address;                  // where the sender serves (its --cluster entry, or a stand-in's)
  bool stand_in = false;                // the sender is a stand-in for its shard (takeover)
  std::map<int, std::string> moved;     // from the chief: shard -> where it is served, when not at its entry
  // The newest (epoch as lineage, step) whose tokens the sender knows went out to workers: a
  // formation from live copies must not go back before it.
  LiveCopy released{0, -1};
  // The sender's own part on disk of each step it lists as unusable, when it knows it (a part it
  // wrote, or the one its lost manifest named): what a chief's seal must match to be written there.
  std::map<int64_t, PartInfo> unsealed_parts;
  // Async/ssp replicas: per shard (by index), the newest copy of its part the sender heard the
  // next shard keeps (empty: not said).
  std::vector<LiveCopy> kept_copies;
  // Async/ssp replicas: per shard (by index), the newest epoch the sender knows served workers with
  // its part, and whether through a stand-in (empty: not said).
  std::vector<PartServed> served_parts;
  // Per step of sealed_steps (same order): SealDigest of the manifest the sender holds for it (0:
  // not known; empty: not said).
  std::vector<uint64_t> seal_digests;
  // The manifest of the sender's newest sealed step (no parts: none). A shard that holds its
  // part of that step on disk but missed the seal (it lists the step unusable) keeps it, so that
  // as chief it can seal the step everywhere with its restore order (ResealableLocked) rather
  // than skip it for an older one.
  Seal newest_seal;

  bool operator==(const Heartbeat&) const = default;
};

// To the chief: this shard's part of `step` is staged (sync mode's first phase).
struct Prepared {
  uint64_t epoch = 0;
  int64_t step = 0;
  int min_gradients = 0;
  int max_gradients = 0;
  int takes = 0;  // variables taken (0: nothing to train here)
  bool forced = false;
  bool operator==(const Prepared&) const = default;
};

// From the chief: publish step + 1.
struct Commit {
  uint64_t epoch = 0;
  int64_t step = 0;            // the step being closed
  bool checkpoint = false;     // snapshot this commit and write the part
  double learning_rate = 0.0;  // of the steps after this one
  bool operator==(const Commit&) const = default;
};

// To the chief: `step` is published here.
struct Committed {
  uint64_t epoch = 0;
  int64_t step = 0;  // the step now published (the commit's step + 1)
  bool operator==(const Committed&) const = default;
};

// From the chief: replace the state with checkpoint `step` (-1: empty at step 0) for `epoch`.
// `seal`: the step's manifest, sent when some shard holds its part but missed the seal (it lists
// the step as unusable): such a shard writes it first, if its own part matches, then restores.
// `live`: restore the live copy (lineage, step) instead (replication): a shard that keeps its own
// copy restores it, one that does not fetches it from the next shard, which keeps it.
// `newest` (with `live`; async/ssp, where each shard copies its part at its own count): each
// shard restores the newest copy of its part — its own, or the next shard's if that one is newer
// (a stand-in served it meanwhile) — and `step` is only the chief's count.
struct Restore {
  uint64_t epoch = 0;
  int64_t step = -1;
  std::vector<PartInfo> seal;
  bool live = false;
  uint64_t lineage = 0;
  bool newest = false;
  // The chief's map as it formed: the shards it serves elsewhere than their --cluster entry (at a
  // stand-in's address). A shard follows it before it restores: a live copy it fetches must come
  // from the process that serves the next shard in this epoch, not from one its heartbeats have
  // not yet told it is gone from there.
  std::map<int, std::string> moved{};
  bool operator==(const Restore&) const = default;
};

// To the chief: the restore's outcome and the parts this shard holds, as placed.
struct Restored {
  uint64_t epoch = 0;
  int64_t step = -1;
  bool ok = false;
  std::string message;
  std::vector<VarPlacement> placements;
  bool operator==(const Restored&) const = default;
};

// To the chief: this shard's part of checkpoint `step` is on disk.
struct PartWritten {
  uint64_t epoch = 0;
  int64_t step = 0;
  PartInfo part;
  bool operator==(const PartWritten&) const = default;
};

// From the chief: every worker finished (job_done), or one of the orders of a running cluster
// (job_done false): force step `force_step` (sync, soft sync: the step deadline passed on some
// shard), or snapshot this shard's part now as checkpoint `snapshot_step` (async/ssp, whose shards
// apply pushes as they come and have no common step boundary).
struct Control {
  uint64_t epoch = 0;
  bool job_done = false;
  int64_t snapshot_step = -1;  // the checkpoint's step (-1: none); with job_done, the final one
  int64_t force_step = -1;     // without job_done: the step to force (-1: none)
  bool operator==(const Control&) const = default;
};

// To the chief: a checkpoint at the next commit, please.
struct CheckpointRequest {
  bool operator==(const CheckpointRequest&) const = default;
};

// Replication: a piece of shard `owner`'s committed state `copy`, serialized (ShardHost), sent in
// order on one link. From the owner to the next shard after each commit (that shard keeps it and
// acknowledges), or back from it to the owner (`restore`: the answer to a ReplicaFetch). `total`
// bytes in all; the last piece ends at it. total 0 with `restore`: the copy is not held here.
// `data` shares the sender's serialized copy (and is borrowed from the frame on arrival).
// `hand_back` (takeover): from the next shard to this shard's own process, back after a stand-in
// served it — a copy of this shard's predecessor (`owner`) that the stand-in kept, which its host
// (the next shard) took when it stopped it, so that it is not lost with it.
struct ReplicaChunk {
  uint64_t epoch = 0;
  int owner = 0;
  LiveCopy copy;
  bool restore = false;
  uint64_t offset = 0;
  uint64_t total = 0;
  Blob data;
  bool hand_back = false;
  bool operator==(const ReplicaChunk&) const = default;
};

// To the owner: its copy is kept whole here. `send_whole`: it is not — the copy came as a
// difference this shard could not use (its base is not kept here, a restart lost it, or the
// result did not match): send it whole now, rather than after the ack's timeout. `hand_back`: to
// the shard that handed the copy back (ReplicaChunk): taken, or not needed here (nothing more to do).
struct ReplicaAck {
  uint64_t epoch = 0;
  LiveCopy copy;
  bool send_whole = false;
  bool hand_back = false;
  bool operator==(const ReplicaAck&) const = default;
};

// To the next shard: send my copy back (a formation restores it and I do not keep it). `newest`
// (async/ssp): the newest copy of mine it keeps, if newer than `copy` (my own newest; step -1:
// none), else an empty answer (restore my own).
struct ReplicaFetch {
  uint64_t epoch = 0;
  LiveCopy copy;
  bool newest = false;
  bool operator==(const ReplicaFetch&) const = default;
};

using Body = std::variant<Heartbeat, Prepared, Commit, Committed, Restore, Restored, PartWritten, Seal, Control,
                          CheckpointRequest, ReplicaChunk, ReplicaAck, ReplicaFetch>;

struct Message {
  int from = 0;       // the sender as it says (not trusted: the link's shard is)
  uint64_t term = 0;  // the sender's term
  Body body;
  // The sending process (ClusterOptions::incarnation; 0: not said): a stand-in and its shard's own
  // process both speak as one index. Peers share the cluster secret, so it is a name among trusted
  // processes, not a proof.
  uint64_t sender = 0;
  // A message to the chief about an epoch (prepared, committed, restored, part written): the
  // process that ordered that epoch's restore; another process of its index ignores it. 0: any.
  uint64_t to = 0;
  bool operator==(const Message&) const = default;
};

// "heartbeat", "commit", ... (logs, the simulation's schedules).
const char* KindName(const Body& body);

}  // namespace psd::server::peer

#endif  // PSD_SERVER_CLUSTER_PEER_MESSAGES_H_
