// ClusterCoordinator: what makes P psd shards one parameter server (README "Running a cluster").
//
// Every shard runs one. Shards talk over one outgoing link to every other shard (one-way
// PeerMessages, never answered; see schema/psd.capnp) and learn of each other through heartbeats
// (--heartbeat-ms) and the incoming links' state.
//
// Election (terms, no preemption): a shard that has no live chief — none known, or the chief's
// link closed, or no heartbeat from it for --election-timeout-ms (a chief first heard of from
// another shard has that long to link) — and is the lowest-index live
// shard it sees, claims the chief role for term max(seen) + 1. A claim with a higher term always
// wins; within one term the lower index wins. A restarted shard listens for one election timeout
// before it may claim, so it joins the running chief instead of taking over; its heartbeats say
// so (`listening`), and meanwhile it does not count, for shards up for two election timeouts, as
// a lower-index shard that holds back their claims.
//
// Fencing: a shard acts on a chief-only message (commit, restore, seal, control) only if it comes
// from the chief of its current term (a higher term is adopted first). A deposed chief's term is
// lower than the others', so it can commit nothing: a step commits only when every shard has
// committed it at the chief's term. A stand-in and its shard's own process speak as one index and
// may each claim a term the other never heard of: every message names its process
// (ClusterOptions::incarnation), a shard follows one process per term (election.h), and its
// answers about an epoch name the process that ordered it, so a chief counts only its own.
//
// Epochs: the chief serves workers only when all P shards are live and have restored the same
// state for its epoch. Whenever that is not the case (a shard went missing, a new chief) it
// forms the cluster again: new term = new epoch, every shard restores the newest checkpoint that
// every shard can restore (or starts empty when there is none), the chief pushes the init tokens
// at that step, and only then do shards serve again. State is never thrown away silently: when
// that common step is older than some shard's newest sealed checkpoint (a shard lost its
// --checkpoint-dir, say), the chief does not form: it logs at error level which shard has which
// steps, says so in Serving() (workers: UNAVAILABLE, /readyz, psd_admin status) and waits for an
// operator's decision — Recover() (psd_admin recover) or --allow-state-loss (or --no-restore) on
// a live shard. A step that a shard holds but cannot restore (a corrupt part, a seal it missed)
// is unusable for good and skipped without asking. Losing any shard therefore rolls the whole
// cluster back to its last consistent checkpoint; no update is applied twice (workers' pushes
// carry the epoch they computed in, and another epoch's are refused ABORTED).
//
// Step commit (sync mode): each shard's engine reports its part of step s as prepared (all its
// trainable variables taken and staged; an idle shard reports at once with takes = 0). When all
// P shards reported and at least one took something, the chief sends commit(s): every shard
// publishes s + 1 (and snapshots it if it is a checkpoint step) and answers committed; when all
// did, the chief releases the step's tokens. So a worker's pull after its token sees every shard
// at the same step. The commit record (epoch, term, step) is what a later hot-standby replica of
// a shard would apply too.
//
// Soft sync (--step-deadline-ms): each shard's engine arms the deadline at its first gradient of
// a step. The first shard whose deadline passes forces its part and says so in its vote; the chief
// then orders that step forced on every shard (Control.force_step), so the cluster's deadline is
// the earliest shard's: the step commits with the gradients each part had (TF's per-part counts;
// a part nobody pushed stays as it is).
//
// Async and ssp (applies_on_arrival): there is no step commit. Every shard applies its parts of a
// push on arrival and counts the pushes it applied; the global step is the chief's count, and
// every worker's push reaches the chief (with no gradient if the chief holds none of it: the
// client sends it so), so it counts each worker step once, as TF's global_step on ps0 did. The
// staleness a shard reports is measured against its own count (equal to the chief's when every
// push covers every shard). The ssp barrier is the chief's gate (token waits go to the chief).
// Checkpoints are ordered by the chief (Control.snapshot_step = its count): each shard snapshots
// its part as it is then, so a checkpoint is a cut, not a step boundary — as TF's async
// checkpoints were. A restore sets every shard's count to the checkpoint's step.
//
// Checkpoints: parts are written by each shard to its own --checkpoint-dir; the chief collects
// their sizes and checksums and sends the seal; every shard writes the same MANIFEST. A step is
// restorable by a shard when its manifest verifies and its own part matches it. A chief does not
// form on old news: a step sealed lately, or sealed on some shards and only present on others,
// is waited for (up to three election timeouts) until every shard lists it as restorable —
// unless the chief holds it sealed and every shard holds it, sealed or with its part but not its
// manifest (it missed the seal): then the chief forms at it at once and its Restore carries the
// seal, which such a shard writes (only if its own part matches) before it restores.
//
// Terms survive restarts (ShardHost::SaveTerm/LoadTerm): an epoch is never formed twice, even
// by a cluster restarted whole. A follower keeps its vote (prepared step) until the step
// commits and sends it again to a chief that may not have had it.
//
// Replicas and takeover (--replicas-per-shard 2): each committed state is copied to the next shard
// before the chief hears it committed, formations restore those live copies (cluster/
// replication.cc), and a shard gone for --takeover-after-ms is served by a stand-in its successor
// runs, at an address the chief announces, until its own process is back (cluster/takeover.cc).
//
// Layering: the coordinator is the protocol alone. It talks to the other shards through a
// PeerNetwork (typed messages, cluster/peer_messages.h; the daemon's is net/peer_link.h), acts on
// its own shard through a ShardHost (cluster/shard_host.h), reads time from an injected clock and
// is ticked by its owner (the daemon: an Asio timer every --heartbeat-ms; the fault simulation in
// tests/server/cluster_sim_test.cc: simulated time). It runs no thread and no timer of its own,
// and includes nothing from net/, service/ or the daemon (its own CMake target, psd_cluster).
//
// Thread-safety: all methods may be called from any thread. One mutex guards the state; host
// calls and sends happen after it is released (the host calls back into the coordinator).
#ifndef PSD_SERVER_CLUSTER_COORDINATOR_H_
#define PSD_SERVER_CLUSTER_COORDINATOR_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "base/mutex.h"
#include "cluster/election.h"
#include "cluster/peer_messages.h"
#include "cluster/peer_network.h"
#include "cluster/placement.h"
#include "cluster/shard_host.h"
#include "psd/status.h"
#include "psd/tensor.h"

