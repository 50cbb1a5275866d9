// ShardHost: what the ClusterCoordinator asks of the shard it runs in — its training engine, its
// checkpoint files and its job — and nothing else. The daemon implements it over its engine slot
// and checkpoint writer (net/cluster_host.h); the fault simulation with a fake engine and
// in-memory checkpoints (tests/support/cluster_sim.h).
//
// Threading: the coordinator calls these without holding its lock, from whatever thread
// delivered the event (a link's strand, the ticker), so they may call back into it (the daemon's
// EndJobIfDone calls OnJobDone); RestoreAsync's completion alone must come later.
#ifndef PSD_SERVER_CLUSTER_SHARD_HOST_H_
#define PSD_SERVER_CLUSTER_SHARD_HOST_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cluster/peer_messages.h"
#include "cluster/placement.h"
#include "psd/status.h"

namespace psd::server {

// The copies in `copies` (keyed by LiveCopy) that a formation of `epoch` restoring the live copy
// `newest` (none: a checkpoint) leaves behind: [first, last). Those newer than `newest` (all
// without it) of an older lineage: a copy of `epoch` or of a later one is of that formation's
// timeline or of a newer one — the predecessor's copy of its restored part can come before this
// shard takes the order, and once acknowledged it may be the only copy of that part.
template <typename Map>
std::pair<typename Map::iterator, typename Map::iterator> LeftCopies(Map& copies, std::optional<peer::LiveCopy> newest,
                                                                     uint64_t epoch) {
  const peer::LiveCopy from_epoch{epoch, std::numeric_limits<int64_t>::min()};
  auto last = copies.lower_bound(from_epoch);
  if (newest && *newest >= from_epoch) return {last, last};
  return {newest ? copies.upper_bound(*newest) : copies.begin(), last};
}

// What a stand-in leaves its host when it stops (ClusterCoordinator::Leaving).
struct StandInLeft {
  // The newest copy of each part it knew was kept (async/ssp replicas), for its host to pass on.
  std::vector<peer::LiveCopy> kept;
  // The copies of its predecessor's part it kept, serialized: its host hands them to its shard's
  // own process (cluster/takeover.cc), else they would go with it.
  std::vector<std::pair<peer::LiveCopy, std::shared_ptr<const peer::CopyBytes>>> held;
};

class ShardHost {
 public:
  virtual ~ShardHost() = default;

  // --- the engine serving now ---
  // Publishes step + 1 from what the engine prepared for `step`, on the engine of `epoch` (a
  // snapshot for a checkpoint if `checkpoint`; `learning_rate` from then on). ABORTED: the engine
  // serving now belongs to another epoch (nothing done, not an error); other errors are logged.
  virtual Status CommitStep(uint64_t epoch, int64_t step, bool checkpoint, double learning_rate) = 0;
  // The learning rate the chief's engine would use next.
  virtual double learning_rate() = 0;
  // The chief, once every shard committed: releases the tokens of `step` to the workers.
  virtual void PushTokens(int64_t step) = 0;
  // The chief, once the cluster formed: the requirement (if > 0) and the initial tokens.
  virtual void StartServing(int required) = 0;
  // Fresh gradients a step needs (the chief's worker registry decides).
  virtual void SetRequired(int required) = 0;
  // Fails every parked token wait with `why` (the cluster stopped serving).
  virtual void FailWaiters(const Status& why) = 0;
  // Reports this shard's part of the open step at once if it has nothing to train.
  virtual void ReportIfIdle() = 0;
  // Sync with a step deadline: takes step `step` with the gradients that arrived, on the engine
  // of `epoch` (nothing if it is at another step or epoch).
  virtual void ForceStep(uint64_t epoch, int64_t step) = 0;
  // Async/ssp: the pushes the engine serving now has applied (its global step).
  virtual int64_t global_step() = 0;
  // Async/ssp: the engine of `epoch` counts on from `step` if it is behind (a new chief after a
  // formation from each part's newest copy: the global step does not go back). Default: nothing.
  virtual void RaiseGlobalStep(uint64_t /*epoch*/, int64_t /*step*/) {}

  // --- restores ---
  // Replaces the engine with one for `epoch` restored from checkpoint `step` (-1: empty at step
  // 0), asynchronously; `done` runs once, later (never inside this call), with the outcome and
  // the parts the new engine holds. A restore asked while one runs starts after it. `seal`
  // non-empty: this shard holds its part of `step` but missed the seal; the manifest of `seal`
  // is written first, only if this shard's part on disk matches its entry (it is read whole, off
  // the caller's thread, like the restore), else the restore fails with FailedPrecondition.
  using RestoreDone = std::function<void(Status status, std::vector<VarPlacement> placements)>;
  virtual void RestoreAsync(uint64_t epoch, int64_t step, const std::vector<peer::PartInfo>& seal,
                            RestoreDone done) = 0;

  // --- checkpoints ---
  // What this shard's checkpoint directory holds.
  struct CheckpointScan {
    std::vector<int64_t> sealed;                           // the steps it can restore, newest first
    std::vector<int64_t> unusable;                         // those present but not restorable (newest first)
    std::map<int64_t, std::vector<peer::PartInfo>> seals;  // the manifests of the sealed steps
    // This shard's own part of unusable steps, where one is on disk: its size and the checksum its
    // trailer records (not verified here: a seal that names it reads it whole first).
    std::map<int64_t, peer::PartInfo> unsealed_parts;
  };
  virtual CheckpointScan ScanCheckpoints() = 0;
  // Writes the manifest of checkpoint `step` from every shard's part (and remembers it as the
  // last checkpoint). Errors are logged by the caller; the step then stays unusable here.
  virtual Status SealCheckpoint(int64_t step, const std::vector<peer::PartInfo>& parts) = 0;
  // Async/ssp: snapshots the engine of `epoch` as it is now and queues it as this shard's part of
  // checkpoint `step` (the chief's global step; the part written is reported to OnPartWritten).
  // ABORTED: the engine serving now belongs to another epoch.
  virtual Status SnapshotAs(uint64_t epoch, int64_t step) = 0;
  // True while a snapshot is queued or being written.
  virtual bool CheckpointWriterBusy() = 0;
  // The highest term this shard has saved (0: none). Epochs are terms, and workers tell epochs
  // apart by number: a cluster restarted whole must not form a term again that its workers saw.
  virtual uint64_t LoadTerm() = 0;
  // Remembers `term` across restarts (best effort: errors are the host's to log).
  virtual void SaveTerm(uint64_t term) = 0;

