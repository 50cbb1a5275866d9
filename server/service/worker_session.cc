#include "service/worker_session.h"

#include <kj/exception.h>
#include <spdlog/spdlog.h>

#include <exception>
#include <utility>

#include "cluster/coordinator.h"
#include "psd/half.h"
#include "psd/secret.h"
#include "service/peer_codec.h"
#include "service/service_host.h"
#include "service/values_segment.h"

namespace psd::server {
WorkerSession::WorkerSession(ServiceHost& host, std::shared_ptr<Connection> conn)
    : host_(host), conn_(std::move(conn)), id_(conn_->id()) {}

bool WorkerSession::Busy() {
  for (auto it = collectives_.begin(); it != collectives_.end();) {
    it = (*it)->answered() ? collectives_.erase(it) : std::next(it);
  }
  return !parked_.empty() || !collectives_.empty() || awaiting_copies_ > 0 || !unsettled_.empty();
}

void WorkerSession::HandleUseLane(uint64_t id) {
  // The lane its attach made (taken once): from the next frame on, both ways go through it.
  std::shared_ptr<wire::ShmLane> lane = shm_ ? shm_->TakeLane() : nullptr;
  Status s = lane ? conn_->UseLane(std::move(lane))
                  : FailedPrecondition("useLane without a lane: attach shared memory asking for one first");
  if (!s.ok()) return FailStream(s, id);
  host_.metrics().OnLaneUsed();
}

void WorkerSession::OnClosed() {
  ValuesRead(UINT64_MAX);  // nobody reads them through this connection any more
  pending_value_.reset();  // a value arriving in chunks: its memory and its reservation go now
  if (shm_) {
    if (host_.shm()) host_.shm()->Withdraw(id_);
    shm_->Close();  // unmapped once no request holds it
  }
  for (const auto& w : std::set<std::shared_ptr<TokenWait>>(parked_)) w->cancel(Cancelled("connection closed"));
  DropUnsettled(/*close=*/false);  // replies waiting for memory (WhenSettled): nobody to read them
  // Parked collectives: nobody to answer. Their deadline timers (which hold this session) go now;
  // a round completing later finds its reply answered.
  for (const auto& c : collectives_) c->Answer();
  collectives_.clear();
  // A push cut off by the close: its slots go (deterministic mode; they never count either way).
  if (push_unfinished_) host_.engine()->DropUnfinishedChunks(id_);
  if (peer_shard_ >= 0) host_.coordinator()->OnPeerDown(peer_shard_);
  host_.OnConnectionClosed(id_);
}

thread_local WorkerSession* WorkerSession::handling_ = nullptr;

void WorkerSession::OnFrame(const wire::InFrame& in) {
  auto self = shared_from_this();  // a close while handling (the connection lets go of its handler)
  uint64_t id = 0;
  WorkerSession* outer = std::exchange(handling_, this);
  try {
    try {
      auto reader = in.Reader();
      auto req = reader->getRoot<proto::Request>();
      id = req.getId();
      if (req.getValuesRead() != 0) ValuesRead(req.getValuesRead());
      Dispatch(req);
    } catch (const kj::Exception& e) {
      SendError(id, InvalidArgument(std::string("malformed request: ") + e.getDescription().cStr()));
    } catch (const std::bad_alloc&) {
      SendError(id, ResourceExhausted("out of memory while handling the request"));
    }
  } catch (...) {
    // Anything else, or an error reply that found no memory either: the connection closes
    // (Connection::OnBody). What the handler answered or parked is finished first (a token it
    // was given goes back once the connection is closed), and this thread serves others again.
    handling_ = outer;
    try {
      FinishInline();
    } catch (...) {
    }
    throw;
  }
  handling_ = outer;
  FinishInline();
}

void WorkerSession::FinishInline() {
  if (answered_inline_.empty() && unarmed_.empty()) return;
  // Nothing is added meanwhile (handling_ is not this session any more): the lists keep their
  // capacity for the next frame.
  std::exception_ptr first;
  // Each answered, whatever another throws (the connection then closes: Connection::OnBody); then
  // the deadlines of those still waiting.
  for (auto& a : answered_inline_) {
    try {
      FinishTokenWait(a.wait, a.status, a.token);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  for (const auto& w : unarmed_) {
    try {
      if (!w->done) ArmTokenDeadline(w);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  answered_inline_.clear();
  unarmed_.clear();
  if (first) std::rethrow_exception(first);
}

// --- dispatch ---------------------------------------------------------------------------------

void WorkerSession::Dispatch(proto::Request::Reader req) {
  uint64_t id = req.getId();
  auto which = req.which();
  if (which == proto::Request::VALUES_ACK) return;  // its valuesRead was taken (OnFrame); never answered
  if (which == proto::Request::HELLO) return HandleHello(id, req.getHello());
  if (which == proto::Request::PEER_PROOF) return HandlePeerProof(id, req.getPeerProof());
  if (which == proto::Request::PEER && peer_shard_ < 0) {
    // Before any hello, or before the proof of a peer hello, as on a worker's or observer's link.
    LogSpoof("sent a peer message on a link that is not a proven shard's");
    return FailStream(FailedPrecondition("peer messages travel only on a shard's proven peer link; closing"), id);
  }
  if (!authenticated_ && !host_.config().auth_token.empty()) {
    return SendError(id, Unauthenticated("say hello with the auth token first"));
  }
  if (!greeted()) return SendError(id, FailedPrecondition("say hello first (as a worker, an observer or a peer)"));
  if (which == proto::Request::USE_LANE) return HandleUseLane(id);
  if (which == proto::Request::PEER) {
    // Only a shard's proven peer link carries peer messages (checked above), in its own name.
    auto msg = req.getPeer();
    if (msg.getFrom() != static_cast<uint32_t>(peer_shard_)) {
      LogSpoof("(the link of shard " + std::to_string(peer_shard_) + ") sent a peer message as shard " +
               std::to_string(msg.getFrom()));
      return FailStream(InvalidArgument("a peer message's sender must be the link's shard; closing"), id);
    }
    // Never answered: peers' messages are one-way. A malformed one is dropped.
    auto decoded = PeerMessageFromWire(msg, host_.config().shards());
    if (!decoded.ok()) {
      LogSpoof("(the link of shard " + std::to_string(peer_shard_) +
               ") sent a malformed peer message: " + decoded.status().message());
      return;
    }
    return host_.coordinator()->OnMessage(peer_shard_, *decoded);
  }
  if (which == proto::Request::STATUS) return HandleStatus(id);
  if (which == proto::Request::CHECKPOINT) return HandleCheckpoint(id);              // an operator's request
  if (which == proto::Request::RECOVER) return HandleRecover(id, req.getRecover());  // an operator's too
  if (which == proto::Request::GET_PLACEMENT) return HandleGetPlacement(id);         // operators too
  if (!is_worker()) return SendError(id, FailedPrecondition("say hello first"));
  host_.metrics().OnWorkerRequest(worker_index_);
  if (which != proto::Request::FINISH || host_.coordinator() == nullptr) {
    // Restoring a checkpoint or a cluster not formed: retry later (a cluster's worker may still
    // declare itself finished).
    Status serving = host_.Serving();
    if (!serving.ok()) return SendError(id, serving);
  }
  if (pending_value_ && which != pending_value_->kind) pending_value_.reset();  // chunks come back to back
  switch (which) {
    case proto::Request::CREATE_VARIABLE:
      return HandleCreate(id, req.getCreateVariable());
    case proto::Request::PULL:
      return HandlePull(id, req.getPull());
    case proto::Request::PUSH:
      return HandlePush(id, req.getPush());
    case proto::Request::WAIT_TOKEN:
      return HandleWaitToken(id, req.getWaitToken());
    case proto::Request::FINISH:
      return HandleFinish(id);
    case proto::Request::GET_SLOT:
      return HandleGetSlot(id, req.getGetSlot());
    case proto::Request::PULL_ROWS:
      return HandlePullRows(id, req.getPullRows());
    case proto::Request::SET_LEARNING_RATE:
      return HandleSetLearningRate(id, req.getSetLearningRate());
    case proto::Request::CHECKPOINT:
      return HandleCheckpoint(id);
    case proto::Request::PLACE:
      return HandlePlace(id, req.getPlace());
    case proto::Request::REDUCE:
      return HandleReduce(id, req.getReduce());
    case proto::Request::UPDATE:
      return HandleUpdate(id, req.getUpdate());
    default:
      return SendError(id, Unimplemented("unknown request type " + std::to_string(static_cast<int>(which))));
  }
}

namespace {

void FillConfig(proto::JobConfig::Builder c, const ServerConfig& cfg, const TrainingEngine& engine) {
  const Optimizer& opt = engine.optimizer();
  c.setReplicasToAggregate(cfg.replicas_to_aggregate);
  c.setTotalReplicas(cfg.total_replicas);
  c.setTokensPerStep(cfg.tokens_per_step);
  c.setInitTokens(cfg.resolved_init_tokens);
  c.setOptimizer(opt.name());
  c.setLearningRate(engine.learning_rate());
  c.setMode(ModeName(cfg.mode));
  c.setStalenessBound(cfg.staleness_bound);
  c.setSoftSyncFraction(cfg.soft_sync_fraction);
  c.setStepDeadlineMs(cfg.step_deadline_ms);
  c.setEmaDecay(cfg.ema_decay);
  c.setReduction(cfg.reduction == Reduction::kSum ? proto::Reduction::SUM : proto::Reduction::MEAN);
  auto slots = opt.SlotNames();
  auto list = c.initSlotNames(static_cast<unsigned>(slots.size()));
  for (size_t i = 0; i < slots.size(); ++i) list.set(static_cast<unsigned>(i), slots[i]);
}

}  // namespace

void WorkerSession::HandleHello(uint64_t id, proto::Hello::Reader r) {
  if (r.getProtocolVersion() != proto::PROTOCOL_VERSION) {
    return SendError(id, FailedPrecondition("protocol version " + std::to_string(r.getProtocolVersion()) +
                                            " is not supported; this psd speaks version " +
                                            std::to_string(proto::PROTOCOL_VERSION)));
  }
  const std::string& want = host_.config().auth_token;
  // With a cluster secret a shard proves itself by it (HandlePeerProof authenticates the link), and
  // sends no token: it would hand the workers' token to whoever answers at a shard's address
  // before that one proved anything.
  const bool proves = r.getPeer() && !host_.config().cluster_secret.empty();
  if (!proves) {
    if (!want.empty() && !SecretsEqual(want, std::string_view(r.getAuthToken().cStr(), r.getAuthToken().size()))) {
      return FailStream(Unauthenticated("wrong or missing auth token (psd runs with --auth-token-file)"), id);
    }
    authenticated_ = true;
  }
  // A connection has one identity: a shard's link never becomes a worker's, nor the reverse.
  if ((greeted() || peer_claim_ >= 0) && (r.getPeer() || peer_shard_ >= 0 || peer_claim_ >= 0)) {
    if (r.getPeer()) LogSpoof("sent a second hello as a peer");
    return FailStream(FailedPrecondition("this connection already said hello; open a new one"), id);
  }
  if (r.getPeer()) return HandlePeerHello(id, r);
  if (!r.getObserver() && conn_->role() == Connection::Role::kWorker) {
    // One worker per connection: a second name here would stay "connected" after the close.
    return FailStream(FailedPrecondition("this connection already said hello as worker '" + worker_name_ +
                                         "'; a worker opens a connection of its own"),
                      id);
  }
  if (r.getObserver()) {
    // A worker's connection that says hello again as an observer keeps its worker's limits.
    if (conn_->role() == Connection::Role::kNone) conn_->set_role(Connection::Role::kObserver);
    proto::Response::Builder resp(nullptr);
    auto frame = NewReply(id, &resp);
    auto h = resp.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setGlobalStep(host_.engine()->global_step());
    FillConfig(h.initConfig(), host_.config(), *host_.engine());
    FillCluster(h, host_.engine()->epoch());
    h.setMaxFrameBytes(host_.config().max_frame_bytes);
    h.setMaxQueuedReplyBytes(host_.config().max_queued_reply_bytes);
    return Send(std::move(frame));
  }
  std::string name = r.getWorkerName();
  Status s = ValidateName(name);
  if (!s.ok()) return SendError(id, InvalidArgument("worker name: " + s.message()));
  if (host_.coordinator() == nullptr) {
    // A worker joins once the restore is done, so its hello carries the restored step (the
    // client asks again until connect_timeout_ms). A cluster's client waits for the formation.
    Status serving = host_.Serving();
    if (!serving.ok()) {
      // psd asked for the retry: the hello deadline starts again.
      conn_->RestartHelloDeadline();
      return SendError(id, serving);
    }
  }
  auto index = host_.OnHello(id_, name, r.getIncarnation());
  if (!index.ok()) return FailStream(index.status(), id);
  worker_index_ = *index;
  worker_name_ = name;
  conn_->set_role(Connection::Role::kWorker);
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  auto h = resp.initHello();
  h.setProtocolVersion(proto::PROTOCOL_VERSION);
  h.setIsChief(host_.workers().IsChief(id_));
  h.setGlobalStep(host_.engine()->global_step());
  h.setWorkerId(*index);
  FillConfig(h.initConfig(), host_.config(), *host_.engine());
  FillCluster(h, host_.engine()->epoch());
  h.setMaxFrameBytes(host_.config().max_frame_bytes);
  h.setMaxQueuedReplyBytes(host_.config().max_queued_reply_bytes);
  h.setChunkElements(TrainingEngine::kChunkElements);
  if (ShmListener* shm = host_.shm()) {
    if (!shm_) shm_ = std::make_shared<ShmSlot>();
    auto nonce = shm->Offer(id_, shm_);
    if (nonce.ok()) {
      h.setShmSocket(shm->name());
      h.setShmNonce(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(nonce->data()), nonce->size()));
      h.setConnectionId(id_);
      h.setShmMaxBytes(host_.config().shm_max_bytes);
    }
  }
  spdlog::info("worker '{}' (incarnation {}) connected as #{}{}", name, r.getIncarnation(), *index,
               h.getIsChief() ? ", chief" : "");
  Send(std::move(frame));
}

void WorkerSession::HandleCreate(uint64_t id, proto::CreateVariable::Reader r) {
  // A variable may be bigger than a frame (its gradients travel in chunks): its shape is bounded
  // by --max-model-bytes (the engine's check names it); an initial value sent with it came in
  // this frame.
  const ServerConfig& cfg = host_.config();
  auto t = wire::ReadTensor(r.getInitial(), std::max(cfg.max_frame_bytes, cfg.max_model_bytes));
  if (!t.ok()) {
    pending_value_.reset();
    return SendError(id, t.status());
  }
  std::optional<PendingValue> gathered;
  if (!r.getChunked()) pending_value_.reset();  // a create of its own: chunks before it are dropped
  if (r.getChunked()) {
    gathered = TakeChunk(id, proto::Request::CREATE_VARIABLE, r.getName(), r.getChunkOffset(), r.getChunkedShape(),
                         r.getMore(), &*t);
    if (!gathered) return;
  }
  VariableDef def;
  def.name = r.getName();
  def.dtype = t->dtype;
  def.shape = t->shape;
  def.trainable = r.getTrainable();
  def.average = r.getAverage();
  def.optimizer = r.getOptimizer();
  auto aggregation = AggregationFromNumber(static_cast<int>(r.getAggregation()));
  if (!aggregation.ok()) return SendError(id, aggregation.status());
  def.aggregation = *aggregation;
  def.sync_on_read = r.getSyncOnRead();
  if (r.hasPlacement()) {
    // One part of a cluster variable: it must be the part the placement puts on this shard.
    const ServerConfig& cfg = host_.config();
    auto placed = PlacementFromWire(r.getPlacement(), cfg.shards());
    if (!placed.ok()) return SendError(id, placed.status());
    size_t part = r.getPart();
    if (placed->name != def.name || part >= placed->parts.size() || placed->parts[part].shard != cfg.shard_index ||
        placed->dtype != def.dtype || placed->PartShape(part) != def.shape) {
      return SendError(id,
                       InvalidArgument("variable '" + def.name + "': part " + std::to_string(part) +
                                       " does not match its placement on shard " + std::to_string(cfg.shard_index)));
    }
    def.placement = std::move(*placed);
  }
  if (gathered && ComputeDType(def.dtype) == def.dtype) {
    // The gathered value becomes the variable's, not copied: a create in chunks holds the model
    // once, as a create in one frame does.
    def.adopt = std::move(gathered->value);
  } else if (t->bytes > 0) {
    def.initial = t->data;
    def.initial_bytes = t->bytes;
  }
  auto desc = host_.engine()->CreateVariable(def);
  if (!desc.ok()) return SendError(id, desc.status());
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  auto v = resp.initVariable();
  v.setName(desc->name);
  v.setDtype(wire::ToWire(desc->dtype));
  auto shape = v.initShape(static_cast<unsigned>(desc->shape.size()));
  for (size_t i = 0; i < desc->shape.size(); ++i) shape.set(static_cast<unsigned>(i), desc->shape[i]);
  v.setCreated(desc->created);
  v.setTrainable(desc->trainable);
  Send(std::move(frame));
}

Status WorkerSession::GatherChunk(proto::Request::Which kind, const std::string& name, int64_t offset,
                                  capnp::List<int64_t>::Reader chunked_shape, bool more, const wire::TensorRef& chunk,
                                  bool* complete) {
  const char* what = kind == proto::Request::CREATE_VARIABLE ? "initial value" : "update's value";
  if (pending_value_ && (pending_value_->kind != kind || pending_value_->name != name)) pending_value_.reset();
  if (!pending_value_) {
    if (offset != 0) {
      return InvalidArgument("variable '" + name + "': the first chunk of an " + what + " starts at element " +
                             std::to_string(offset) + ", not 0");
    }
    Shape shape;
    if (chunked_shape.size() > 32) return InvalidArgument("variable '" + name + "': shape rank exceeds 32");
    for (int64_t d : chunked_shape) {
      if (d < 0) return InvalidArgument("variable '" + name + "': shape has a negative dimension");
      shape.push_back(d);
    }
    // Nothing is allocated for a value that cannot be used: an update's variable must exist with
    // this shape; a new variable's value is reserved against --max-model-bytes with the others.
    auto engine = host_.engine();
    std::optional<VariableDesc> existing = engine->Describe(name);
    if (kind != proto::Request::CREATE_VARIABLE) {
      if (!existing) return NotFound("update: no variable named '" + name + "'");
      if (existing->shape != shape) {
        return InvalidArgument("update of '" + name + "': a value of shape " + ShapeString(shape) +
                               " for a variable of shape " + ShapeString(existing->shape));
      }
    } else if (existing && existing->shape != shape) {
      // (A create of an existing variable answers with it: its value is bounded by that variable.)
      return AlreadyExists("variable '" + name + "' exists as " + ShapeString(existing->shape) + "; requested " +
                           ShapeString(shape));
    }
    // Bounded as a variable is (the engine names --max-model-bytes) before anything is allocated.
    const uint64_t limit = std::max(host_.config().max_frame_bytes, host_.config().max_model_bytes);
    const size_t es = DTypeSize(chunk.dtype);
    uint64_t elements = 1;
    for (int64_t d : shape) {
      if (d != 0 && elements > limit / static_cast<uint64_t>(d))
        elements = limit + 1;
      else
        elements *= static_cast<uint64_t>(d);
    }
    if (elements > limit / es) {
      return ResourceExhausted("variable '" + name + "' " + ShapeString(shape) + " is bigger than --max-model-bytes (" +
                               std::to_string(limit) + " bytes)");
    }
    std::shared_ptr<void> reservation;
    if (kind == proto::Request::CREATE_VARIABLE && !existing) {
      auto reserved = engine->ReserveValueBytes(name, elements * es);
      if (!reserved.ok()) return reserved.status();
      reservation = std::move(*reserved);
    }
    pending_value_ = PendingValue{kind,
                                  name,
                                  chunk.dtype,
                                  std::move(shape),
                                  std::make_shared<Buffer>(elements * es, Buffer::Uninitialized{}),
                                  0,
                                  std::move(reservation)};
  }
  PendingValue& p = *pending_value_;
  const size_t es = DTypeSize(p.dtype);
  if (chunk.dtype != p.dtype || chunk.shape.size() != 1 || offset != static_cast<int64_t>(p.filled / es) ||
      chunk.bytes > p.value->bytes() - p.filled || chunk.bytes != static_cast<size_t>(chunk.shape[0]) * es) {
    return InvalidArgument("variable '" + name + "': a chunk of its " + what +
                           " does not follow the one before (name, dtype, offset and size must continue it); "
                           "send it again from the start");
  }
  if (chunk.bytes > 0) std::memcpy(static_cast<uint8_t*>(p.value->data()) + p.filled, chunk.data, chunk.bytes);
  p.filled += chunk.bytes;
  if (more) {
    *complete = false;
    return Status::Ok();
  }
  if (p.filled != p.value->bytes()) {
    return InvalidArgument("variable '" + name + "': its " + what + "'s last chunk ends at byte " +
                           std::to_string(p.filled) + " of " + std::to_string(p.value->bytes()));
  }
  *complete = true;
  return Status::Ok();
}

std::optional<WorkerSession::PendingValue> WorkerSession::TakeChunk(uint64_t id, proto::Request::Which kind,
                                                                    const std::string& name, int64_t offset,
                                                                    capnp::List<int64_t>::Reader shape, bool more,
                                                                    wire::TensorRef* t) {
  bool complete = false;
  Status s = GatherChunk(kind, name, offset, shape, more, *t, &complete);
  if (!s.ok()) {
    pending_value_.reset();
    SendError(id, s);
    return std::nullopt;
  }
  if (!complete) {
    proto::Response::Builder resp(nullptr);
    auto frame = NewReply(id, &resp);
    resp.setNone();
    Send(std::move(frame));
    return std::nullopt;
  }
  std::optional<PendingValue> whole = std::move(pending_value_);
  pending_value_.reset();
  t->dtype = whole->dtype;
  t->shape = whole->shape;
  t->data = static_cast<const uint8_t*>(whole->value->data());
  t->bytes = whole->value->bytes();
  return whole;
}

Result<wire::TensorRef> WorkerSession::ReadTensorIn(proto::Tensor::Reader t, ShmSlot::Lease* lease) const {
  if (!t.getInShm()) return wire::ReadTensor(t, host_.config().max_frame_bytes);
  if (!lease->held() && shm_) *lease = shm_->Acquire();
  wire::SharedSegment* segment = lease->segment(t.getShmSegment());
  if (segment == nullptr) {
    return FailedPrecondition(t.getShmSegment() == 0
                                  ? "a tensor in shared memory, but this connection has no segment attached"
                                  : "a tensor in shared buffers, but this connection has none attached");
  }
  if (t.getData().size() != 0) return InvalidArgument("a tensor in shared memory must not carry data in the frame");
  auto ref = wire::ReadTensor(t, segment->size(), /*in_shm_ok=*/true);
  if (!ref.ok()) return ref.status();
  const uint64_t bytes = static_cast<uint64_t>(NumElements(ref->shape)) * DTypeSize(ref->dtype);
  ref->data = segment->At(t.getShmOffset(), bytes);
  if (ref->data == nullptr) {
    return InvalidArgument("a tensor of " + std::to_string(bytes) + " bytes at offset " +
                           std::to_string(t.getShmOffset()) + " is outside this connection's shared-memory segment (" +
                           std::to_string(segment->size()) + " bytes)");
  }
  if (t.getShmOffset() % DTypeSize(ref->dtype) != 0) {
    return InvalidArgument("a tensor at shared-memory offset " + std::to_string(t.getShmOffset()) +
                           ", not a multiple of its element size");
  }
  ref->bytes = bytes;
  host_.metrics().OnShmBytes(bytes);
  return ref;
}

void WorkerSession::HandleStatus(uint64_t id) {
  EngineStats st = host_.engine()->Stats();
  WorkerCounts wc = host_.workers().Counts();
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  auto s = resp.initStatus();
  s.setGlobalStep(st.global_step);
  s.setIsChief(host_.workers().IsChief(id_));
  s.setTokensQueued(st.tokens_queued);
  s.setWorkersConnected(wc.connected);
  s.setWorkersFinished(wc.finished);
  s.setReplicasRequired(st.required_replicas);
  s.setAcceptedPushes(st.accepted);
  s.setStalePushes(st.stale);
  s.setLastStepGradients(st.last_step_gradients);
  s.setMaxStaleness(st.max_staleness);
  s.setLearningRate(host_.engine()->learning_rate());
  s.setLastCheckpointStep(host_.last_checkpoint_step());
  FillConfig(s.initConfig(), host_.config(), *host_.engine());
  FillCluster(s, host_.engine()->epoch());
  if (ClusterCoordinator* c = host_.coordinator()) {
    auto v = c->Describe();
    s.setTerm(v.term);
    s.setClusterState(v.state);
    auto missing = s.initMissingShards(static_cast<unsigned>(v.missing.size()));
    for (size_t i = 0; i < v.missing.size(); ++i)
      missing.set(static_cast<unsigned>(i), static_cast<uint32_t>(v.missing[i]));
    auto addresses = c->Addresses();
    auto list = s.initShardAddresses(static_cast<unsigned>(addresses.size()));
    for (size_t i = 0; i < addresses.size(); ++i) list.set(static_cast<unsigned>(i), addresses[i]);
  } else {
    Status serving = host_.Serving();
    s.setClusterState(serving.ok() ? "running" : serving.message());
  }
  s.setVersion(kPsdVersion);
  s.setUptimeS(host_.uptime_s());
  s.setReady(host_.Serving().ok());
  auto names = host_.workers().Names();
  auto list = s.initWorkers(static_cast<unsigned>(names.size()));
  for (size_t i = 0; i < names.size(); ++i) list.set(static_cast<unsigned>(i), names[i]);
  Send(std::move(frame));
}

void WorkerSession::HandleFinish(uint64_t id) {
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  resp.setNone();
  Send(std::move(frame));
  host_.OnWorkerFinished(id_);
}

void WorkerSession::HandleCheckpoint(uint64_t id) {
  Status s = host_.RequestCheckpoint();
  if (!s.ok()) return SendError(id, s);
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  resp.setNone();
  Send(std::move(frame));
}

void WorkerSession::HandleRecover(uint64_t id, proto::Recover::Reader r) {
  ClusterCoordinator* c = host_.coordinator();
  if (c == nullptr) {
    return SendError(id, FailedPrecondition("psd_admin recover is for a cluster whose chief waits for a decision; a "
                                            "single psd starts from its newest good checkpoint, or empty"));
  }
  Status s = c->Recover(r.getStep(), r.getEmpty());
  if (!s.ok()) return SendError(id, s);
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  resp.setNone();
  Send(std::move(frame));
}

void WorkerSession::HandleSetLearningRate(uint64_t id, double lr) {
  if (ClusterCoordinator* c = host_.coordinator(); c != nullptr && !c->is_chief()) {
    return SendError(id,
                     Unavailable("set the learning rate on the chief shard " + std::to_string(c->chief()) + "; retry"));
  }
  if (!host_.workers().IsChief(id_)) {
    return SendError(id, FailedPrecondition("only the chief worker may change the learning rate"));
  }
  Status s = host_.engine()->SetLearningRate(lr);
  if (!s.ok()) return SendError(id, s);
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  resp.setNone();
  Send(std::move(frame));
}

template <typename B>
void WorkerSession::FillCluster(B b, uint64_t engine_epoch) {
  const ServerConfig& cfg = host_.config();
  if constexpr (requires { b.setShards(0u); }) {  // push replies carry only the chief and the epoch
    b.setShardIndex(static_cast<uint32_t>(cfg.shard_index));
    b.setShards(static_cast<uint32_t>(cfg.shards()));
  }
  b.setChiefShard(host_.coordinator() ? host_.coordinator()->chief() : 0);
  b.setClusterEpoch(engine_epoch);
}
// Push replies are filled in session_push.cc.
template void WorkerSession::FillCluster(proto::PushReply::Builder b, uint64_t engine_epoch);

void WorkerSession::HandlePlace(uint64_t id, proto::Place::Reader r) {
  ClusterCoordinator* c = host_.coordinator();
  std::string name = r.getName();
  Status s = ValidateName(name);
  if (!s.ok()) return SendError(id, s);
  auto dtype = wire::FromWire(r.getDtype());
  if (!dtype.ok()) return SendError(id, dtype.status());
  Shape shape;
  for (int64_t d : r.getShape()) shape.push_back(d);
  s = ValidateShape(shape, *dtype, UINT64_MAX);
  if (!s.ok()) return SendError(id, s);
  VarPlacement placed;
  if (c == nullptr) {
    placed = {name, *dtype, shape, false, {{0, 0, shape.empty() ? 1 : shape[0]}}, r.getTrainable()};
  } else {
    auto p = c->Place(name, *dtype, shape, r.getColocateWith(), r.getTrainable());
    if (!p.ok()) return SendError(id, p.status());
    placed = std::move(*p);
  }
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  PlacementToWire(resp.initPlacement(), placed);
  Send(std::move(frame));
}

void WorkerSession::HandleGetPlacement(uint64_t id) {
  std::vector<VarPlacement> all;
  std::vector<uint64_t> bytes;
  Status placed = host_.PlacementMap(&all, &bytes);
  if (!placed.ok()) return SendError(id, placed);
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  auto m = resp.initPlacementMap();
  auto list = m.initVariables(static_cast<unsigned>(all.size()));
  for (size_t i = 0; i < all.size(); ++i) PlacementToWire(list[static_cast<unsigned>(i)], all[i]);
  auto b = m.initShardBytes(static_cast<unsigned>(bytes.size()));
  for (size_t i = 0; i < bytes.size(); ++i) b.set(static_cast<unsigned>(i), bytes[i]);
  Send(std::move(frame));
}

// --- token waits ------------------------------------------------------------------------------

int64_t WorkerSession::WaitMs(int64_t requested) const {
  if (requested <= 0) return host_.config().default_token_timeout_ms;
  return std::min(requested, kMaxWaitMs);
}

std::shared_ptr<WorkerSession::TokenWait> WorkerSession::WaitForToken(int64_t timeout_ms, TokenDone done,
                                                                      int64_t after) {
  timeout_ms = WaitMs(timeout_ms);
  std::shared_ptr<TrainingEngine> engine = host_.engine();
  Mode mode = host_.config().mode;
  if (mode == Mode::kAsync) {
    // No barrier: the "token" is the current global step.
    done(engine->tokens().closed() ? OutOfRange("training is over: all workers finished") : Status::Ok(),
         engine->global_step());
    return nullptr;
  }
  auto w = std::make_shared<TokenWait>();
  w->on_done = std::move(done);
  w->timeout_ms = timeout_ms;
  auto self = shared_from_this();
  auto post = [self, w](Status s, int64_t value) {
    // Answered inside this session's handler on this thread (only there is handling_ this
    // session): finished when it returns. From anywhere else: on the strand.
    if (handling_ == self.get()) return self->answered_inline_.push_back({w, std::move(s), value});
    asio::post(self->conn_->strand(), [self, w, s = std::move(s), value] { self->FinishTokenWait(w, s, value); });
  };
  uint64_t wid = 0;
  if (mode == Mode::kSync) {
    w->from_queue = true;
    // A step past the engine's (a push of a timeline a restore left, a daemon restarted from an
    // older checkpoint) waits for the next step's tokens, as one at the engine's step does. With
    // fewer workers than R a step's tokens outnumber the workers, and a worker takes several of
    // one step (one per batch): any token then.
    if (after >= 0) after = std::min(after, engine->global_step());
    if (host_.config().tokens_per_step > host_.config().total_replicas) after = TokenQueue::kAnyStep;
    wid = engine->tokens().Wait(post, after);
    w->cancel = [engine, wid](const Status& why) { return engine->tokens().Cancel(wid, why); };
    w->engine = engine;
  } else {
    // Bounded staleness: the barrier releases with the current global step once this worker's
    // clock is within the bound of the slowest live worker.
    SspGate& gate = host_.ssp();
    wid = gate.Advance(worker_index_, [post, engine](Status s, int64_t) { post(std::move(s), engine->global_step()); });
    w->cancel = [&gate, wid](const Status& why) { return gate.Cancel(wid, why); };
  }
  if (wid == 0) return nullptr;  // answered at once (the callback is already posted or queued)
  parked_.insert(w);
  if (handling_ == this) {
    unarmed_.push_back(w);  // armed when the handler returns, unless answered by then
  } else {
    ArmTokenDeadline(w);
  }
  return w;
}

void WorkerSession::ArmTokenDeadline(const std::shared_ptr<TokenWait>& w) {
  const int64_t timeout_ms = w->timeout_ms;
  // From when it was parked (a handler's own work before it arms does not stretch the deadline).
  w->timer.emplace(conn_->strand(), w->started + std::chrono::milliseconds(timeout_ms));
  w->timer->async_wait([self = shared_from_this(), w, timeout_ms](boost::system::error_code ec) {
    if (ec || w->done) return;
    auto engine = self->host_.engine();
    // A step held by a take or a commit that found no memory, and whose retry could not even be
    // armed: tried now (a token it releases to this wait is delivered; the cancel below fails).
    engine->RetryIfUnarmed();
    EngineStats st = engine->Stats();
    std::string what = self->host_.config().mode == Mode::kSync
                           ? "a step needs " + std::to_string(st.required_replicas) + " fresh gradient(s) per variable"
                           : "waiting for the slowest worker to come within the staleness bound";
    if (self->host_.config().mode == Mode::kSync) {
      // Which ones this daemon still waits for (a shard: its own): a variable no worker sends a
      // gradient for holds every step.
      const std::string waiting = engine->WaitingVariables();
      if (!waiting.empty()) what += "; still waiting for " + waiting;
    }
    w->cancel(DeadlineExceeded("no token within " + std::to_string(timeout_ms) + " ms (global step " +
                               std::to_string(st.global_step) + ", " + what + ")"));
  });
}

void WorkerSession::FinishTokenWait(const std::shared_ptr<TokenWait>& w, const Status& s, int64_t token) {
  if (w->done) return;
  w->done = true;
  if (w->timer) w->timer->cancel();
  parked_.erase(w);
  host_.metrics().OnTokenWait(std::chrono::duration<double>(std::chrono::steady_clock::now() - w->started).count());
  const bool holds_token = s.ok() && w->from_queue && w->engine;  // a token taken from the queue
  if (conn_->closed()) {
    // The peer is gone: a token delivered to it goes back so no other worker starves.
    if (holds_token) w->engine->tokens().PushFront(token);
    return;
  }
  const uint64_t handed = replies_handed_;
  std::string failure;
  try {
    w->on_done(s, token);
    return;
  } catch (const std::exception& e) {
    // Handed over, the reply's fate is the connection's: it gives the token back if it never
    // writes the reply whole. Not handed over: nothing was sent, and nothing may be lost.
    if (replies_handed_ != handed) {
      spdlog::error("connection {}: unexpected error after answering a token wait: {}", id_, e.what());
      return;
    }
    failure = e.what();
  }
  // The answer could not be made (out of memory: the values asked with the token, say). The token
  // goes back, and the worker hears why in a reply that carries no values, so that its call
  // neither hangs nor loses the token; if even that fails, the connection closes (the worker's
  // call fails at once and its next call reconnects).
  if (holds_token) w->engine->tokens().PushFront(token);
  spdlog::error("connection {}: no memory to answer a token wait ({}){}", id_, failure,
                holds_token ? "; its token went back to the queue" : "");
  if (s.ok()) {
    const std::string what =
        "psd ran out of memory answering this wait for the barrier (" + failure + "); " +
        (holds_token ? "the token went back to the queue: wait for it again (WaitToken), then pull the values"
                     : "the barrier had released at global step " + std::to_string(token) +
                           ": go on with that step (pull the values)");
    try {
      w->on_done(ResourceExhausted(what), token);
      return;
    } catch (const std::exception&) {
    }
  }
  conn_->CloseNow();
}

void WorkerSession::AnswerFailed(uint64_t id, const std::string& why) {
  spdlog::error("connection {}: no memory to answer request {} ({})", id_, id, why);
  try {
    SendError(id, ResourceExhausted("psd ran out of memory making the reply to this request (" + why +
                                    "); what the request did stands: read its result (a pull) rather than "
                                    "sending it again"));
  } catch (const std::exception&) {
    conn_->CloseNow();  // the worker's call fails at once; its next call reconnects
  }
}

// --- writing ----------------------------------------------------------------------------------

std::shared_ptr<wire::OutFrame> WorkerSession::NewReply(uint64_t id, proto::Response::Builder* resp) {
  auto frame = std::make_shared<wire::OutFrame>();
  *resp = frame->builder.initRoot<proto::Response>();
  resp->setId(id);
  resp->setCode(proto::Code::OK);
  return frame;
}

std::shared_ptr<wire::OutFrame> WorkerSession::ErrorReply(uint64_t id, const Status& status) {
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  resp.setCode(wire::ToWire(status.code()));
  resp.setMessage(status.message());
  return frame;
}

void WorkerSession::SendError(uint64_t id, const Status& status) {
  spdlog::debug("connection {}: request {} failed: {}", id_, id, status.ToString());
  Send(ErrorReply(id, status));
}

}  // namespace psd::server