namespace psd::server {

// What a coordinator is configured with (the daemon fills it from its flags).
struct ClusterOptions {
  int me = 0;                          // this shard's index (--shard-index)
  std::vector<std::string> addresses;  // every shard's host:port (--cluster); its size is P
  int64_t heartbeat_ms = 100;          // how often the owner calls Tick()
  int64_t election_timeout_ms = 1000;  // a shard silent this long counts as gone
  std::string checkpoint_dir;          // "": no checkpoints (only named in logs otherwise)
  int64_t checkpoint_every_steps = 0;
  int keep_checkpoints = 3;
  uint64_t slice_bytes = 64ull << 20;  // placement: variables bigger than this are split by rows
  bool restore = true;                 // false (--no-restore): also allows state loss
  bool applies_on_arrival = false;     // --mode async/ssp: no step commit; checkpoints by Control orders
  bool allow_state_loss = false;       // --allow-state-loss
  // --replicas-per-shard 2 (sync mode): each shard's committed state is also kept by the next shard
  // (chain replication; cluster/replication.cc).
  bool replicate = false;
  uint64_t replica_chunk_bytes = 4ull << 20;  // a copy travels in pieces of this size
  uint64_t max_copy_bytes = 64ull << 30;  // a bigger copy from a peer is refused (the daemon: 4 x --max-model-bytes)
  // Takeover (cluster/takeover.cc): with replicas, a shard whose predecessor has been gone this long
  // starts a stand-in for it (ShardHost::StartStandIn) that serves its part from the copy kept
  // here; 0: never (the gone shard's process must come back).
  std::chrono::milliseconds takeover_after{0};
  bool stand_in = false;  // this coordinator is a stand-in's (it starts none itself)
  // This process among those that may serve its shard's index over time (its own process, a
  // restart of it, a stand-in): said in every message, so a shard follows one of them per term
  // (election.h). 0: a random one (the daemon); the simulation numbers its processes.
  uint64_t incarnation = 0;
  // Where this shard's links first go (a stand-in starts with the map its host knew); empty: the
  // --cluster entries. Its size is P.
  std::vector<std::string> links;
  // Give-ups (the daemon's defaults; the fault simulation shortens them).
  std::chrono::milliseconds commit_timeout{30000};      // a commit not answered by every shard
  std::chrono::milliseconds formation_timeout{120000};  // a formation not restored everywhere
  std::chrono::milliseconds final_seal_timeout{10000};  // the job's last seal, after the part is written

  int shards() const { return static_cast<int>(addresses.size()); }
};

class ClusterCoordinator : public PeerEvents {
 public:
  using Clock = std::chrono::steady_clock;
  // `host`, `network` must outlive the coordinator. `now`: the clock (steady_clock::now in the
  // daemon). `wake`: asks the owner to call Tick() soon, never inside the calling function (a
  // lost link, an operator's decision: react before the next heartbeat); may be empty.
  // `lane`: where the coordinator's actions run (applying a committed step and copying it for the
  // next shard, rebuilding a copy that came, answering waiters, sending what was decided): each
  // batch is handed over in the order it was decided, while the coordinator's lock is held, and
  // must run later, in that order, never inside the call (the daemon's is a thread of its own, so
  // a commit or a copy that takes seconds never holds back a heartbeat sent or heard, and never
  // makes a live shard look gone). Empty: each batch runs in the thread that decided it, once
  // the lock is let go (the messages of one link then wait for the actions of the one before).
  ClusterCoordinator(ClusterOptions options, ShardHost& host, PeerNetwork& network,
                     std::function<Clock::time_point()> now = &Clock::now, std::function<void()> wake = {},
                     std::function<void(std::function<void()>)> lane = {});
  ~ClusterCoordinator() override = default;

  // Scans the checkpoints (through the host). The owner then opens the links and calls Tick()
  // every heartbeat_ms.
  void Start();
  // Ignores every event from now on.
  void Stop();
  // The heartbeat: the election, the chief's duties, the job's end; sends this shard's heartbeat.
  void Tick();

  // Whether workers are served now; Unavailable with what the cluster waits for otherwise.
  Status Serving() const;
  // Where this shard serves (host:port), said in its heartbeats: set once it is bound (a stand-in's
  // port is the kernel's pick). Until then: its --cluster entry.
  void SetAddress(std::string address);
  // Where each shard is served now as this shard knows it (the chief decides): its --cluster
  // entry, or a stand-in's address after a takeover. Workers ask for it (status replies).
  std::vector<std::string> Addresses() const;
  // The host's stand-in stopped (its job ended, or it failed to start): another may start.
  void OnStandInEnded();
  // A stand-in being stopped: what it leaves its host (ShardHost::StopStandIn). `kept` (async/ssp
  // replicas): per shard's part, the newest copy this shard knows a next shard kept (what it
  // heard, and the copies of its predecessor's part its host keeps now). `held`: those copies of
  // its predecessor's part, serialized.
  StandInLeft Leaving() const;
  // How many times the host of a stopped stand-in sends each copy it kept to the stand-in's shard
  // until it acknowledges it (takeover.cc).
  static constexpr int kMaxHandBackSends = 10;
  bool is_chief() const;
  int chief() const;
  uint64_t epoch() const;

  struct View {
    int chief = -1;
    uint64_t term = 0;
    uint64_t epoch = 0;
    std::string state;
    std::vector<int> missing;
  };
  View Describe() const;

  // The PeerNetwork's events: a link from `shard` is proven / closed; a message arrived from
  // `from` (the link's proven shard, or this shard itself: the message's own sender field is not
  // trusted here).
  void OnPeerUp(int shard) override;
  void OnPeerDown(int shard) override;
  void OnMessage(int from, const peer::Message& msg) override;

  // From the engine created for `epoch` (no engine lock held).
  void OnPrepared(uint64_t epoch, int64_t step, int min_gradients, int max_gradients, int takes, bool forced);
  // From the checkpoint writer: this shard's part of checkpoint `step`, taken by the engine of
  // `epoch`, is on disk (part.shard is this shard). The chief seals only parts of its epoch.
  void OnPartWritten(uint64_t epoch, int64_t step, const peer::PartInfo& part);