  // --- replication (--replicas-per-shard 2: the next shard keeps a copy of each committed state) ---
  // The live copies this shard keeps: its own committed states and its predecessor's (newest first).
  virtual void LiveCopies(std::vector<peer::LiveCopy>* own, std::vector<peer::LiveCopy>* held) = 0;
  // The engine of `epoch` is at global step `copy.step`, just committed (CommitStep) or restored:
  // keeps that state as this shard's own copy `copy` (the newest two are kept) and returns it
  // serialized for the next shard (in pieces that share the state's tensors). With `base` (a copy
  // of this shard's that the next shard acknowledged, in the same lineage) it may be serialized as
  // the difference from it, when that is smaller. Null (logged) when the engine is elsewhere.
  virtual std::shared_ptr<const peer::CopyBytes> KeepCopy(uint64_t epoch, const peer::LiveCopy& copy,
                                                          std::optional<peer::LiveCopy> base) = 0;
  // A kept copy serialized: this shard's own (`owner` is this shard) or its predecessor's (kept as
  // it came). Null if not kept.
  virtual std::shared_ptr<const peer::CopyBytes> SerializedCopy(int owner, const peer::LiveCopy& copy) = 0;
  // Keeps a serialized copy that arrived whole: the predecessor's (as it is, once its checksum
  // verifies, or rebuilt from the copy it is a difference from), or this shard's own fetched back
  // for a restore (parsed; its own newer copies are dropped). INVALID_ARGUMENT if it does not
  // verify or parse, FAILED_PRECONDITION if it is a difference from a copy not kept here (nothing
  // kept).
  virtual Status TakeCopy(int owner, const peer::LiveCopy& copy, std::shared_ptr<const std::string> bytes) = 0;
  // Where a copy of `bytes` that arrives in pieces is put together (empty, room reserved for up to
  // 256 MiB of it), for TakeCopy. Default: a new string. A host may hand out the storage of a copy
  // it let go, so that a big part's copies do not come as fresh pages (a fault per 4 KiB) every step.
  virtual std::shared_ptr<std::string> CopyStorage(uint64_t bytes) {
    auto storage = std::make_shared<std::string>();
    storage->reserve(std::min<uint64_t>(bytes, 256ull << 20));  // grows past it as pieces come
    return storage;
  }
  // Drops the copies a formation of `epoch` leaves (LeftCopies): it restores the live copy
  // `newest`, or a checkpoint (none).
  virtual void DropCopies(std::optional<peer::LiveCopy> newest, uint64_t epoch) = 0;
  // Like RestoreAsync, from this shard's own copy `copy` (NOT_FOUND if it is not kept).
  virtual void RestoreCopyAsync(uint64_t epoch, const peer::LiveCopy& copy, RestoreDone done) = 0;
  // Async/ssp (copies on arrival): snapshots the engine of `epoch` as it is now, keeps it as this
  // shard's own copy (lineage `epoch`: a stand-in's copies outrank the ones it restored; step: the
  // engine's count) and hands the copy's name and bytes to `done`, on a thread of the host's (at
  // once when the host stopped); (nullopt, null) when the engine belongs to another epoch.
  // Default: no copies (a host that cannot take them; answered at once).
  using CopyDone = std::function<void(std::optional<peer::LiveCopy>, std::shared_ptr<const peer::CopyBytes>)>;
  virtual void KeepCopyNowAsync(uint64_t /*epoch*/, std::optional<peer::LiveCopy> /*base*/, CopyDone done) {
    done(std::nullopt, nullptr);
  }

  // --- takeover (cluster/takeover.cc) ---
  // Starts a stand-in for shard `shard` (this shard's predecessor) in this process: a shard of
  // the same cluster with that index, at a port of its own on this host, whose links first go to
  // `links` (where each shard is served now). It restores the predecessor's part from the copy kept
  // here when the chief forms the cluster with it. The coordinator's OnStandInEnded is called when
  // it stops by itself or fails to start. Default: none (a host that cannot run one).
  virtual void StartStandIn(int /*shard*/, std::vector<std::string> /*links*/) {}
  // Stops the stand-in (its shard's own process is back), without waiting for it. Returns what
  // it leaves (its ClusterCoordinator::Leaving): the copies it kept, for this shard to pass on.
  virtual StandInLeft StopStandIn() { return {}; }

  // --- the job ---
  // Every worker finished: closes the token queue; if the engine is at `snapshot_step` (>= 0;
  // async/ssp: whatever its own count, the part is labelled `snapshot_step`), queues that final
  // snapshot and returns true (the seal or a timeout then finishes the job).
  virtual bool EndTraining(int64_t snapshot_step) = 0;
  // The job is over (stops the daemon if --exit-when-done).
  virtual void FinishJob() = 0;
  // Ends the job if every worker has finished (a new chief checks: the last one may have gone
  // before telling everyone).
  virtual void EndJobIfDone() = 0;
};

}  // namespace psd::server

#endif  // PSD_SERVER_CLUSTER_SHARD_HOST_H_
