// ServerShardHost: the daemon's side of the ClusterCoordinator's ShardHost interface — the
// engine slot (an engine per epoch), the checkpoint writer and files, the job's end — over a
// Server. Restores run on a thread of their own, one after the other.
//
// Thread-safety: every method from any thread. Join() waits for the restores (the Server calls
// it when it stops, before the coordinator that their completions call goes away).
#ifndef PSD_SERVER_DAEMON_CLUSTER_HOST_H_
#define PSD_SERVER_DAEMON_CLUSTER_HOST_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "checkpoint/copy_checksum.h"
#include "cluster/shard_host.h"
#include "core/snapshot.h"
#include "core/step_commit.h"

namespace psd::server {

class Server;
class ClusterCoordinator;

// A cluster shard's StepCommit: the engine of `epoch` reports each prepared step to the
// coordinator, which commits it on every shard once all have prepared it.
class ClusterStepCommit final : public StepCommit {
 public:
  ClusterStepCommit(ClusterCoordinator* coordinator, uint64_t epoch) : coordinator_(coordinator), epoch_(epoch) {}
  bool commits_locally() const override { return false; }
  void OnPrepared(const PreparedStep& p) override;

 private:
  ClusterCoordinator* const coordinator_;  // outlives the engines
  const uint64_t epoch_;
};

class ServerShardHost : public ShardHost {
 public:
  explicit ServerShardHost(Server& server) : server_(server) {}
  ~ServerShardHost() override;

  void Join();

  Status CommitStep(uint64_t epoch, int64_t step, bool checkpoint, double learning_rate) override;
  double learning_rate() override;
  void PushTokens(int64_t step) override;
  void StartServing(int required) override;
  void SetRequired(int required) override;
  void FailWaiters(const Status& why) override;
  void ReportIfIdle() override;
  void ForceStep(uint64_t epoch, int64_t step) override;
  int64_t global_step() override;
  void RaiseGlobalStep(uint64_t epoch, int64_t step) override;
  void RestoreAsync(uint64_t epoch, int64_t step, const std::vector<peer::PartInfo>& seal, RestoreDone done) override;
  CheckpointScan ScanCheckpoints() override;
  Status SealCheckpoint(int64_t step, const std::vector<peer::PartInfo>& parts) override;
  Status SnapshotAs(uint64_t epoch, int64_t step) override;
  bool CheckpointWriterBusy() override;
  // In --checkpoint-dir/cluster-term (without a checkpoint directory: not kept).
  uint64_t LoadTerm() override;
  void SaveTerm(uint64_t term) override;
  void LiveCopies(std::vector<peer::LiveCopy>* own, std::vector<peer::LiveCopy>* held) override;
  std::shared_ptr<const peer::CopyBytes> KeepCopy(uint64_t epoch, const peer::LiveCopy& copy,
                                                  std::optional<peer::LiveCopy> base) override;
  std::shared_ptr<const peer::CopyBytes> SerializedCopy(int owner, const peer::LiveCopy& copy) override;
  Status TakeCopy(int owner, const peer::LiveCopy& copy, std::shared_ptr<const std::string> bytes) override;
  // A copy of 16 MiB or more: the spare's storage when it fits (at most twice the size), given back
  // to the spare when let go if the spare is empty then.
  std::shared_ptr<std::string> CopyStorage(uint64_t bytes) override;
  void DropCopies(std::optional<peer::LiveCopy> newest, uint64_t epoch) override;
  void RestoreCopyAsync(uint64_t epoch, const peer::LiveCopy& copy, RestoreDone done) override;
  // On a thread of its own per copy (each joins the one before it first).
  void KeepCopyNowAsync(uint64_t epoch, std::optional<peer::LiveCopy> base, CopyDone done) override;
  // A stand-in is a second Server in this process (its own io_context, engine and links), run by
  // a thread of its own that starts it, waits for its end and stops it.
  void StartStandIn(int shard, std::vector<std::string> links) override;
  StandInLeft StopStandIn() override;
  // Calls `fn` with the stand-in while one serves (under this host's lock: it does not stop
  // meanwhile). For the operators' figures.
  void WithStandIn(const std::function<void(Server&)>& fn) EXCLUDES(mu_);
  bool EndTraining(int64_t snapshot_step) override;
  void FinishJob() override;
  void EndJobIfDone() override;

 private:
  // Keeps `snap` as this shard's own copy `copy` (the newest two are kept) and returns it serialized
  // (as the difference from own copy `base` when that is kept and the difference is smaller).
  std::shared_ptr<const peer::CopyBytes> KeepOwn(const peer::LiveCopy& copy, ShardSnapshot snap,
                                                 std::optional<peer::LiveCopy> base) EXCLUDES(mu_);