  // Chief only (workers' requests).
  Result<VarPlacement> Place(const std::string& name, DType dtype, const Shape& shape, const std::string& colocate,
                             bool trainable);
  Status Placements(std::vector<VarPlacement>* out, std::vector<uint64_t>* shard_bytes) const;
  // A checkpoint at the next commit (forwarded to the chief). `timed`: from this shard's
  // --checkpoint-every-s timer, which only the chief's counts.
  void RequestCheckpoint(bool timed);
  // Async/ssp with replicas (cluster/replication.cc): `done` runs once a copy of this shard's part
  // taken after this call (so holding what the engine of `epoch` applied before it) is kept by the
  // next shard — OK — or with UNAVAILABLE once the cluster stops serving or re-forms first. A
  // push's reply waits for it: an acknowledged push is on two shards. `done` runs outside every
  // lock, on a thread of the host's or the network's (or in this call, when refused).
  void AfterReplicated(uint64_t epoch, std::function<void(const Status&)> done);
  // The requirement this shard's worker registry computes; the chief's is the cluster's.
  void SetLocalRequired(int required);
  // The chief's registry says every worker finished.
  void OnJobDone();
  // An operator's decision (psd_admin recover) while the chief refuses to form: start `empty` at
  // step 0, or restore checkpoint `step` on every shard (< 0: the newest every shard can restore).
  // Errors: UNAVAILABLE not the chief (ask it), FAILED_PRECONDITION no decision is awaited,
  // INVALID_ARGUMENT a step not every shard can restore (the message lists those that are).
  Status Recover(int64_t step, bool empty);

 private:
  using Action = std::function<void()>;
  // A batch of actions decided under the lock: handed to the lane (left empty), or left to run
  // after the lock by RunActions.
  void ToLaneLocked(std::vector<Action>* actions) REQUIRES(mu_);
  static void RunActions(std::vector<Action>* actions);
  struct Peer {
    int connections = 0;  // open incoming links from it
    Clock::time_point last_heard{};
    uint64_t term = 0;
    uint64_t epoch = 0;
    bool ready = false;
    std::vector<int64_t> sealed;
    std::vector<uint64_t> seal_digests;                // per sealed step: its manifest's (empty: not said)
    std::vector<int64_t> unusable;                     // checkpoint directories it has but cannot restore
    std::map<int64_t, peer::PartInfo> unsealed_parts;  // its own part of some of those, as on its disk
    bool allow_state_loss = false;                     // it runs with --allow-state-loss or --no-restore
    std::vector<peer::LiveCopy> own_copies;            // replication: its own committed states it keeps
    std::vector<peer::LiveCopy> held_copies;           // and its predecessor's
    Clock::time_point last_heartbeat{};
    bool listening = false;  // it restarted lately and does not claim yet
    // Takeover: its own process (at its --cluster entry) and a stand-in may both speak as it.
    Clock::time_point original_heard{};  // a heartbeat from its own process
    Clock::time_point stand_in_heard{};  // from a stand-in, at stand_in_address
    std::string stand_in_address;
  };
  // Replication: a reply to the chief (Committed, Restored) sent once the next shard acknowledged
  // this shard's copy of the state it answers for; or (to < 0) a copy taken on arrival (async/ssp),
  // whose ack answers the waiters registered before copy number `generation` began.
  // One sending of a copy on the link (SendCopy): done once its last piece went to the link, and
  // cancelled once the copy is no longer awaited (its pieces not yet sent are not).
  struct CopyStream {
    std::atomic<bool> done{false};
    std::atomic<bool> cancelled{false};
    std::atomic<Clock::rep> done_at{0};  // Clock's ticks since its epoch
  };
  struct PendingAck {
    uint64_t epoch = 0;
    peer::LiveCopy copy;
    int to = -1;
    peer::Message reply;
    std::shared_ptr<const peer::CopyBytes> bytes;  // sent again if no ack comes
    Clock::time_point sent{};
    uint64_t generation = 0;
    bool sent_whole = false;  // sent again whole at the next shard's word (once: then the timeout's)
    // The last sending: a copy is not sent again while it is still on its way out, and the wait for
    // its ack counts from its last piece; each time it is sent again the wait doubles (to 8 times).
    std::shared_ptr<CopyStream> stream = nullptr;
    int resends = 0;
  };
  // Async/ssp: a reply waiting for a copy (AfterReplicated), registered when `generation` copies
  // had begun: any later copy holds what it waits for.
  struct ArrivalWaiter {
    uint64_t generation = 0;
    std::function<void(const Status&)> done;
  };
  // Replication: a serialized copy arriving in pieces.
  struct Incoming {
    peer::LiveCopy copy;
    std::shared_ptr<std::string> bytes;  // ShardHost::CopyStorage
  };
  struct Vote {
    int takes = 0;
    int min_gradients = 0;
    int max_gradients = 0;
    bool forced = false;
  };

