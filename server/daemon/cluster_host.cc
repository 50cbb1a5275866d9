#include "daemon/cluster_host.h"

#include <spdlog/spdlog.h>

#include <cstdio>
#include <fstream>
#include <new>
#include <optional>
#include <string>
#include <utility>

#include "checkpoint/checkpoint.h"
#include "checkpoint/snapshot_delta.h"
#include "cluster/coordinator.h"
#include "core/training_engine.h"
#include "daemon/server.h"
#include "psd/cluster_list.h"

namespace psd::server {

void ClusterStepCommit::OnPrepared(const PreparedStep& p) {
  coordinator_->OnPrepared(epoch_, p.step, p.min_gradients, p.max_gradients, p.takes, p.forced);
}

ServerShardHost::~ServerShardHost() { Join(); }

void ServerShardHost::Join() {
  std::thread t, s, c;
  {
    MutexLock lock(&mu_);
    joined_ = true;
    t.swap(restore_);
    c.swap(copy_);
    s.swap(stand_in_thread_);
    stand_in_stopped_ = stand_in_started_;
    if (stand_in_ != nullptr) stand_in_->RequestStop();
  }
  if (t.joinable()) t.join();
  if (s.joinable()) s.join();
  if (c.joinable()) c.join();
}

void ServerShardHost::StartStandIn(int shard, std::vector<std::string> links) {
  const ServerConfig& mine = server_.config();
  ServerConfig c = mine;
  c.shard_index = shard;
  c.stand_in = true;
  c.peer_links = std::move(links);
  c.port = 0;  // the kernel's pick, said in its heartbeats
  c.port_file.clear();
  c.listen_fd = -1;
  c.metrics_port = -1;
  c.metrics_port_file.clear();
  c.notify_socket.clear();
  c.advertise_host = ParseHostPort(mine.cluster[static_cast<size_t>(mine.shard_index)])->host;
  // Its own directory, beside this shard's checkpoints (its parts are shard `shard`'s).
  if (!c.checkpoint_dir.empty()) c.checkpoint_dir += "/stand-in-" + std::to_string(shard);
  ClusterCoordinator* coordinator = server_.coordinator();
  MutexLock lock(&mu_);
  if (joined_) return;
  const uint64_t number = ++stand_in_started_;
  std::thread before;
  before.swap(stand_in_thread_);
  stand_in_thread_ = std::thread([this, c = std::move(c), coordinator, number, before = std::move(before)]() mutable {
    if (before.joinable()) before.join();  // the last stand-in has stopped
    auto created = Server::Create(c);
    Status started = created.ok() ? (*created)->Start() : created.status();
    if (!started.ok()) {
      spdlog::error("cluster: the stand-in for shard {} did not start: {}", c.shard_index, started.message());
      coordinator->OnStandInEnded();
      return;
    }
    Server& standin = **created;
    server_.metrics().OnStandInStarted();
    {
      MutexLock lock(&mu_);
      stand_in_ = &standin;
      if (stand_in_stopped_ >= number) standin.RequestStop();
    }
    standin.Wait();
    bool asked;
    {
      MutexLock lock(&mu_);
      stand_in_ = nullptr;
      asked = stand_in_stopped_ >= number;
    }
    standin.Stop();
    server_.metrics().OnStandInStopped();
    spdlog::info("cluster: the stand-in for shard {} stopped", c.shard_index);
    if (!asked) coordinator->OnStandInEnded();
  });
}

StandInLeft ServerShardHost::StopStandIn() {
  MutexLock lock(&mu_);
  stand_in_stopped_ = stand_in_started_;
  if (stand_in_ == nullptr) return {};
  // (Its coordinator and host are its own: no lock of this host's is taken there.) Stopped first:
  // a copy it acknowledged after its copies were listed would be lost with it, while its owner
  // counts it kept.
  StandInLeft left;
  if (ClusterCoordinator* c = stand_in_->coordinator(); c != nullptr) {
    c->Stop();
    left = c->Leaving();
  }
  stand_in_->RequestStop();
  return left;
}

void ServerShardHost::WithStandIn(const std::function<void(Server&)>& fn) {
  MutexLock lock(&mu_);
  if (stand_in_ != nullptr) fn(*stand_in_);
}

Status ServerShardHost::CommitStep(uint64_t epoch, int64_t step, bool checkpoint, double learning_rate) {
  auto engine = server_.engine();
  if (engine->epoch() != epoch) return Aborted("the engine belongs to epoch " + std::to_string(engine->epoch()));
  return engine->CommitPrepared(step, checkpoint, learning_rate);
}

double ServerShardHost::learning_rate() { return server_.engine()->learning_rate(); }

void ServerShardHost::PushTokens(int64_t step) {
  server_.engine()->tokens().Push(step, server_.config().tokens_per_step);
}

void ServerShardHost::StartServing(int required) {
  auto engine = server_.engine();
  if (required > 0) engine->SetRequiredReplicas(required);
  engine->PushInitTokens(server_.config().resolved_init_tokens);
}

void ServerShardHost::SetRequired(int required) { server_.engine()->SetRequiredReplicas(required); }

void ServerShardHost::FailWaiters(const Status& why) {
  server_.engine()->tokens().FailWaiters(why);
  server_.ssp().FailWaiters(why);  // ssp barrier calls parked on this shard (the chief's gate)
}

void ServerShardHost::ReportIfIdle() { server_.engine()->ReportIfIdle(); }

void ServerShardHost::ForceStep(uint64_t epoch, int64_t step) {
  auto engine = server_.engine();
  if (engine->epoch() == epoch) engine->ForceStep(step);
}

int64_t ServerShardHost::global_step() { return server_.engine()->global_step(); }

void ServerShardHost::RaiseGlobalStep(uint64_t epoch, int64_t step) {
  auto engine = server_.engine();
  if (engine->epoch() == epoch) engine->RaiseGlobalStep(step);
}

ShardHost::CheckpointScan ServerShardHost::ScanCheckpoints() {
  const ServerConfig& config = server_.config();
  CheckpointScan scan;
  std::map<int64_t, std::vector<ManifestPart>> manifests;
  scan.sealed = RestorableSteps(config.checkpoint_dir, config.shard_index, config.shards(), &scan.unusable, &manifests);
  for (const auto& [step, parts] : manifests) {
    auto& out = scan.seals[step];
    for (const ManifestPart& p : parts) out.push_back({p.shard, p.file, p.bytes, p.checksum});
  }
  for (int64_t step : scan.unusable) {
    auto p = PeekOwnPart(config.checkpoint_dir, step, config.shard_index, config.shards());
    if (p.ok()) scan.unsealed_parts[step] = {p->shard, p->file, p->bytes, p->checksum};
  }
  return scan;
}

namespace {
std::vector<ManifestPart> ToManifest(const std::vector<peer::PartInfo>& parts) {
  std::vector<ManifestPart> manifest;
  for (const peer::PartInfo& p : parts) manifest.push_back({p.shard, p.file, p.bytes, p.checksum});
  return manifest;
}
}  // namespace

Status ServerShardHost::SealCheckpoint(int64_t step, const std::vector<peer::PartInfo>& parts) {
  const ServerConfig& config = server_.config();
  PSD_RETURN_IF_ERROR(WriteManifest(config.checkpoint_dir, step, config.shards(), ToManifest(parts)));
  server_.set_last_checkpoint_step(step);
  return Status::Ok();
}

void ServerShardHost::RestoreAsync(uint64_t epoch, int64_t step, const std::vector<peer::PartInfo>& seal,
                                   RestoreDone done) {
  MutexLock lock(&mu_);
  // A previous restore still loading finishes first (its result is for an older epoch).
  restore_ = std::thread([this, previous = std::move(restore_), epoch, step, manifest = ToManifest(seal),
                          done = std::move(done)]() mutable {
    if (previous.joinable()) previous.join();
    const ServerConfig& config = server_.config();
    if (!manifest.empty()) {
      Status sealed = SealOwnPart(config.checkpoint_dir, step, config.shard_index, config.shards(), manifest);
      if (!sealed.ok()) return done(sealed, {});
      server_.set_last_checkpoint_step(step);
    }
    std::vector<VarPlacement> placements;
    Status s = server_.RestoreEngine(epoch, step, &placements);
    done(s, std::move(placements));
  });
}

namespace {
// Keeps the newest two copies.
template <typename T>
void Trim(std::map<peer::LiveCopy, T>* copies) {
  while (copies->size() > 2) copies->erase(copies->begin());
}

uint64_t Bytes(const std::shared_ptr<const CopyBlockHashes>& blocks) {
  return blocks ? blocks->size() * sizeof(uint64_t) : 0;
}

template <typename OwnCopy>
uint64_t OwnBytes(const std::map<peer::LiveCopy, OwnCopy>& copies) {
  uint64_t n = 0;
  for (const auto& [copy, own] : copies) {
    n += Bytes(own.blocks);
    for (const VariableSnapshot& v : own.snap.variables) {
      if (v.value) n += v.value->bytes();
      if (v.shadow) n += v.shadow->bytes();
      for (const auto& [name, slot] : v.slots) n += slot ? slot->bytes() : 0;
    }
  }
  return n;
}

template <typename HeldCopy>
uint64_t HeldBytes(const std::map<peer::LiveCopy, HeldCopy>& copies) {
  uint64_t n = 0;
  for (const auto& [copy, held] : copies) n += held.bytes->size() + Bytes(held.blocks);
  return n;
}

uint64_t Bytes(const std::map<peer::LiveCopy, std::shared_ptr<const std::string>>& copies) {
  uint64_t n = 0;
  for (const auto& [copy, bytes] : copies) n += bytes->size();
  return n;
}

template <typename T>
void Keys(const std::map<peer::LiveCopy, T>& copies, std::vector<peer::LiveCopy>* out) {
  out->clear();
  for (auto it = copies.rbegin(); it != copies.rend(); ++it) out->push_back(it->first);
}
}  // namespace

void ServerShardHost::LiveCopies(std::vector<peer::LiveCopy>* own, std::vector<peer::LiveCopy>* held) {
  MutexLock lock(&mu_);
  Keys(own_, own);
  Keys(held_, held);
  uint64_t spare = 0;
  {
    MutexLock spare_lock(&spare_->mu);
    if (spare_->bytes) spare = spare_->bytes->capacity();
  }
  server_.metrics().SetReplicaKept(OwnBytes(own_), HeldBytes(held_) + Bytes(held_deltas_) + spare);  // once a heartbeat
}

std::shared_ptr<const peer::CopyBytes> ServerShardHost::KeepCopy(uint64_t epoch, const peer::LiveCopy& copy,
                                                                 std::optional<peer::LiveCopy> base) {
  auto engine = server_.engine();
  if (engine->epoch() != epoch) return nullptr;  // the cluster moved on
  // A commit kept its state; a restore's is the engine's now (no step runs before it serves).
  std::optional<ShardSnapshot> snap = engine->TakeCommitted();
  if (!snap || snap->step != copy.step) {
    try {
      snap = engine->SnapshotIfAtBoundary();  // the commit's own found no memory, or a restore's
    } catch (const std::bad_alloc&) {
      spdlog::error("cluster: cannot keep a copy of step {}: out of memory for it", copy.step);
      return nullptr;
    }
  }
  if (!snap || snap->step != copy.step) {
    spdlog::error("cluster: cannot keep a copy of step {}: the engine is at step {}", copy.step, engine->global_step());
    return nullptr;
  }
  return KeepOwn(copy, std::move(*snap), base);
}

namespace {

// `snap` serialized (`s`) in pieces that share its tensors (kept alive by the pieces).
std::shared_ptr<const peer::CopyBytes> InPieces(std::shared_ptr<const ShardSnapshot> keep, SerializedSnapshot s) {
  std::vector<peer::Blob> pieces;
  pieces.reserve(s.payload.size() + 2);
  pieces.emplace_back(std::move(s.head));
  for (const Buffer* b : s.payload) pieces.emplace_back(keep, static_cast<const char*>(b->data()), b->bytes());
  pieces.emplace_back(std::move(s.trailer));
  return std::make_shared<const peer::CopyBytes>(std::move(pieces));
}

}  // namespace

std::shared_ptr<const peer::CopyBytes> ServerShardHost::KeepOwn(const peer::LiveCopy& copy, ShardSnapshot snap,
                                                                std::optional<peer::LiveCopy> base) {
  // Every 16th copy's blocks are hashed whole as well as from the lists of changes (the check that
  // the lists miss no write: a copy is otherwise checksummed from them, as its difference is made);
  // when that copy has no base with block hashes, the next one that has is.
  constexpr uint64_t kAuditEvery = 16;
  std::optional<OwnCopy> before;
  bool audit = false;
  {
    MutexLock lock(&mu_);
    if (base) {
      if (auto it = own_.find(*base); it != own_.end()) before = it->second;  // shares the buffers
    }
    if (++own_copies_ % kAuditEvery == 0) audit_due_ = true;
    audit = audit_due_ && before && before->blocks;
    if (audit) audit_due_ = false;
  }
  auto keep = std::make_shared<const ShardSnapshot>(snap);  // shares the buffers
  ReplicaCopy r = SerializeReplicaCopy(*keep, before ? &before->snap : nullptr,
                                       before && before->blocks ? before->blocks.get() : nullptr,
                                       base ? base->lineage : 0, base ? base->step : 0, audit);
  if (audit) server_.metrics().OnReplicaAudit(r.unlisted_write);
  if (r.unlisted_write) {
    spdlog::error(
        "replication: shard {}'s state at step {} has a write that no list of changes names (a psd bug: please "
        "report it); its copy goes whole, so the next shard's copy is its bytes again",
        server_.config().shard_index, copy.step);
  }
  auto blocks = std::make_shared<const CopyBlockHashes>(std::move(r.pieces.blocks));
  std::shared_ptr<const peer::CopyBytes> bytes;
  if (!r.delta.empty()) {
    bytes = std::make_shared<const peer::CopyBytes>(std::move(r.delta));
  } else {
    bytes = InPieces(std::move(keep), std::move(r.pieces));
  }
  server_.metrics().OnReplicaSent(bytes->size());
  MutexLock lock(&mu_);
  own_[copy] = OwnCopy{std::move(snap), std::move(blocks)};  // (async: the same count again, no push between)
  Trim(&own_);
  return bytes;
}

std::shared_ptr<const peer::CopyBytes> ServerShardHost::SerializedCopy(int owner, const peer::LiveCopy& copy) {
  ShardSnapshot snap;
  {
    MutexLock lock(&mu_);
    if (owner != server_.config().shard_index) {
      auto it = held_.find(copy);
      if (it == held_.end()) return nullptr;
      server_.metrics().OnReplicaSent(it->second.bytes->size());
      const std::shared_ptr<const std::string>& kept = it->second.bytes;  // as it came
      return std::make_shared<const peer::CopyBytes>(
          std::vector<peer::Blob>{peer::Blob(kept, kept->data(), kept->size())});
    }
    auto it = own_.find(copy);
    if (it == own_.end()) return nullptr;
    snap = it->second.snap;  // shares the buffers
  }
  auto keep = std::make_shared<const ShardSnapshot>(std::move(snap));
  auto bytes = InPieces(keep, SerializeSnapshotInPieces(*keep));
  server_.metrics().OnReplicaSent(bytes->size());
  return bytes;
}

std::unique_ptr<std::string> ServerShardHost::TakeSpare(std::optional<peer::LiveCopy>* holds,
                                                        std::shared_ptr<const CopyBlockHashes>* blocks, uint64_t fits) {
  std::unique_ptr<std::string> storage;
  {
    MutexLock lock(&spare_->mu);
    const uint64_t capacity = spare_->bytes ? spare_->bytes->capacity() : 0;
    if (fits == 0 || (capacity >= fits && capacity / 2 <= fits)) {
      storage = std::move(spare_->bytes);
      *holds = storage ? spare_->holds : std::nullopt;
      *blocks = storage ? std::move(spare_->blocks) : nullptr;
      spare_->holds.reset();
      spare_->blocks.reset();
    }
  }
  if (!storage) storage = std::make_unique<std::string>();
  return storage;
}

std::shared_ptr<std::string> ServerShardHost::ToSpareWhenLetGo(std::unique_ptr<std::string> storage,
                                                               std::optional<peer::LiveCopy> holds,
                                                               std::shared_ptr<const CopyBlockHashes> blocks,
                                                               bool always) {
  return std::shared_ptr<std::string>(storage.release(), [spare = std::weak_ptr<SpareCopy>(spare_), holds,
                                                          blocks = std::move(blocks), always](std::string* p) mutable {
    std::unique_ptr<std::string> owned(p);
    if (auto s = spare.lock()) {
      MutexLock lock(&s->mu);
      if (!always && s->bytes) return;
      s->bytes = std::move(owned);
      s->holds = holds;
      s->blocks = std::move(blocks);
    }
  });
}

std::shared_ptr<std::string> ServerShardHost::CopyStorage(uint64_t bytes) {
  constexpr uint64_t kKeptFrom = 16ull << 20;  // a difference of a sparse step is smaller
  if (bytes < kKeptFrom) return ShardHost::CopyStorage(bytes);
  // Not the storage of a bigger part's copies (a rebuild needs it next); the copy it held is gone.
  std::optional<peer::LiveCopy> holds;
  std::shared_ptr<const CopyBlockHashes> blocks;
  std::unique_ptr<std::string> storage = TakeSpare(&holds, &blocks, bytes);
  storage->clear();
  storage->reserve(std::min<uint64_t>(bytes, 256ull << 20));
  return ToSpareWhenLetGo(std::move(storage), std::nullopt, nullptr, /*always=*/false);
}

Status ServerShardHost::Rebuild(const std::shared_ptr<const std::string>& delta, const peer::LiveCopy& base,
                                const peer::LiveCopy& copy, HeldCopy* out, int64_t* step) {
  HeldCopy from;
  std::map<peer::LiveCopy, std::shared_ptr<const std::string>> deltas;
  {
    MutexLock lock(&mu_);
    if (auto it = held_.find(base); it != held_.end()) from = it->second;
    deltas = held_deltas_;
  }
  if (!from.bytes) {
    return FailedPrecondition("the copy is a difference from step " + std::to_string(base.step) +
                              ", which this shard does not keep");
  }
  std::optional<peer::LiveCopy> holds;
  std::shared_ptr<const CopyBlockHashes> holds_blocks;
  std::unique_ptr<std::string> storage = TakeSpare(&holds, &holds_blocks);
  // The differences from the copy the spare still holds to the base, newest first, then replayed
  // over it in order with the new one.
  std::vector<const std::string*> chain{delta.get()};
  peer::LiveCopy at = base;
  while (holds && at != *holds && chain.size() <= deltas.size()) {
    auto it = deltas.find(at);
    if (it == deltas.end()) break;
    chain.push_back(it->second.get());
    uint64_t lineage = 0;
    int64_t prior = 0;
    IsSnapshotDelta(*it->second, &lineage, &prior);
    at = peer::LiveCopy{lineage, prior};
  }
  // Only the blocks the differences write are hashed anew: the others are the spare's (or the
  // base's) blocks, whose hashes came with them.
  CopyBlockHashes blocks;
  Status s = FailedPrecondition("no chain of differences from the spare copy");
  if (holds && at == *holds) {
    std::reverse(chain.begin(), chain.end());
    s = ReplaySnapshotDeltas(chain, storage.get(), step, holds_blocks.get(), &blocks);
  }
  // Otherwise (or when that did not give the owner's copy): the base copied, the runs written over.
  const bool replayed = s.ok();
  if (!replayed) {
    PSD_RETURN_IF_ERROR(ApplySnapshotDelta(*from.bytes, *delta, storage.get(), step, from.blocks.get(), &blocks));
  }
  server_.metrics().OnReplicaRebuilt(replayed);
  out->blocks = std::make_shared<const CopyBlockHashes>(std::move(blocks));
  out->bytes = ToSpareWhenLetGo(std::move(storage), copy, out->blocks, /*always=*/true);
  return Status::Ok();
}

Status ServerShardHost::TakeCopy(int owner, const peer::LiveCopy& copy, std::shared_ptr<const std::string> bytes) {
  server_.metrics().OnReplicaReceived(bytes->size());
  if (owner != server_.config().shard_index) {
    uint64_t base_lineage = 0;
    int64_t base_step = 0, step = -1;
    std::shared_ptr<const std::string> delta;
    HeldCopy held;
    if (IsSnapshotDelta(*bytes, &base_lineage, &base_step)) {
      // The difference from a copy kept here: the whole copy is rebuilt from it (and checked
      // against the checksum of its owner's state).
      delta = std::move(bytes);
      PSD_RETURN_IF_ERROR(Rebuild(delta, peer::LiveCopy{base_lineage, base_step}, copy, &held, &step));
    } else {
      CopyBlockHashes blocks;
      PSD_RETURN_IF_ERROR(VerifySerializedSnapshot(*bytes, &step, &blocks));
      held = HeldCopy{std::move(bytes), std::make_shared<const CopyBlockHashes>(std::move(blocks))};
    }
    // The predecessor's: kept as it came (parsed only if it is ever restored, by its owner).
    if (step != copy.step) {
      return InvalidArgument("the copy holds step " + std::to_string(step) + ", not " + std::to_string(copy.step));
    }
    MutexLock lock(&mu_);
    held_[copy] = std::move(held);
    if (delta) {
      held_deltas_[copy] = std::move(delta);
    } else {
      held_deltas_.erase(copy);
    }
    Trim(&held_);
    TrimDeltasLocked();
    return Status::Ok();
  }
  ShardSnapshot snap;
  PSD_RETURN_IF_ERROR(ParseSnapshot(*bytes, &snap));
  if (snap.step != copy.step) {
    return InvalidArgument("the copy holds step " + std::to_string(snap.step) + ", not " + std::to_string(copy.step));
  }
  MutexLock lock(&mu_);
  // Its own part, fetched back to be restored: its newer copies are of steps the formation leaves
  // (async: passed over, ClusterCoordinator::RestorableLocked), and must not trim this one out.
  own_.erase(own_.upper_bound(copy), own_.end());
  own_[copy] = OwnCopy{std::move(snap), nullptr};
  Trim(&own_);
  return Status::Ok();
}

void ServerShardHost::DropCopies(std::optional<peer::LiveCopy> newest, uint64_t epoch) {
  MutexLock lock(&mu_);
  auto [own_first, own_last] = LeftCopies(own_, newest, epoch);
  own_.erase(own_first, own_last);
  auto [held_first, held_last] = LeftCopies(held_, newest, epoch);
  held_.erase(held_first, held_last);
  TrimDeltasLocked();
}

void ServerShardHost::TrimDeltasLocked() {
  for (auto it = held_deltas_.begin(); it != held_deltas_.end();) {
    it = held_.count(it->first) != 0 ? std::next(it) : held_deltas_.erase(it);
  }
}

void ServerShardHost::RestoreCopyAsync(uint64_t epoch, const peer::LiveCopy& copy, RestoreDone done) {
  MutexLock lock(&mu_);
  auto it = own_.find(copy);
  if (it == own_.end()) {
    // Later, never inside this call (the coordinator's contract).
    restore_ = std::thread([previous = std::move(restore_), copy, done = std::move(done)]() mutable {
      if (previous.joinable()) previous.join();
      done(NotFound("this shard keeps no copy of step " + std::to_string(copy.step)), {});
    });
    return;
  }
  restore_ = std::thread(
      [this, previous = std::move(restore_), epoch, snap = it->second.snap, done = std::move(done)]() mutable {
        if (previous.joinable()) previous.join();
        std::vector<VarPlacement> placements;
        Status s = server_.RestoreEngine(epoch, snap.step, &placements, &snap);
        done(s, std::move(placements));
      });
}

void ServerShardHost::KeepCopyNowAsync(uint64_t epoch, std::optional<peer::LiveCopy> base, CopyDone done) {
  {
    MutexLock lock(&mu_);
    if (!joined_) {
      copy_ = std::thread([this, previous = std::move(copy_), epoch, base, done = std::move(done)]() mutable {
        if (previous.joinable()) previous.join();
        auto engine = server_.engine();
        std::optional<ShardSnapshot> snap;
        if (engine->epoch() == epoch) snap = engine->SnapshotIfAtBoundary();  // async/ssp: always one
        if (!snap) return done(std::nullopt, nullptr);
        const peer::LiveCopy copy{epoch, snap->step};
        auto bytes = KeepOwn(copy, std::move(*snap), base);
        done(copy, std::move(bytes));
      });
      return;
    }
  }
  done(std::nullopt, nullptr);  // stopped: no thread that Join() would not wait for
}

Status ServerShardHost::SnapshotAs(uint64_t epoch, int64_t step) {
  auto engine = server_.engine();
  if (engine->epoch() != epoch) return Aborted("the engine belongs to epoch " + std::to_string(engine->epoch()));
  std::optional<ShardSnapshot> snap = engine->SnapshotIfAtBoundary();  // async/ssp: always a snapshot
  if (!snap) return FailedPrecondition("no snapshot between steps");
  snap->step = step;
  server_.QueueSnapshot(std::move(*snap));
  return Status::Ok();
}

bool ServerShardHost::CheckpointWriterBusy() { return server_.CheckpointWriterBusy(); }

namespace {
std::string TermFile(const ServerConfig& config) { return config.checkpoint_dir + "/cluster-term"; }
}  // namespace

uint64_t ServerShardHost::LoadTerm() {
  const ServerConfig& config = server_.config();
  if (config.checkpoint_dir.empty()) return 0;
  std::ifstream in(TermFile(config));
  uint64_t term = 0;
  if (!(in >> term)) return 0;
  if (term >= peer::kMaxTerm) {
    // Never a real one (an old release adopted what a faulty peer said): ignored, or no term after it could be formed.
    spdlog::warn("cluster: {} holds term {}, beyond any election count; starting from term 0", TermFile(config), term);
    return 0;
  }
  return term;
}

void ServerShardHost::SaveTerm(uint64_t term) {
  const ServerConfig& config = server_.config();
  if (config.checkpoint_dir.empty()) return;
  // Durably: a power loss must not bring an older term back, or an epoch could be formed twice.
  const std::string path = TermFile(config);
  Status s = WriteFileDurably(path, path + ".tmp", std::to_string(term) + "\n");
  if (!s.ok()) {
    spdlog::warn("cluster: cannot save the term in {} ({}); a restart of every shard may form a term again", path,
                 s.message());
  }
}

bool ServerShardHost::EndTraining(int64_t snapshot_step) {
  auto engine = server_.engine();
  engine->tokens().Close(OutOfRange("training is over: all workers finished"));
  std::optional<ShardSnapshot> snap;
  if (snapshot_step >= 0) snap = engine->SnapshotIfAtBoundary();
  if (!snap) return false;
  // Async/ssp: each shard counts the pushes it applied; the checkpoint is the chief's step.
  if (server_.config().mode != Mode::kSync) snap->step = snapshot_step;
  if (snap->step != snapshot_step) return false;
  server_.QueueSnapshot(std::move(*snap));
  return true;
}

void ServerShardHost::FinishJob() { server_.FinishJob(); }

void ServerShardHost::EndJobIfDone() { server_.EndJobIfDone(); }

}  // namespace psd::server