  Server& server_;
  Mutex mu_;
  std::thread restore_ GUARDED_BY(mu_);  // the newest restore (it joins the one before it first)
  std::thread copy_ GUARDED_BY(mu_);     // the newest copy on arrival (likewise)
  // Replication: this shard's own committed states and its predecessor's, the newest two of each,
  // with their serialized payloads' block hashes (copy_checksum.h; an own copy restored from the
  // next shard's has none: the next one is hashed whole).
  struct OwnCopy {
    ShardSnapshot snap;
    std::shared_ptr<const CopyBlockHashes> blocks;
  };
  struct HeldCopy {
    std::shared_ptr<const std::string> bytes;  // serialized, as it came or rebuilt
    std::shared_ptr<const CopyBlockHashes> blocks;
  };
  std::map<peer::LiveCopy, OwnCopy> own_ GUARDED_BY(mu_);
  std::map<peer::LiveCopy, HeldCopy> held_ GUARDED_BY(mu_);
  // Own copies serialized so far: every kAuditEvery-th one is hashed whole as well (KeepOwn), or
  // the next one with a base to compare with (`audit_due_` until then).
  uint64_t own_copies_ GUARDED_BY(mu_) = 0;
  bool audit_due_ GUARDED_BY(mu_) = false;
  // The difference each held copy was rebuilt from, if it was (keyed like held_).
  std::map<peer::LiveCopy, std::shared_ptr<const std::string>> held_deltas_ GUARDED_BY(mu_);
  // The storage of the last copy rebuilt from a difference that was let go (trimmed, and not being
  // sent on), and which copy's bytes it still holds: the next one is rebuilt in it, by replaying the
  // differences from that copy to the base (held_deltas_) and the new one over it — no pass over
  // the whole copy but its checksum. A copy of a part over 32 MiB is otherwise mapped afresh every
  // step, a page fault per 4 KiB (17% of a replicated sparse shard's CPU), and copied from its base.
  // A big copy that arrives whole is put together in it too (CopyStorage: it holds no known copy
  // then), and goes back to it when let go if it is empty (a dense part's copies cycle through it).
  struct SpareCopy {
    Mutex mu;
    std::unique_ptr<std::string> bytes GUARDED_BY(mu);
    std::optional<peer::LiveCopy> holds GUARDED_BY(mu);
    std::shared_ptr<const CopyBlockHashes> blocks GUARDED_BY(mu);  // of the bytes it holds
  };
  const std::shared_ptr<SpareCopy> spare_ = std::make_shared<SpareCopy>();
  // The spare's storage (and the copy it holds, with its block hashes), or a new string. `fits`
  // (non-zero): only storage of at least that capacity and at most twice it.
  std::unique_ptr<std::string> TakeSpare(std::optional<peer::LiveCopy>* holds,
                                         std::shared_ptr<const CopyBlockHashes>* blocks, uint64_t fits = 0);
  // Drops the differences of copies no longer held.
  void TrimDeltasLocked() REQUIRES(mu_);
  // `storage`, to keep: it goes back to the spare when its last holder lets go, as holding `holds`
  // (block hashes `blocks`; none: its bytes are not known as a copy). `always`: in place of the
  // spare's storage if it has one (the newest let go is the likeliest size of the next); otherwise
  // only into an empty spare.
  std::shared_ptr<std::string> ToSpareWhenLetGo(std::unique_ptr<std::string> storage,
                                                std::optional<peer::LiveCopy> holds,
                                                std::shared_ptr<const CopyBlockHashes> blocks, bool always);
  // Rebuilds `delta` (from `base`, held here) into the spare's storage.
  Status Rebuild(const std::shared_ptr<const std::string>& delta, const peer::LiveCopy& base,
                 const peer::LiveCopy& copy, HeldCopy* out, int64_t* step) EXCLUDES(mu_);
  // Takeover: the thread running the newest stand-in (it joins the one before it first), the
  // stand-in once started, how many were started, and up to which one they were asked to stop
  // (also before it started).
  std::thread stand_in_thread_ GUARDED_BY(mu_);
  Server* stand_in_ GUARDED_BY(mu_) = nullptr;
  uint64_t stand_in_started_ GUARDED_BY(mu_) = 0;
  uint64_t stand_in_stopped_ GUARDED_BY(mu_) = 0;
  bool joined_ GUARDED_BY(mu_) = false;  // Join() ran: no stand-in starts any more
};

}  // namespace psd::server

#endif  // PSD_SERVER_DAEMON_CLUSTER_HOST_H_