  // Under mu_: runs the election and the chief's duties; appends what to do after unlocking.
  void TickLocked(std::vector<Action>* actions) REQUIRES(mu_);
  // Async/ssp, the chief of a running cluster: orders a checkpoint labelled `applied` (its own
  // global step) when one is asked for or --checkpoint-every-steps says so.
  void ArrivalCheckpointLocked(int64_t applied, std::vector<Action>* actions) REQUIRES(mu_);
  bool AliveLocked(int shard, Clock::time_point now) const REQUIRES(mu_);
  // The known chief (another shard) is not alive, and has had an election timeout since this shard
  // learned of it to become so.
  bool ChiefGoneLocked(Clock::time_point now) const REQUIRES(mu_);
  std::vector<int> MissingLocked(Clock::time_point now) const REQUIRES(mu_);
  // A chief-only message from process `sender` of shard `from`: adopts a higher term; true if it
  // comes from the current term's chief (election::AcceptChiefMessage).
  bool AcceptChiefLocked(int from, uint64_t sender, uint64_t term, std::vector<Action>* actions) REQUIRES(mu_);
  // Takes the election's view (term, chief, leader) as this shard's.
  void AdoptViewLocked(const election::View& after, std::vector<Action>* actions) REQUIRES(mu_);
  // A message from process `sender` of shard `from` at `term` comes from the chief this shard
  // follows (its heartbeats, a piece of its copy: the chief's life).
  bool FromLeaderLocked(int from, uint64_t sender, uint64_t term) const REQUIRES(mu_) {
    return from == chief_ && term == term_ && election::MayLead({term_, chief_, leader_}, sender);
  }
  void BecomeFollowerLocked(std::vector<Action>* actions) REQUIRES(mu_);
  void StartFormationLocked(std::vector<Action>* actions) REQUIRES(mu_);
  // False while a checkpoint sealed lately (or sealed on some shards, only present on others) is
  // not yet known restorable on every shard.
  bool SealsSettledLocked(Clock::time_point now) REQUIRES(mu_);
  // The checkpoint steps every shard can restore: each lists it sealed, with the same manifest as
  // this shard's (SealAgreesLocked).
  std::set<int64_t> CommonStepsLocked() const REQUIRES(mu_);
  // Shard `shard` holds the same manifest of sealed step `step` as this shard, or did not say
  // (an older version; or a manifest not known on either side). Two timelines' checkpoints of one
  // step (a stand-in and the shard's own process each wrote a part, each got a seal) differ: no
  // shard set can restore it, and counting it would have a formation give up live copies for it.
  bool SealAgreesLocked(int shard, int64_t step) const REQUIRES(mu_);
  // Checkpoint `step` is restorable everywhere once its seal is sent along: this shard keeps the
  // seal (it sealed it once, or heard it from a shard that did: HearSealLocked), and every shard,
  // this one included, lists it sealed or present but unusable with the part the seal names (it
  // holds its part and missed the seal: a restart between its part and the seal; or it left the
  // seal for a formation at an older step that a later formation at this one did not reach). Not
  // if a shard already failed to restore it that way.
  bool ResealableLocked(int64_t step) const REQUIRES(mu_);
  // A peer's newest manifest (its heartbeat's newest_seal): kept if this shard holds its part of
  // that step unsealed, the very part the manifest names, so that as chief it can reseal it.
  void HearSealLocked(int from, const peer::Seal& seal) REQUIRES(mu_);
  // The step to form at (-1: empty), or nullopt when an operator must decide first (then the
  // refusal is logged once and becomes the not-serving reason).
  std::optional<int64_t> FormationStepLocked(std::vector<Action>* actions) REQUIRES(mu_);
  // Which checkpoints each shard can restore, for the logs and the refusal.
  std::string DescribeCheckpointsLocked() const REQUIRES(mu_);
  void MaybeCommitLocked(std::vector<Action>* actions) REQUIRES(mu_);
  // Has the host save term_ if it is higher than what was saved (before what the caller sends).
  void SaveTermLocked(std::vector<Action>* actions) REQUIRES(mu_);
  // A follower whose vote (this shard's prepared step) has not reached the chief it knows now
  // sends it again.
  void ResendVoteLocked(std::vector<Action>* actions) REQUIRES(mu_);
  void DegradeLocked(const std::string& why, std::vector<Action>* actions) REQUIRES(mu_);

  void HandleHeartbeat(int from, uint64_t term, uint64_t sender, const peer::Heartbeat& hb,
                       std::vector<Action>* actions) REQUIRES(mu_);
  void HandlePrepared(int from, uint64_t term, const peer::Prepared& p, std::vector<Action>* actions) REQUIRES(mu_);
  void HandleCommit(int from, uint64_t term, uint64_t sender, const peer::Commit& c, std::vector<Action>* actions)
      REQUIRES(mu_);
  void HandleCommitted(int from, uint64_t term, const peer::Committed& c, std::vector<Action>* actions) REQUIRES(mu_);
  void HandleRestore(int from, uint64_t term, uint64_t sender, const peer::Restore& r, std::vector<Action>* actions)
      REQUIRES(mu_);
  void HandleRestored(int from, uint64_t term, const peer::Restored& r, std::vector<Action>* actions) REQUIRES(mu_);
  void HandlePartWritten(int from, uint64_t term, const peer::PartWritten& p, std::vector<Action>* actions)
      REQUIRES(mu_);
  void HandleSeal(int from, uint64_t term, uint64_t sender, const peer::Seal& s, std::vector<Action>* actions)
      REQUIRES(mu_);
  void HandleControl(int from, uint64_t term, uint64_t sender, const peer::Control& c, std::vector<Action>* actions)
      REQUIRES(mu_);
  void HandleCheckpointRequest(int from, uint64_t term, const peer::CheckpointRequest&, std::vector<Action>*)
      REQUIRES(mu_);
  void RestoreDone(uint64_t epoch, int64_t step, const Status& status, std::vector<VarPlacement> placements);

  // --- replication (cluster/replication.cc) ---
  int Successor() const { return (me_ + 1) % shards_; }
  int Predecessor() const { return (me_ + shards_ - 1) % shards_; }
  // The newest (lineage, step) of which every shard's part is kept live (by the shard or the next
  // one); nullopt when a part has no copy left (or none was ever made).
  std::optional<peer::LiveCopy> LiveChoiceLocked() const REQUIRES(mu_);
  // After a commit or a restore of `epoch` reached `step`: keeps it as this shard's own copy
  // (lineage, step), ships it to the next shard and sends `reply` to `to` once that shard
  // acknowledges it.
  void ReplicateThenReply(uint64_t epoch, uint64_t lineage, int64_t step, int to, peer::Message reply);
  // Sends `bytes` (copy `copy` of `owner`) to `shard` in pieces: to keep, back for a `restore`, or
  // handed back (`hand_back`, ReplicaChunk).
  // `stream` (may be null): told when the last piece went, and stops the pieces once cancelled.
  void SendCopy(int shard, uint64_t epoch, int owner, const peer::LiveCopy& copy, bool restore,
                const std::shared_ptr<const peer::CopyBytes>& bytes, bool hand_back = false,
                std::shared_ptr<CopyStream> stream = nullptr);
  // The copy awaiting its ack is awaited no more: its sending, if still under way, stops.
  void DropAckLocked() REQUIRES(mu_);
  // Sets ack_ to `pending` (dropping one awaited before) with a fresh stream, which it returns.
  std::shared_ptr<CopyStream> AwaitAckLocked(PendingAck pending) REQUIRES(mu_);
  // Restores the live copy `copy` for `epoch`: this shard's own, or fetched from the next shard.
  void StartLiveRestoreLocked(uint64_t epoch, const peer::LiveCopy& copy, std::vector<Action>* actions) REQUIRES(mu_);
  // Has the host restore this shard's own kept copy `copy` for `epoch` (RestoreDone follows).
  void RestoreOwnCopy(uint64_t epoch, const peer::LiveCopy& copy) EXCLUDES(mu_);
  // Async/ssp: every part has a copy somewhere (its shard's own, or the next shard's).
  bool EveryPartCopiedLocked() const REQUIRES(mu_);
  // Some shard (this one, or a peer in its last heartbeat) lists a live copy.
  bool AnyCopyHeardLocked() const REQUIRES(mu_);
  // Every other shard's last heartbeat is of this shard's term or a newer one: sent once it had
  // heard of this chief, so its copies are not old news (see StartFormationLocked).
  bool CopiesOfThisTermLocked() const REQUIRES(mu_);
  // The newest state of its own part this shard published or took a commit for (own_copies_,
  // accepted_).
  peer::LiveCopy NewestOwnStateLocked() const REQUIRES(mu_);
  // Async/ssp replicas: a next shard kept `copy` of `part` (newest_heard_ keeps the newest).
  void HeardLocked(int part, const peer::LiveCopy& copy) REQUIRES(mu_);
  // Async/ssp: records the copies of its predecessor's part that shard k says it keeps, and what
  // it heard of the others (`told`, its heartbeat's kept_copies).
  void HearCopiesLocked(int k, const std::vector<peer::LiveCopy>& told) REQUIRES(mu_);
  // Async/ssp: some part's newest copy kept by the shards served now is older than one heard of
  // (kept by a process cut off now, or by a stand-in stopped since): restoring it would lose
  // pushes acknowledged on the newer one.
  bool NewestBehindLocked() const REQUIRES(mu_);
  // Async/ssp replicas (cluster/takeover.cc): records which process serves each part while this
  // shard serves workers (the chief: running; a follower: serving), or, `restored`, as soon as it
  // restored its part for epoch_ (the epoch may serve from its reply on, whether or not this shard
  // hears of it); and merges what a heartbeat says.
  void NoteServedLocked(bool restored = false) REQUIRES(mu_);
  void HearServedLocked(const std::vector<peer::PartServed>& told) REQUIRES(mu_);
  // A part served by a stand-in in the newest epoch known to have served it, whose newest copies
  // are therefore on the next shard's host alone (the stand-in ran there, and that shard's own
  // process keeps its copies), while that process is not heard now: a formation without it would
  // restore the part from older copies and lose the pushes acknowledged there. -1: none.
  int CopiesHostMissingLocked(Clock::time_point now) const REQUIRES(mu_);
  // The live copies shard k keeps of its own part / of its predecessor's (this shard's from the
  // host as of the last tick, the others' from their heartbeats).
  const std::vector<peer::LiveCopy>& OwnCopiesLocked(int k) const REQUIRES(mu_);
  const std::vector<peer::LiveCopy>& HeldCopiesLocked(int k) const REQUIRES(mu_);
  // The newest lineage of any copy this shard knows of (kept here, said kept by a shard, heard of).
  // A new epoch is numbered above it: copies are ordered by lineage, and a formation numbered
  // below a copy of an epoch formed meanwhile elsewhere (a partition; that epoch never ran) would
  // order its own timeline's newer copies below that older one.
  uint64_t NewestLineageLocked() const REQUIRES(mu_);
  // Async/ssp: restores the newest copy of this shard's part for `epoch`: its own, or the next
  // shard's when that one is newer (asked for, with its own newest, in a newest fetch).
  void StartNewestRestoreLocked(uint64_t epoch, std::vector<Action>* actions) REQUIRES(mu_);
  // Async/ssp: whether a formation from the newest copies may restore `copy` of `part`: not of an
  // epoch newer than the newest known to have served the part (one formed on the other side of a
  // partition, which never ran: its lineage would order it above the copies holding the pushes
  // acknowledged since), nor passed over by a later restore of the part (restored_copy_).
  bool RestorableLocked(int part, const peer::LiveCopy& copy) const REQUIRES(mu_);
  // Async/ssp: what the next shard answers a newest fetch of `part` with, from the copies of it
  // kept here (`held`, newest first): its newest restorable one (none: its newest), if newer than
  // the fetcher's `have` (its newest restorable one, or none). None: the fetcher restores `have`.
  std::optional<peer::LiveCopy> NewestFetchAnswerLocked(int part, const peer::LiveCopy& have,
                                                        const std::vector<peer::LiveCopy>& held) const REQUIRES(mu_);
  // Async/ssp: `epoch` served `part` (a push was taken on it, here or in a copy kept here).
  void MarkServedLocked(int part, uint64_t epoch, bool stand_in) REQUIRES(mu_);
  // Async/ssp: what a copy of the predecessor's part says (before it is kept): an epoch that served
  // it, or the copy the predecessor restored for an epoch (counted once this shard took that
  // epoch's order: TookRestoreOrderLocked).
  void NotePredecessorCopyLocked(int from, const peer::ReplicaChunk& c) REQUIRES(mu_);
  void NoteRestoredLocked(int part, uint64_t epoch, const peer::LiveCopy& copy) REQUIRES(mu_);
  void TookRestoreOrderLocked() REQUIRES(mu_);
  // Async/ssp: takes the next copy on arrival (the host snapshots the engine of `epoch` now) and
  // ships it; its ack answers the waiters it covers and starts the next one if more wait.
  void StartArrivalCopy(uint64_t epoch);
  // Answers every waiting reply with `why` (the cluster stopped serving or re-formed).
  void FailArrivalWaitersLocked(const Status& why, std::vector<Action>* actions) REQUIRES(mu_);
  void ReplicationTickLocked(Clock::time_point now, std::vector<Action>* actions) REQUIRES(mu_);
  void HandleReplicaChunk(int from, const peer::ReplicaChunk& c, std::vector<Action>* actions) REQUIRES(mu_);
  // The base a copy of lineage `lineage` taken in `epoch` may be sent as a difference from (acked_).
  std::optional<peer::LiveCopy> CopyBaseLocked(uint64_t epoch, uint64_t lineage) const REQUIRES(mu_);
  void HandleReplicaAck(int from, const peer::ReplicaAck& a, std::vector<Action>* actions) REQUIRES(mu_);
  void HandleReplicaFetch(int from, const peer::ReplicaFetch& f, std::vector<Action>* actions) REQUIRES(mu_);
  // A copy of the predecessor's part handed back whole (takeover.cc): kept unless not needed here.
  void TakeHandedBackLocked(int from, const peer::ReplicaChunk& c, std::shared_ptr<const std::string> bytes,
                            std::vector<Action>* actions) REQUIRES(mu_);
  void AddSealedLocked(int64_t step) REQUIRES(mu_);
  // Job done, the final part queued: FinishJob() once the seal is written, or final_seal_timeout
  // after the part is written (or failed) if no seal comes (a shard died meanwhile).
  void FinalSealTickLocked(Clock::time_point now, std::vector<Action>* actions) REQUIRES(mu_);
  Status NotChiefLocked() const REQUIRES(mu_);

  // A peer message from this shard at its current term.
  peer::Message MessageLocked(peer::Body body) const REQUIRES(mu_);
  // A message to the chief about this shard's epoch (prepared, committed, restored, part written):
  // addressed to the process that ordered its restore (restore_leader_), so that another process
  // of the chief's index, which the link may reach by now, does not take it as an answer to its
  // own orders.
  peer::Message ReplyLocked(peer::Body body) const REQUIRES(mu_);
  void SendTo(int shard, const peer::Message& msg);  // itself too (delivered later)
  void SendToAll(const peer::Message& msg, bool include_self);
  peer::Message HeartbeatLocked() const REQUIRES(mu_);
  const std::string& AddressOf(int shard) const REQUIRES(mu_) { return addresses_[static_cast<size_t>(shard)]; }

  // --- takeover (cluster/takeover.cc) ---
  // Any shard: starts a stand-in for the predecessor once it has been gone takeover_after.
  void TakeoverTickLocked(Clock::time_point now, std::vector<Action>* actions) REQUIRES(mu_);
  // The chief: where each shard is to be served — its own process when heard lately, else a
  // stand-in heard lately — and a formation when that changes.
  void ChiefMapLocked(Clock::time_point now, std::vector<Action>* actions) REQUIRES(mu_);
  // A live restore order chosen on old news: this shard's epoch (newer than the copy chosen),
  // running or not any more, released steps past it — as this shard knows (known_released_: the
  // tokens it pushed as chief, a commit it took, the chief's heartbeats), or as a follower's own
  // copies show.
  bool ServedPastLocked(const peer::Restore& r) const REQUIRES(mu_);
  // Two manifests of one step list the same parts (by shard: size and checksum).
  static bool SameParts(std::vector<peer::PartInfo> a, std::vector<peer::PartInfo> b);
  // A checkpoint restore order whose manifest (the chief's) lists other parts than this shard's
  // manifest of that step: the step is marked unusable here (formation.cc).
  bool ManifestDiffersLocked(const peer::Restore& r) REQUIRES(mu_);
  // Moves the sealed steps `which` picks to the unusable ones (kept newest first).
  void UnsealLocked(const std::function<bool(int64_t)>& which) REQUIRES(mu_);
  // Records this shard's part on disk of unusable step `step`: `written`, or (nullopt) the part its
  // manifest names (a sealed step being left).
  void KeepUnsealedPartLocked(int64_t step, std::optional<peer::PartInfo> written) REQUIRES(mu_);
  // Answers a restore order with a refusal (the chief forms again).
  void RefuseRestoreLocked(int from, uint64_t sender, const peer::Restore& r, const std::string& why,
                           std::vector<Action>* actions) REQUIRES(mu_);
  // Whether this shard hears the own processes (not stand-ins) of a majority of the shards lately,
  // itself included unless it is a stand-in — with an even count, half of them if shard 0's is
  // one. Two sides of a partition cannot both have it: only the side that has it may serve a part
  // away from its shard's own process (else each side could stand in for the other and serve
  // every part: two timelines, and the steps of one lost when they meet).
  bool MajorityLocked(Clock::time_point now) const REQUIRES(mu_);
  // Some part is served away from its shard's own process (by a stand-in), this one's included.
  bool StandInServesLocked() const REQUIRES(mu_);
  // A follower: a shard whose stand-in it sends to is silent (its host stopped it, or died) is
  // sent to at its own process again if that is heard, or if the chief is gone (its map is old
  // news), as the chief would decide.
  void FollowerMapLocked(Clock::time_point now, std::vector<Action>* actions) REQUIRES(mu_);
  // Sends shard `shard`'s messages to `address` from now on.
  void MoveLocked(int shard, const std::string& address, std::vector<Action>* actions) REQUIRES(mu_);
  // The map a chief sends (heartbeats, restore orders): the shards served elsewhere than their
  // --cluster entry, and where.
  std::map<int, std::string> MovedLocked() const REQUIRES(mu_);
  // Sends each other shard's messages where the chief's map `moved` says (its --cluster entry if
  // not listed).
  void FollowMapLocked(const std::map<int, std::string>& moved, std::vector<Action>* actions) REQUIRES(mu_);
  // Sends the copies the stopped stand-in kept (hand_back_) to the predecessor's own process, once
  // this shard's link goes there: those not acknowledged, again after a while (at most
  // kMaxHandBackSends times each).
  void HandBackLocked(Clock::time_point now, std::vector<Action>* actions) REQUIRES(mu_);
  // A heartbeat's takeover news: the chief's map (from the process `from` is served by: `served`),
  // the predecessor's own process back.
  void TakeoverHeartbeatLocked(int from, uint64_t term, uint64_t sender, const peer::Heartbeat& hb, bool served,
                               std::vector<Action>* actions) REQUIRES(mu_);

  const ClusterOptions options_;
  ShardHost& host_;
  PeerNetwork& network_;
  const std::function<Clock::time_point()> now_;
  const std::function<void()> wake_;
  const std::function<void(std::function<void()>)> lane_;
  const int me_;
  const uint64_t incarnation_;  // this process (ClusterOptions::incarnation, or a random one)
  const int shards_;
  const Clock::time_point started_;

  mutable Mutex mu_;
  bool stopped_ GUARDED_BY(mu_) = false;
  uint64_t term_ GUARDED_BY(mu_) = 0;
  uint64_t max_term_seen_ GUARDED_BY(mu_) = 0;
  int chief_ GUARDED_BY(mu_) = -1;
  // Which process of chief_ this shard follows in term_ (its incarnation; 0: not known yet, heard
  // of through another shard): a stand-in and its shard's own process both speak as one index,
  // and each may claim a term the other never heard of. Within a term one leads here, the first
  // that gave an order or sent its own heartbeat (election.h); it stays pinned when that chief is
  // counted gone, so the other process forms again in a higher term. This shard's own claim: itself.
  uint64_t leader_ GUARDED_BY(mu_) = 0;
  // When chief_ last changed (this shard's claim too): a chief this shard learned of from another
  // shard's heartbeat, before the chief's own link reached it, gets an election timeout to link
  // (ChiefGoneLocked); a new chief waits a while for news of every copy (StartFormationLocked).
  Clock::time_point chief_since_ GUARDED_BY(mu_);
  // The process that serves chief_ was last heard in this term then: a heartbeat, or a piece of a
  // copy of this epoch (OnMessage).
  Clock::time_point chief_heard_ GUARDED_BY(mu_);
  uint64_t epoch_ GUARDED_BY(mu_) = 0;             // the epoch this shard's engine was restored for
  bool serving_ GUARDED_BY(mu_) = false;           // the chief says the cluster runs at epoch_
  bool ready_ GUARDED_BY(mu_) = false;             // checkpoints scanned
  std::vector<int64_t> sealed_ GUARDED_BY(mu_);    // restorable checkpoint steps, newest first
  std::vector<int64_t> unusable_ GUARDED_BY(mu_);  // checkpoint steps present but not restorable
  // The manifests of this shard's sealed checkpoints (steps in sealed_, from its scan at start and
  // the seals since): a formation's restore order carries one to shards that hold their part of
  // that step but missed its seal.
  std::map<int64_t, std::vector<peer::PartInfo>> seal_parts_ GUARDED_BY(mu_);
  // This shard's own part on disk of steps not sealed here (a part written and not sealed yet, or
  // a sealed step left by a formation at an older step): a chief offers a seal along with a restore
  // order only to shards whose part it names, so an order that cannot succeed never goes out
  // (it would replace live copies on the shards that obey it first).
  std::map<int64_t, peer::PartInfo> unsealed_parts_ GUARDED_BY(mu_);
  static constexpr size_t kMaxUnsealedParts = 16;  // in a heartbeat (the newest)
  static constexpr size_t kMaxPartSteps = 64;      // steps in parts_ (HandlePartWritten)
  std::vector<Peer> peers_ GUARDED_BY(mu_);
  int required_ GUARDED_BY(mu_) = 0;  // the chief's requirement (as last heard)
  int local_required_ GUARDED_BY(mu_) = 0;
  Clock::time_point missing_since_ GUARDED_BY(mu_){};
  std::string missing_reason_ GUARDED_BY(mu_);
  bool job_done_ GUARDED_BY(mu_) = false;
  int64_t final_step_ GUARDED_BY(mu_) = -1;           // the job's last checkpoint step being written
  bool awaiting_final_seal_ GUARDED_BY(mu_) = false;  // FinishJob() once it is sealed (or timed out)
  std::optional<Clock::time_point> final_seal_deadline_ GUARDED_BY(mu_);  // set once the writer is idle
  std::optional<peer::Prepared> vote_ GUARDED_BY(mu_);  // this shard's report of the open step, until it commits
  int vote_to_ GUARDED_BY(mu_) = -1;                    // the chief it was sent to (-1: none yet, or lost)
  uint64_t restore_epoch_ GUARDED_BY(mu_) = 0;          // the newest epoch a restore was ordered for
  uint64_t restore_leader_ GUARDED_BY(mu_) = 0;         // the process that ordered it (ReplyLocked)
  uint64_t saved_term_ GUARDED_BY(mu_) = 0;             // the highest term handed to ShardHost::SaveTerm
  bool writer_busy_ GUARDED_BY(mu_) = false;            // the host's checkpoint writer, as of this tick
  int64_t applied_ GUARDED_BY(mu_) = 0;                 // async/ssp: the host's global step, as of this tick

  // Chief state, guarded by mu_.
  bool running_ GUARDED_BY(mu_) = false;  // the cluster serves at epoch_
  bool forming_ GUARDED_BY(mu_) = false;
  Clock::time_point formation_start_ GUARDED_BY(mu_){};
  int64_t formation_step_ GUARDED_BY(mu_) = -1;
  std::set<int> restored_ GUARDED_BY(mu_);
  PlacementMap placement_ GUARDED_BY(mu_);
  int64_t open_step_ GUARDED_BY(mu_) = 0;
  int64_t forced_step_ GUARDED_BY(mu_) = -1;             // sync: the last step the chief ordered forced
  int64_t arrival_checkpoint_ GUARDED_BY(mu_) = -1;      // async/ssp: the last checkpoint step ordered
  int64_t arrival_snapshot_ GUARDED_BY(mu_) = -1;        // async/ssp: the last one this shard snapshotted
  uint64_t arrival_snapshot_epoch_ GUARDED_BY(mu_) = 0;  // and the epoch it was ordered in
  int64_t commit_in_flight_ GUARDED_BY(mu_) = -1;
  Clock::time_point commit_start_ GUARDED_BY(mu_){};
  std::set<int> committed_ GUARDED_BY(mu_);
  std::map<int64_t, std::map<int, Vote>> votes_ GUARDED_BY(mu_);  // step -> shard -> its report
  bool checkpoint_next_ GUARDED_BY(mu_) = false;
  std::map<int64_t, std::map<int, peer::PartInfo>> parts_ GUARDED_BY(mu_);  // checkpoint step -> written parts
  bool moved_since_formation_ GUARDED_BY(mu_) = false;  // a shard is served elsewhere since: no seal of its parts
  // Checkpoint steps not yet restorable on every shard that may only be news in flight (sealed
  // lately, or sealed on one shard and only present on another) -> since when (SealsSettledLocked).
  std::map<int64_t, Clock::time_point> seals_pending_ GUARDED_BY(mu_);
  std::string refusal_ GUARDED_BY(mu_);              // why the chief does not form ("": it may), announced to followers
  std::optional<int64_t> decision_ GUARDED_BY(mu_);  // an operator's Recover() step (-1: empty), until the cluster runs
  // The formation's step when it sends its seal along (ResealableLocked), with the seal.
  std::optional<std::pair<int64_t, std::vector<peer::PartInfo>>> reseal_ GUARDED_BY(mu_);
  std::set<int64_t> reseal_failed_ GUARDED_BY(mu_);  // steps a shard could not restore with the seal sent

  // Replication state, guarded by mu_.
  // The latest live restores: epoch -> the copy. The restored state keeps the copy's lineage (the
  // epoch that committed it): a formation makes no new copy of the same state.
  std::map<uint64_t, peer::LiveCopy> live_restores_ GUARDED_BY(mu_);
  // The newest epoch ordered to restore a checkpoint (or to start empty) here: a new timeline, whose
  // restore dropped every copy of an older lineage (a copy handed back of one is not kept either).
  uint64_t timeline_epoch_ GUARDED_BY(mu_) = 0;
  std::vector<peer::LiveCopy> own_copies_ GUARDED_BY(mu_);  // the host's, as of the last tick or change
  // The newest state a commit this shard took will publish (lineage: the commit's epoch), which its
  // lane may not have applied yet (own_copies_ then lags).
  peer::LiveCopy accepted_ GUARDED_BY(mu_){0, -1};
  std::vector<peer::LiveCopy> held_copies_ GUARDED_BY(mu_);
  std::optional<PendingAck> ack_ GUARDED_BY(mu_);
  // The newest copy of this shard's the next shard acknowledged, in epoch `acked_epoch_`: the base
  // the next copy may be sent as a difference from (a new epoch, or a broken link to the next
  // shard, forgets it: the copy after goes whole). A copy sent again goes whole too.
  std::optional<peer::LiveCopy> acked_ GUARDED_BY(mu_);
  uint64_t acked_epoch_ GUARDED_BY(mu_) = 0;
  // (owner, restore, hand_back) -> pieces so far
  std::map<std::tuple<int, bool, bool>, Incoming> incoming_ GUARDED_BY(mu_);
  // A live restore waiting for this shard's copy from the next shard: (epoch, copy), since when.
  std::optional<std::pair<uint64_t, peer::LiveCopy>> fetch_ GUARDED_BY(mu_);
  Clock::time_point fetch_sent_ GUARDED_BY(mu_){};
  std::optional<peer::LiveCopy> live_formation_ GUARDED_BY(mu_);  // the chief's formation from live copies
  // ... from each part's newest copy (async/ssp; live_formation_ is then {0, -1}).
  bool live_newest_ GUARDED_BY(mu_) = false;
  int newest_failures_ GUARDED_BY(mu_) = 0;    // newest-copy formations failed in a row (3: checkpoints)
  bool fetch_newest_ GUARDED_BY(mu_) = false;  // fetch_ asks for the newest copy, newer than fetch_->second
  // ... and restores this one if none comes (its own newest, none of its own being restorable).
  std::optional<peer::LiveCopy> fetch_fallback_ GUARDED_BY(mu_);
  // Async/ssp: copies on arrival. How many began, whether one is being taken or awaits its ack,
  // and the replies waiting for one.
  uint64_t arrival_copies_ GUARDED_BY(mu_) = 0;
  bool arrival_copying_ GUARDED_BY(mu_) = false;
  std::vector<ArrivalWaiter> arrival_waiters_ GUARDED_BY(mu_);
  std::set<peer::LiveCopy> live_failed_ GUARDED_BY(mu_);  // copies a shard could not restore
  bool live_lost_logged_ GUARDED_BY(mu_) = false;
  bool stand_in_wait_logged_ GUARDED_BY(mu_) = false;  // no live formation through a stand-in: said once
  int64_t released_ GUARDED_BY(mu_) = -1;              // the chief: the newest step whose tokens it released
  // The newest (epoch, step) whose tokens this shard knows went out to workers: its own
  // releases as chief, the steps its engine took workers' gradients for and the commits it was
  // ordered (the tokens of that step went out), and what every shard's heartbeat says. A
  // formation from live copies older than it (in an epoch as new as the copies') would lose steps
  // workers computed on: the chief waits for newer copies.
  peer::LiveCopy known_released_ GUARDED_BY(mu_){0, -1};
  // Async/ssp: per part, the newest copy of it this shard has heard the next shard keeps
  // (HearCopiesLocked): each acknowledged push is in it or an older one. A formation through a
  // stand-in from older copies (that one was kept by a process cut off now, or a stand-in stopped
  // since) waits for the shards' own processes instead.
  std::vector<peer::LiveCopy> newest_heard_ GUARDED_BY(mu_);
  // Async/ssp replicas: per part, the newest epoch this shard knows served workers with it, and
  // whether a stand-in served it then (NoteServedLocked, and every shard's heartbeat). Such a part's
  // newest copies are on the stand-in's host alone: a formation waits for that host's own process
  // (CopiesHostMissingLocked).
  std::vector<peer::PartServed> served_ GUARDED_BY(mu_);
  // Async/ssp: per part (this shard's and its predecessor's), the newest (epoch, copy) a formation
  // restored it from; and the predecessor's restore copy of an epoch whose order has not reached
  // this shard yet (RestorableLocked, NotePredecessorCopyLocked).
  std::map<int, std::pair<uint64_t, peer::LiveCopy>> restored_copy_ GUARDED_BY(mu_);
  std::optional<std::pair<uint64_t, peer::LiveCopy>> pending_restore_ GUARDED_BY(mu_);
  int copies_host_wait_logged_ GUARDED_BY(mu_) = -1;  // the part last said to wait for its copies' host
  void KnowReleasedLocked(uint64_t epoch, int64_t step) REQUIRES(mu_) {
    known_released_ = std::max(known_released_, peer::LiveCopy{epoch, step});
  }

  // Takeover state, guarded by mu_.
  std::vector<std::string> addresses_ GUARDED_BY(mu_);                 // where each shard is served now (AddressOf)
  std::string address_ GUARDED_BY(mu_);                                // where this shard serves (SetAddress)
  std::optional<Clock::time_point> predecessor_gone_ GUARDED_BY(mu_);  // since when it is not alive
  bool stand_in_running_ GUARDED_BY(mu_) = false;                      // the host runs a stand-in for the predecessor
  // The copies of the predecessor's predecessor's part that the stopped stand-in kept, handed to
  // the predecessor's own process until it acknowledges each (HandBackLocked).
  struct HandBack {
    peer::LiveCopy copy;
    std::shared_ptr<const peer::CopyBytes> bytes;
    Clock::time_point sent{};
    int sends = 0;
  };
  std::vector<HandBack> hand_back_ GUARDED_BY(mu_);
};

}  // namespace psd::server

#endif  // PSD_SERVER_CLUSTER_COORDINATOR_H_
