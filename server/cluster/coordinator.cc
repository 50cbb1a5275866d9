#include "cluster/coordinator.h"

#include <capnp/serialize.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <deque>

#include "cluster/election.h"
#include "cluster/peer_auth.h"
#include "net/byte_stream.h"
#include "daemon/server.h"
#include "core/training_engine.h"

namespace psd::server {

namespace {

// A message as immutable bytes: one serialized copy can go to several links at once (an OutFrame
// cannot: its segment table is rebuilt by every write). Peer messages are small.
using Bytes = std::shared_ptr<const kj::Array<capnp::word>>;

Bytes Flatten(const std::shared_ptr<wire::OutFrame>& frame) {
  return std::make_shared<const kj::Array<capnp::word>>(capnp::messageToFlatArray(frame->builder));
}

}  // namespace

// An outgoing link to one other shard: connects (and reconnects every 100 ms while it is down),
// says hello as a peer, then writes messages in order. Messages given while the link is down
// are dropped: the receiver has seen the link close and counts this shard as gone anyway.
// With a cluster secret the hello carries a challenge: the other side's reply must prove it
// knows the secret and is the shard dialed, this side's proof follows, and only then are the
// messages given meanwhile written (cluster/peer_auth.h). Later replies (errors) are read and
// discarded; a read error is how a dead peer is noticed. All members are touched on the
// link's strand.
class PeerLink : public std::enable_shared_from_this<PeerLink> {
 public:
  struct Identity {
    std::string auth_token;      // the workers' token (psd checks it in every hello)
    std::string cluster_secret;  // empty: no challenge
    uint32_t me = 0;
    uint32_t target = 0;
    uint32_t shards = 0;
  };

  // `tls` null: plain TCP; else the shard's client context (verifies the other shard's certificate
  // against --tls-ca-file and the host of `address`, presents this shard's).
  PeerLink(asio::io_context& io, std::string address, Identity id, std::shared_ptr<wire::ssl::context> tls)
      : strand_(asio::make_strand(io)),
        tls_(std::move(tls)),
        resolver_(strand_),
        retry_(strand_),
        address_(std::move(address)),
        id_(std::move(id)),
        log_(1, std::chrono::seconds(30)) {}

  void Start() {
    asio::dispatch(strand_, [self = shared_from_this()] { self->Connect(); });
  }

  void Send(Bytes frame) {
    asio::dispatch(strand_, [self = shared_from_this(), frame = std::move(frame)] {
      if (!self->up_ || self->stopped_) return;
      if (self->queue_.size() > 4096) return;  // a peer that reads nothing: it will be seen as gone
      self->queue_.push_back(frame);
      if (!self->writing_) self->WriteNext();
    });
  }

  // Stops reconnecting; closes once the queue is written (bounded by the caller's wait).
  void Stop() {
    asio::dispatch(strand_, [self = shared_from_this()] {
      self->stopped_ = true;
      self->retry_.cancel();
      if (self->handshaking_) {  // nothing was sent yet that the other side would act on
        self->handshaking_ = false;
        self->writing_ = false;
        self->Close();
      } else if (!self->writing_) {
        self->Close();
      }
    });
  }

  bool idle() const { return !writing_.load(); }

 private:
  Bytes Hello(const std::string& nonce) const {
    auto hello = std::make_shared<wire::OutFrame>();
    auto req = hello->builder.initRoot<proto::Request>();
    req.setId(0);
    auto h = req.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setWorkerName("shard-" + std::to_string(id_.me));
    h.setAuthToken(id_.auth_token);
    h.setPeer(true);
    h.setShardIndex(id_.me);
    h.setClusterSize(id_.shards);
    if (!nonce.empty()) h.setPeerNonce(kj::arrayPtr(reinterpret_cast<const kj::byte*>(nonce.data()), nonce.size()));
    return Flatten(hello);
  }

  void Connect() {
    if (stopped_) return;
    size_t colon = address_.rfind(':');
    resolver_.async_resolve(
        address_.substr(0, colon), address_.substr(colon + 1),
        [self = shared_from_this()](boost::system::error_code ec, tcp::resolver::results_type results) {
          if (ec) return self->Retry();
          self->stream_ = std::make_shared<ByteStream>(tcp::socket(self->strand_), self->tls_);
          asio::async_connect(
              self->stream_->lowest(), results,
              [self, stream = self->stream_](boost::system::error_code ec, const tcp::endpoint&) {
                if (ec) return self->Retry();
                boost::system::error_code ignored;
                self->stream_->lowest().set_option(tcp::no_delay(true), ignored);
                if (self->stream_->tls()) {
                  Status s = wire::SetTlsServerName(self->stream_->tls_stream(),
                                                    self->address_.substr(0, self->address_.rfind(':')));
                  if (!s.ok()) {
                    spdlog::error("peer link to {}: {}", self->address_, s.message());
                    return self->Retry();
                  }
                }
                self->stream_->async_handshake(
                    wire::ssl::stream_base::client,
                    asio::bind_executor(self->strand_, [self, stream](const boost::system::error_code& ec) {
                      if (ec) {
                        self->LogHandshakeError(ec);
                        return self->Retry();
                      }
                      self->up_ = true;
                      if (self->id_.cluster_secret.empty()) {
                        self->queue_.push_front(self->Hello(""));
                        self->WriteNext();
                        return self->ReadLoop();
                      }
                      self->StartHandshake();
                    }));
              });
        });
  }

  // With a cluster secret: hello with a challenge, then the reply (bounded in size and time).
  void StartHandshake() {
    auto nonce = peer_auth::NewNonce();
    if (!nonce.ok()) return Fail(nonce.status().message());
    nonce_ = *nonce;
    handshaking_ = true;
    writing_ = true;  // messages given meanwhile wait in the queue
    retry_.expires_after(kHandshakeTimeout);
    retry_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (!ec && self->handshaking_) self->Fail("no answer to the peer hello within 5 s");
    });
    Bytes hello = Hello(nonce_);
    asio::async_write(*stream_, asio::buffer(hello->begin(), hello->size() * sizeof(capnp::word)),
                      [self = shared_from_this(), hello, stream = stream_](boost::system::error_code ec, size_t) {
                        if (ec) return self->Fail("cannot send the hello: " + ec.message());
                        self->ReadReplyHeader();
                      });
  }

  void ReadReplyHeader() {
    asio::async_read(*stream_, asio::buffer(first_, sizeof(first_)),
                     [self = shared_from_this(), stream = stream_](boost::system::error_code ec, size_t) {
                       if (ec) return self->Fail("no answer to the hello: " + ec.message());
                       uint32_t count = 0;
                       size_t rest = 0;
                       Status s = wire::ParseFirstWord(self->first_, &count, &rest);
                       if (!s.ok()) return self->Fail(s.message());
                       self->table_.assign(1 + rest / 4, 0);
                       self->table_[0] = self->first_[1];
                       asio::async_read(*stream, asio::buffer(self->table_.data() + 1, rest),
                                        [self, count, stream](boost::system::error_code ec, size_t) {
                                          if (ec) return self->Fail("no answer to the hello: " + ec.message());
                                          self->ReadReplyBody(count);
                                        });
                     });
  }

  void ReadReplyBody(uint32_t count) {
    std::vector<uint32_t> sizes;
    uint64_t total = 0;
    Status s = wire::ParseSegmentSizes(table_.data(), count, kMaxReplyBytes, &sizes, &total);
    if (!s.ok()) return Fail(s.message());
    capnp::word* body = in_.Prepare(sizes, total);
    asio::async_read(*stream_, asio::buffer(body, total * sizeof(capnp::word)),
                     [self = shared_from_this(), stream = stream_](boost::system::error_code ec, size_t) {
                       if (ec) return self->Fail("no answer to the hello: " + ec.message());
                       std::string why;
                       try {
                         auto reader = self->in_.Reader();
                         why = self->CheckReply(reader->getRoot<proto::Response>());
                       } catch (const kj::Exception& e) {
                         why = std::string("a malformed reply: ") + e.getDescription().cStr();
                       }
                       if (!why.empty()) return self->Fail(why);
                       self->handshaking_ = false;
                       self->retry_.cancel();
                       self->queue_.push_front(self->proof_);
                       self->WriteNext();
                       self->ReadLoop();
                     });
  }

  // The acceptor's answer: "" when it proved it is shard `target` of this cluster (and proof_ is
  // this side's answer), else why not.
  std::string CheckReply(proto::Response::Reader r) {
    if (r.getCode() != proto::Code::OK) return "it refused the hello: " + std::string(r.getMessage().cStr());
    if (r.which() != proto::Response::HELLO) return "it answered the hello with something else";
    auto h = r.getHello();
    if (h.getShardIndex() != id_.target || h.getShards() != id_.shards) {
      return "it says it is shard " + std::to_string(h.getShardIndex()) + " of " + std::to_string(h.getShards());
    }
    auto nonce = h.getPeerNonce();
    auto proof = h.getPeerProof();
    if (nonce.size() != peer_auth::kNonceBytes || proof.size() != peer_auth::kProofBytes) {
      return "it answered without a proof (does it run with the same --cluster-secret-file?)";
    }
    std::string theirs(reinterpret_cast<const char*>(nonce.begin()), nonce.size());
    peer_auth::Transcript t{id_.shards, id_.me, id_.target, nonce_, theirs};
    std::string_view got(reinterpret_cast<const char*>(proof.begin()), proof.size());
    if (!peer_auth::Verify(id_.cluster_secret, peer_auth::Role::kAcceptor, t, got)) {
      return "its proof is wrong: it does not know this cluster's secret (the same --cluster-secret-file on every "
             "shard?)";
    }
    std::string mine = peer_auth::Proof(id_.cluster_secret, peer_auth::Role::kDialer, t);
    auto frame = std::make_shared<wire::OutFrame>();
    auto req = frame->builder.initRoot<proto::Request>();
    req.setId(0);
    req.setPeerProof(kj::arrayPtr(reinterpret_cast<const kj::byte*>(mine.data()), mine.size()));
    proof_ = Flatten(frame);
    return "";
  }

  void Fail(const std::string& why) {
    if (!up_) return;  // already closed (the deadline and a failed read both end here)
    handshaking_ = false;
    writing_ = false;
    if (!stopped_ && log_.Allow() >= 0) {
      spdlog::warn("cluster: the link to shard {} ({}) is not trusted: {}; retrying", id_.target, address_, why);
    }
    Retry();
  }

  void Retry() {
    Close();
    if (stopped_) return;
    retry_.expires_after(std::chrono::milliseconds(100));
    retry_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (!ec) self->Connect();
    });
  }

  void Close() {
    up_ = false;
    queue_.clear();
    if (stream_) stream_->Close();
  }

  // A TLS failure is a configuration error: say so once per cause, not every 100 ms.
  void LogHandshakeError(const boost::system::error_code& ec) {
    std::string text = wire::TlsErrorText(ec);
    if (text == last_tls_error_) return;
    last_tls_error_ = text;
    spdlog::error("peer link to {}: TLS handshake failed: {}", address_, text);
  }

  void ReadLoop() {
    stream_->async_read_some(asio::buffer(scratch_),
                             asio::bind_executor(strand_, [self = shared_from_this(), stream = stream_](
                                                              boost::system::error_code ec, size_t) {
                               if (ec) {
                                 if (self->up_) self->Retry();
                                 return;
                               }
                               self->ReadLoop();
                             }));
  }

  void WriteNext() {
    if (queue_.empty() || !up_) {
      writing_ = false;
      if (stopped_) Close();
      return;
    }
    writing_ = true;
    auto frame = queue_.front();
    asio::async_write(*stream_, asio::buffer(frame->begin(), frame->size() * sizeof(capnp::word)),
                      asio::bind_executor(strand_, [self = shared_from_this(), frame, stream = stream_](
                                                       boost::system::error_code ec, size_t) {
                        if (!self->queue_.empty()) self->queue_.pop_front();
                        if (ec) {
                          self->writing_ = false;
                          if (self->up_) self->Retry();
                          return;
                        }
                        self->WriteNext();
                      }));
  }

  static constexpr auto kHandshakeTimeout = std::chrono::seconds(5);
  static constexpr uint64_t kMaxReplyBytes = 64 << 10;  // a hello reply is far smaller

  asio::strand<asio::io_context::executor_type> strand_;
  const std::shared_ptr<wire::ssl::context> tls_;
  // A fresh one per connection attempt (TLS state cannot be reused); pending operations' handlers
  // hold theirs until they have run.
  std::shared_ptr<ByteStream> stream_;
  std::string last_tls_error_;
  tcp::resolver resolver_;
  asio::steady_timer retry_;  // the reconnect delay, and the handshake's deadline
  const std::string address_;
  const Identity id_;
  peer_auth::LogLimiter log_;
  std::deque<Bytes> queue_;
  std::atomic<bool> writing_{false};
  bool up_ = false;
  bool stopped_ = false;
  bool handshaking_ = false;
  std::string nonce_;  // this side's challenge on the current connection
  Bytes proof_;        // this side's answer, once the other side proved itself
  uint32_t first_[2] = {0, 0};
  std::vector<uint32_t> table_;
  wire::InFrame in_;
  char scratch_[4096];
};

namespace {

void ToWire(proto::VariablePlacement::Builder b, const VarPlacement& p) {
  b.setName(p.name);
  b.setDtype(wire::ToWire(p.dtype));
  auto shape = b.initShape(static_cast<unsigned>(p.shape.size()));
  for (size_t i = 0; i < p.shape.size(); ++i) shape.set(static_cast<unsigned>(i), p.shape[i]);
  b.setSliced(p.sliced);
  b.setTrainable(p.trainable);
  auto parts = b.initParts(static_cast<unsigned>(p.parts.size()));
  for (size_t i = 0; i < p.parts.size(); ++i) {
    parts[static_cast<unsigned>(i)].setShard(static_cast<uint32_t>(p.parts[i].shard));
    parts[static_cast<unsigned>(i)].setRowBegin(p.parts[i].row_begin);
    parts[static_cast<unsigned>(i)].setRowEnd(p.parts[i].row_end);
  }
}

}  // namespace

Result<VarPlacement> PlacementFromWire(proto::VariablePlacement::Reader r, int shards) {
  VarPlacement p;
  p.name = r.getName();
  PSD_RETURN_IF_ERROR(ValidateName(p.name));
  auto dtype = wire::FromWire(r.getDtype());
  if (!dtype.ok()) return dtype.status();
  p.dtype = *dtype;
  if (r.getShape().size() > 32) return InvalidArgument("placement shape rank exceeds 32");
  for (int64_t d : r.getShape()) {
    if (d < 0) return InvalidArgument("placement shape has a negative dimension");
    p.shape.push_back(d);
  }
  p.sliced = r.getSliced();
  p.trainable = r.getTrainable();
  if (r.getParts().size() == 0 || static_cast<int>(r.getParts().size()) > shards) {
    return InvalidArgument("placement of '" + p.name + "' needs 1 to " + std::to_string(shards) + " parts");
  }
  int64_t rows = p.shape.empty() ? 1 : p.shape[0];
  int64_t next = 0;
  for (auto part : r.getParts()) {
    SlicePart s{static_cast<int>(part.getShard()), part.getRowBegin(), part.getRowEnd()};
    if (s.shard < 0 || s.shard >= shards) return InvalidArgument("placement names an unknown shard");
    if (p.sliced && (s.row_begin != next || s.row_end <= s.row_begin || s.row_end > rows)) {
      return InvalidArgument("placement slices of '" + p.name + "' do not tile its rows");
    }
    next = s.row_end;
    p.parts.push_back(s);
  }
  if (p.sliced && (p.shape.empty() || next != rows)) {
    return InvalidArgument("placement slices of '" + p.name + "' do not tile its rows");
  }
  return p;
}

void PlacementToWire(proto::VariablePlacement::Builder b, const VarPlacement& p) { ToWire(b, p); }

ClusterCoordinator::ClusterCoordinator(Server& server, const ServerConfig& config, asio::io_context& io)
    : server_(server),
      config_(config),
      io_(io),
      me_(config.shard_index),
      shards_(config.shards()),
      strand_(asio::make_strand(io)),
      tick_timer_(strand_),
      peers_(static_cast<size_t>(config.shards())),
      placement_(config.shards(), config.slice_bytes) {
  // The links exist before anything can call in (started by Start()).
  links_.resize(static_cast<size_t>(shards_));
  for (int i = 0; i < shards_; ++i) {
    if (i == me_) continue;
    PeerLink::Identity id{config_.auth_token, config_.cluster_secret, static_cast<uint32_t>(me_),
                          static_cast<uint32_t>(i), static_cast<uint32_t>(shards_)};
    links_[static_cast<size_t>(i)] =
        std::make_shared<PeerLink>(io_, AddressOf(i), std::move(id), server_.peer_tls_context());
  }
}

ClusterCoordinator::~ClusterCoordinator() {
  Stop();
  if (restore_thread_.joinable()) restore_thread_.join();
}

void ClusterCoordinator::Start() {
  std::vector<int64_t> sealed, unusable;
  if (!config_.checkpoint_dir.empty() && config_.restore) {
    sealed = RestorableSteps(config_.checkpoint_dir, me_, shards_, &unusable);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    sealed_ = sealed;
    unusable_ = unusable;
    ready_ = true;
    missing_since_ = Clock::now();
    missing_reason_ = "electing a chief";
  }
  spdlog::info("shard {} of {}: {} restorable checkpoint(s){}", me_, shards_, sealed.size(),
               sealed.empty() ? "" : fmt::format(", newest at step {}", sealed.front()));
  if (config_.cluster_secret.empty()) {
    spdlog::info("shard links: a peer's hello is believed (no --cluster-secret-file)");
  } else {
    spdlog::info("shard links: each end proves the cluster secret (--cluster-secret-file)");
  }
  for (auto& l : links_) {
    if (l) l->Start();
  }
  asio::dispatch(strand_, [this] { ScheduleTick(); });
}

void ClusterCoordinator::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  asio::post(strand_, [this] { tick_timer_.cancel(); });
  // Give queued messages (a seal, the last commit) a moment to leave.
  auto deadline = Clock::now() + std::chrono::seconds(1);
  while (Clock::now() < deadline) {
    bool idle = true;
    for (auto& l : links_) idle = idle && (!l || l->idle());
    if (idle) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& l : links_) {
    if (l) l->Stop();
  }
}

// --- sending ----------------------------------------------------------------------------------

std::shared_ptr<wire::OutFrame> ClusterCoordinator::NewMessageLocked(proto::PeerMessage::Builder* msg) const {
  auto frame = std::make_shared<wire::OutFrame>();
  auto req = frame->builder.initRoot<proto::Request>();
  req.setId(0);
  *msg = req.initPeer();
  msg->setFrom(static_cast<uint32_t>(me_));
  msg->setTerm(term_);
  return frame;
}

void ClusterCoordinator::SendTo(int shard, const std::shared_ptr<wire::OutFrame>& frame) {
  if (shard < 0 || shard >= shards_) return;
  if (shard == me_) {
    // Handled like a received message, on the io_context (never inside the caller's stack).
    asio::post(io_,
               [this, frame] { OnPeerMessage(me_, frame->builder.getRoot<proto::Request>().asReader().getPeer()); });
    return;
  }
  if (auto& l = links_[static_cast<size_t>(shard)]) l->Send(Flatten(frame));
}

void ClusterCoordinator::SendToAll(const std::shared_ptr<wire::OutFrame>& frame, bool include_self) {
  Bytes bytes = Flatten(frame);
  for (int i = 0; i < shards_; ++i) {
    if (i == me_) {
      if (include_self) SendTo(i, frame);
    } else if (auto& l = links_[static_cast<size_t>(i)]) {
      l->Send(bytes);
    }
  }
}

std::shared_ptr<wire::OutFrame> ClusterCoordinator::HeartbeatLocked() const {
  proto::PeerMessage::Builder msg(nullptr);
  auto frame = NewMessageLocked(&msg);
  auto hb = msg.initHeartbeat();
  hb.setChief(chief_);
  hb.setEpoch(epoch_);
  hb.setRunning(chief_ == me_ && running_);
  hb.setStep(open_step_);
  auto sealed = hb.initSealedSteps(static_cast<unsigned>(sealed_.size()));
  for (size_t i = 0; i < sealed_.size(); ++i) sealed.set(static_cast<unsigned>(i), sealed_[i]);
  hb.setReady(ready_);
  hb.setRequired(required_);
  hb.setAllowStateLoss(config_.allow_state_loss || !config_.restore);
  auto unusable = hb.initUnusableSteps(static_cast<unsigned>(unusable_.size()));
  for (size_t i = 0; i < unusable_.size(); ++i) unusable.set(static_cast<unsigned>(i), unusable_[i]);
  // Followers show the chief's refusal as their own reason (workers may ask any shard).
  if (chief_ == me_ && !refusal_.empty() && missing_reason_ == refusal_) hb.setWaiting(refusal_);
  return frame;
}

// --- state queries ----------------------------------------------------------------------------

bool ClusterCoordinator::AliveLocked(int shard, Clock::time_point now) const {
  if (shard == me_) return true;
  const Peer& p = peers_[static_cast<size_t>(shard)];
  return p.connections > 0 && now - p.last_heard < std::chrono::milliseconds(config_.election_timeout_ms);
}

std::vector<int> ClusterCoordinator::MissingLocked(Clock::time_point now) const {
  std::vector<int> missing;
  for (int i = 0; i < shards_; ++i) {
    if (!AliveLocked(i, now)) missing.push_back(i);
  }
  return missing;
}

Status ClusterCoordinator::Serving() const {
  std::lock_guard<std::mutex> lock(mu_);
  auto now = Clock::now();
  bool ok = chief_ == me_ ? running_ : (serving_ && chief_ >= 0 && AliveLocked(chief_, now));
  if (ok) return Status::Ok();
  double secs = std::chrono::duration<double>(now - missing_since_).count();
  std::string why = missing_reason_.empty() ? std::string("the cluster is forming") : missing_reason_;
  return Unavailable("shard " + std::to_string(me_) + ": not serving: " + why + " (for " + fmt::format("{:.1f}", secs) +
                     " s); retry");
}

bool ClusterCoordinator::is_chief() const {
  std::lock_guard<std::mutex> lock(mu_);
  return chief_ == me_;
}

int ClusterCoordinator::chief() const {
  std::lock_guard<std::mutex> lock(mu_);
  return chief_;
}

uint64_t ClusterCoordinator::epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

ClusterCoordinator::View ClusterCoordinator::Describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  View v;
  v.chief = chief_;
  v.term = term_;
  v.epoch = epoch_;
  v.missing = MissingLocked(Clock::now());
  bool ok = chief_ == me_ ? running_ : (serving_ && chief_ >= 0);
  v.state = ok ? "running" : (missing_reason_.empty() ? "forming" : missing_reason_);
  return v;
}

// --- the heartbeat tick: election and the chief's duties --------------------------------------

void ClusterCoordinator::ScheduleTick() {
  tick_timer_.expires_after(std::chrono::milliseconds(config_.heartbeat_ms));
  tick_timer_.async_wait([this](boost::system::error_code ec) {
    if (ec) return;
    Tick();
    ScheduleTick();
  });
}

void ClusterCoordinator::Tick() {
  std::vector<Action> actions;
  std::shared_ptr<wire::OutFrame> hb;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    TickLocked(&actions);
    hb = HeartbeatLocked();
  }
  SendToAll(hb, /*include_self=*/false);
  for (auto& a : actions) a();
}

void ClusterCoordinator::DegradeLocked(const std::string& why, std::vector<Action>* actions) {
  if (missing_reason_ != why) {
    missing_reason_ = why;
    missing_since_ = Clock::now();
  }
  if (chief_ == me_ && running_) {
    running_ = false;
    spdlog::warn(
        "cluster: {}; workers are told to wait, and the cluster restores its last checkpoint once every "
        "shard is back",
        why);
    actions->push_back([this, why] {
      server_.engine()->tokens().FailWaiters(Unavailable("the cluster stopped serving: " + why + "; retry"));
    });
  }
  serving_ = false;
}

void ClusterCoordinator::TickLocked(std::vector<Action>* actions) {
  if (job_done_) return;  // the shards are winding down: no elections, no formations
  auto now = Clock::now();
  // Election.
  if (chief_ != me_ && (chief_ < 0 || !AliveLocked(chief_, now))) {
    if (chief_ >= 0) {
      spdlog::warn("cluster: chief shard {} ({}) is gone (term {})", chief_, AddressOf(chief_), term_);
      DegradeLocked("chief shard " + std::to_string(chief_) + " (" + AddressOf(chief_) + ") is missing", actions);
      chief_ = -1;
    }
    if (now - started_ >= std::chrono::milliseconds(config_.election_timeout_ms)) {
      std::vector<bool> alive(static_cast<size_t>(shards_));
      for (int i = 0; i < shards_; ++i) alive[static_cast<size_t>(i)] = AliveLocked(i, now);
      if (election::Candidate(alive, me_) == me_) {
        term_ = std::max(term_, max_term_seen_) + 1;
        max_term_seen_ = term_;
        chief_ = me_;
        running_ = false;
        forming_ = false;
        required_ = local_required_;
        auto missing = MissingLocked(now);
        std::string list;
        for (int m : missing) list += (list.empty() ? "" : ", ") + std::to_string(m) + " (" + AddressOf(m) + ")";
        spdlog::info("cluster: shard {} is the chief for term {}{}", me_, term_,
                     missing.empty() ? "" : "; missing shard(s): " + list);
        // The job may have ended under the last chief without every shard hearing it.
        actions->push_back([this] { server_.EndJobIfDone(); });
      }
    }
  }
  if (chief_ != me_) return;
  // The chief's duties.
  auto missing = MissingLocked(now);
  if (!missing.empty()) {
    std::string list;
    for (int m : missing) list += (list.empty() ? "" : ", ") + std::to_string(m) + " (" + AddressOf(m) + ")";
    DegradeLocked("waiting for shard " + list, actions);
    if (forming_) {
      forming_ = false;
      spdlog::warn("cluster: formation at epoch {} abandoned: shard {} is missing", term_, list);
    }
    return;
  }
  if (running_) {
    if (commit_in_flight_ >= 0 && now - commit_start_ > std::chrono::seconds(30)) {
      DegradeLocked("step " + std::to_string(commit_in_flight_) + " did not commit on every shard", actions);
    }
    return;
  }
  if (forming_) {
    if (now - formation_start_ > std::chrono::seconds(120)) {
      forming_ = false;
      spdlog::warn("cluster: formation at epoch {} took too long; starting again", term_);
    }
    return;
  }
  for (int i = 0; i < shards_; ++i) {
    if (i != me_ && !peers_[static_cast<size_t>(i)].ready) return;  // still scanning checkpoints
  }
  StartFormationLocked(actions);
}

std::set<int64_t> ClusterCoordinator::CommonStepsLocked() const {
  std::set<int64_t> common(sealed_.begin(), sealed_.end());
  for (int i = 0; i < shards_; ++i) {
    if (i == me_) continue;
    const auto& s = peers_[static_cast<size_t>(i)].sealed;
    std::set<int64_t> theirs(s.begin(), s.end()), both;
    std::set_intersection(common.begin(), common.end(), theirs.begin(), theirs.end(),
                          std::inserter(both, both.begin()));
    common.swap(both);
  }
  return common;
}

namespace {

// "150, 140 and 2 more" (newest first).
std::string StepList(const std::vector<int64_t>& steps) {
  if (steps.empty()) return "none";
  std::string out;
  for (size_t i = 0; i < steps.size() && i < 4; ++i) out += (i == 0 ? "" : ", ") + std::to_string(steps[i]);
  if (steps.size() > 4) out += " and " + std::to_string(steps.size() - 4) + " more";
  return out;
}

}  // namespace

std::string ClusterCoordinator::DescribeCheckpointsLocked() const {
  std::string out;
  for (int i = 0; i < shards_; ++i) {
    const auto& sealed = i == me_ ? sealed_ : peers_[static_cast<size_t>(i)].sealed;
    const auto& unusable = i == me_ ? unusable_ : peers_[static_cast<size_t>(i)].unusable;
    out +=
        (i == 0 ? "" : "; ") + fmt::format("shard {} ({}) can restore step(s) {}", i, AddressOf(i), StepList(sealed));
    if (!unusable.empty()) out += " (unusable there: " + StepList(unusable) + ")";
  }
  return out;
}

std::optional<int64_t> ClusterCoordinator::FormationStepLocked(std::vector<Action>* actions) {
  std::set<int64_t> common = CommonStepsLocked();
  int64_t step = common.empty() ? -1 : *common.rbegin();
  // Newer steps that a shard can restore and another shard has lost: no trace of them there (a
  // directory it cannot restore — a corrupt part, a seal it missed — makes the step unusable for
  // good, skipped as before).
  auto has = [](const std::vector<int64_t>& v, int64_t t) { return std::find(v.begin(), v.end(), t) != v.end(); };
  std::set<int64_t> lost;
  std::set<int> losers;
  bool allowed = config_.allow_state_loss || !config_.restore;
  for (int i = 0; i < shards_; ++i) {
    if (i != me_ && peers_[static_cast<size_t>(i)].allow_state_loss) allowed = true;
    for (int64_t t : i == me_ ? sealed_ : peers_[static_cast<size_t>(i)].sealed) {
      if (t <= step) continue;
      for (int j = 0; j < shards_; ++j) {
        const auto& sealed = j == me_ ? sealed_ : peers_[static_cast<size_t>(j)].sealed;
        const auto& unusable = j == me_ ? unusable_ : peers_[static_cast<size_t>(j)].unusable;
        if (!has(sealed, t) && !has(unusable, t)) {
          lost.insert(t);
          losers.insert(j);
        }
      }
    }
  }
  if (lost.empty()) return step;
  std::string at = step < 0 ? std::string("empty at step 0") : "at checkpoint step " + std::to_string(step);
  std::string newest = "step " + std::to_string(*lost.rbegin());
  if (decision_) {
    if (*decision_ < 0 || common.count(*decision_) > 0) {
      spdlog::error(
          "cluster: forming {} by an operator's decision (psd_admin recover), losing checkpoint {}: {}",
          *decision_ < 0 ? std::string("empty at step 0") : "at checkpoint step " + std::to_string(*decision_), newest,
          DescribeCheckpointsLocked());
      return *decision_;
    }
    spdlog::error(
        "cluster: the operator's decision (checkpoint step {}) no longer holds: not every shard can restore it",
        *decision_);
    decision_.reset();
  }
  if (allowed) {
    spdlog::error("cluster: forming {} with --allow-state-loss, losing checkpoint {}: {}", at, newest,
                  DescribeCheckpointsLocked());
    return step;
  }
  std::string who;
  for (int j : losers) who += (who.empty() ? "" : ", ") + std::to_string(j) + " (" + AddressOf(j) + ")";
  std::string why = "refusing to form the cluster " + at + ": shard(s) " + who + " lack checkpoint " + newest +
                    " that other shards hold (" + DescribeCheckpointsLocked() +
                    "). Bring back the lost --checkpoint-dir and restart that shard to keep it, or decide to lose it: "
                    "`psd_admin --cluster ... recover` (" +
                    (step < 0 ? std::string("with --empty") : "the newest common step, " + std::to_string(step)) +
                    "), `recover --empty`, or a shard restarted with --allow-state-loss (README \"Losing a shard's "
                    "checkpoints\")";
  if (why != refusal_) spdlog::error("cluster: {}", why);
  refusal_ = why;
  DegradeLocked(why, actions);
  return std::nullopt;
}

Status ClusterCoordinator::Recover(int64_t step, bool empty) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (chief_ != me_) return NotChiefLocked();
    if (running_ || forming_ || refusal_.empty() || missing_reason_ != refusal_) {
      std::string state = running_ ? std::string("running") : (missing_reason_.empty() ? "forming" : missing_reason_);
      return FailedPrecondition("the cluster is not waiting for an operator's decision (it is " + state +
                                "); nothing to recover");
    }
    std::set<int64_t> common = CommonStepsLocked();
    std::vector<int64_t> list(common.rbegin(), common.rend());
    if (empty) {
      decision_ = -1;
    } else if (step < 0) {
      if (common.empty()) {
        return InvalidArgument(
            "no checkpoint can be restored by every shard: `psd_admin recover --empty` starts at "
            "step 0");
      }
      decision_ = *common.rbegin();
    } else if (common.count(step) == 0) {
      return InvalidArgument("checkpoint step " + std::to_string(step) +
                             " cannot be restored by every shard; those that can: " + StepList(list) +
                             (common.empty() ? " (use --empty)" : ""));
    } else {
      decision_ = step;
    }
    spdlog::error("cluster: an operator decided (psd_admin recover) to form {}",
                  *decision_ < 0 ? std::string("empty at step 0") : "at checkpoint step " + std::to_string(*decision_));
  }
  asio::post(strand_, [this] { Tick(); });
  return Status::Ok();
}

void ClusterCoordinator::StartFormationLocked(std::vector<Action>* actions) {
  std::optional<int64_t> chosen = FormationStepLocked(actions);
  if (!chosen) return;  // an operator must decide
  int64_t step = *chosen;
  refusal_.clear();
  term_ = std::max(term_, max_term_seen_) + 1;
  max_term_seen_ = term_;
  forming_ = true;
  formation_start_ = Clock::now();
  formation_step_ = step;
  restored_.clear();
  placement_.Clear();
  votes_.clear();
  committed_.clear();
  commit_in_flight_ = -1;
  open_step_ = step < 0 ? 0 : step;
  missing_reason_ = step < 0 ? "starting empty at step 0" : "restoring checkpoint step " + std::to_string(step);
  spdlog::info("cluster: forming epoch {} on {} shard(s): {}", term_, shards_, missing_reason_);
  proto::PeerMessage::Builder msg(nullptr);
  auto frame = NewMessageLocked(&msg);
  auto r = msg.initRestore();
  r.setEpoch(term_);
  r.setStep(step);
  actions->push_back([this, frame] { SendToAll(frame, /*include_self=*/true); });
}

// --- messages ---------------------------------------------------------------------------------

void ClusterCoordinator::OnPeerHello(int shard) {
  std::lock_guard<std::mutex> lock(mu_);
  Peer& p = peers_[static_cast<size_t>(shard)];
  ++p.connections;
  p.last_heard = Clock::now();
}

void ClusterCoordinator::OnPeerClosed(int shard) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer& p = peers_[static_cast<size_t>(shard)];
    if (--p.connections > 0) return;
    p.connections = 0;
    p.ready = false;
    if (stopped_) return;
    spdlog::warn("cluster: lost the link from shard {} ({})", shard, AddressOf(shard));
  }
  // React now rather than at the next tick: failover time is what operators wait for.
  asio::post(strand_, [this] { Tick(); });
}

void ClusterCoordinator::BecomeFollowerLocked(std::vector<Action>* actions) {
  if (chief_ == me_) return;
  if (running_ || forming_) {
    running_ = false;
    forming_ = false;
    actions->push_back(
        [this] { server_.engine()->tokens().FailWaiters(Unavailable("this shard is no longer the chief; retry")); });
  }
}

bool ClusterCoordinator::AcceptChiefLocked(int from, uint64_t term, std::vector<Action>* actions) {
  max_term_seen_ = std::max(max_term_seen_, term);
  election::View after;
  bool accept = election::AcceptChiefMessage({term_, chief_}, from, term, &after);
  if (after.term != term_ || after.chief != chief_) {
    term_ = after.term;
    chief_ = after.chief;
    BecomeFollowerLocked(actions);
  }
  if (accept) return true;
  spdlog::debug("cluster: ignored a chief message from shard {} at term {} (term {} chief {})", from, term, term_,
                chief_);
  return false;
}

void ClusterCoordinator::OnPeerMessage(int from, proto::PeerMessage::Reader msg) {
  if (from < 0 || from >= shards_) return;
  uint64_t term = msg.getTerm();
  std::vector<Action> actions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    if (from != me_) peers_[static_cast<size_t>(from)].last_heard = Clock::now();
    switch (msg.which()) {
      case proto::PeerMessage::HEARTBEAT:
        HandleHeartbeat(from, term, msg.getHeartbeat(), &actions);
        break;
      case proto::PeerMessage::PREPARED: {
        auto p = msg.getPrepared();
        if (chief_ != me_ || term != term_ || p.getEpoch() != term_ || !(running_ || forming_)) break;
        votes_[p.getStep()][from] = {p.getTakes(), p.getMinGradients(), p.getMaxGradients(), p.getForced()};
        MaybeCommitLocked(&actions);
        break;
      }
      case proto::PeerMessage::COMMIT:
        HandleCommit(from, term, msg.getCommit(), &actions);
        break;
      case proto::PeerMessage::COMMITTED: {
        auto c = msg.getCommitted();
        if (chief_ != me_ || term != term_ || c.getEpoch() != term_ || !running_) break;
        if (commit_in_flight_ < 0 || c.getStep() != commit_in_flight_ + 1) break;
        committed_.insert(from);
        if (static_cast<int>(committed_.size()) < shards_) break;
        int64_t step = commit_in_flight_ + 1;
        auto& votes = votes_[commit_in_flight_];
        int min = INT32_MAX, max = 0;
        for (auto& [shard, v] : votes) {
          if (v.takes == 0) continue;
          min = std::min(min, v.min_gradients);
          max = std::max(max, v.max_gradients);
        }
        votes_.erase(votes_.begin(), votes_.upper_bound(commit_in_flight_));
        commit_in_flight_ = -1;
        open_step_ = step;
        actions.push_back([this, step, min, max] {
          auto engine = server_.engine();
          engine->tokens().Push(step, config_.tokens_per_step);
          spdlog::debug("cluster: step {} committed on every shard ({}..{} gradients per variable)", step, min, max);
        });
        MaybeCommitLocked(&actions);
        break;
      }
      case proto::PeerMessage::RESTORE:
        HandleRestore(from, term, msg.getRestore(), &actions);
        break;
      case proto::PeerMessage::RESTORED:
        HandleRestored(from, term, msg.getRestored(), &actions);
        break;
      case proto::PeerMessage::PART_WRITTEN:
        HandlePartWritten(from, term, msg.getPartWritten(), &actions);
        break;
      case proto::PeerMessage::SEAL:
        HandleSeal(from, term, msg.getSeal(), &actions);
        break;
      case proto::PeerMessage::CONTROL:
        HandleControl(from, term, msg.getControl(), &actions);
        break;
      case proto::PeerMessage::CHECKPOINT_REQUEST:
        if (chief_ == me_) checkpoint_next_ = true;
        break;
      default:
        break;
    }
  }
  for (auto& a : actions) a();
}

void ClusterCoordinator::HandleHeartbeat(int from, uint64_t term, proto::PeerHeartbeat::Reader hb,
                                         std::vector<Action>* actions) {
  Peer& p = peers_[static_cast<size_t>(from)];
  p.term = term;
  p.epoch = hb.getEpoch();
  p.ready = hb.getReady();
  p.sealed.clear();
  for (int64_t s : hb.getSealedSteps()) p.sealed.push_back(s);
  p.unusable.clear();
  for (int64_t s : hb.getUnusableSteps()) p.unusable.push_back(s);
  p.allow_state_loss = hb.getAllowStateLoss();
  max_term_seen_ = std::max(max_term_seen_, term);
  election::View after = election::OnClaim({term_, chief_}, term, hb.getChief(), shards_);
  if (after.term != term_ || after.chief != chief_) {
    bool newer = after.term > term_;
    term_ = after.term;
    chief_ = after.chief;
    BecomeFollowerLocked(actions);
    if (newer && chief_ != me_ && chief_ >= 0) spdlog::info("cluster: shard {} is the chief (term {})", chief_, term_);
  }
  if (from == chief_ && term == term_) {
    bool was = serving_;
    serving_ = hb.getRunning() && hb.getEpoch() == epoch_ && epoch_ != 0;
    if (serving_ && !was) missing_reason_.clear();
    if (!hb.getRunning() && missing_reason_.empty()) {
      missing_reason_ = "the chief (shard " + std::to_string(from) + ") is forming the cluster";
      missing_since_ = Clock::now();
    }
    std::string waiting = hb.getWaiting();
    if (!waiting.empty() && !serving_ && missing_reason_ != waiting) {
      missing_reason_ = waiting;
      missing_since_ = Clock::now();
    }
    int required = hb.getRequired();
    if (required > 0 && required != required_) {
      required_ = required;
      actions->push_back([this, required] { server_.engine()->SetRequiredReplicas(required); });
    }
  }
}

void ClusterCoordinator::MaybeCommitLocked(std::vector<Action>* actions) {
  if (chief_ != me_ || !running_ || commit_in_flight_ >= 0) return;
  auto it = votes_.find(open_step_);
  if (it == votes_.end() || static_cast<int>(it->second.size()) < shards_) return;
  // Every shard holding a trainable part must have taken something: an idle report from a shard
  // whose part is placed but not yet created (or not yet taken) does not count. Placement comes
  // before creation, so no step can close under a variable being created.
  int takes = 0;
  std::vector<bool> training = placement_.TrainingShards();
  for (auto& [shard, v] : it->second) {
    if (training[static_cast<size_t>(shard)] && v.takes == 0) return;
    takes += v.takes;
  }
  if (takes == 0) return;  // no shard has anything to train yet
  commit_in_flight_ = open_step_;
  commit_start_ = Clock::now();
  committed_.clear();
  bool checkpoint = !config_.checkpoint_dir.empty() &&
                    (checkpoint_next_ ||
                     (config_.checkpoint_every_steps > 0 && (open_step_ + 1) % config_.checkpoint_every_steps == 0));
  checkpoint_next_ = false;
  proto::PeerMessage::Builder msg(nullptr);
  auto frame = NewMessageLocked(&msg);
  auto c = msg.initCommit();
  c.setEpoch(term_);
  c.setStep(open_step_);
  c.setCheckpoint(checkpoint);
  c.setLearningRate(server_.engine()->learning_rate());
  actions->push_back([this, frame] { SendToAll(frame, /*include_self=*/true); });
}

void ClusterCoordinator::HandleCommit(int from, uint64_t term, proto::PeerCommit::Reader c,
                                      std::vector<Action>* actions) {
  if (!AcceptChiefLocked(from, term, actions) || c.getEpoch() != epoch_) return;
  int64_t step = c.getStep();
  bool checkpoint = c.getCheckpoint();
  double lr = c.getLearningRate();
  uint64_t epoch = epoch_;
  proto::PeerMessage::Builder msg(nullptr);
  auto reply = NewMessageLocked(&msg);
  auto done = msg.initCommitted();
  done.setEpoch(epoch);
  done.setStep(step + 1);
  actions->push_back([this, step, checkpoint, lr, epoch, reply, from] {
    auto engine = server_.engine();
    if (engine->epoch() != epoch) return;
    Status s = engine->CommitPrepared(step, checkpoint, lr);
    if (!s.ok()) {
      spdlog::error("cluster: cannot commit step {}: {}", step, s.message());
      return;
    }
    SendTo(from, reply);
  });
}

void ClusterCoordinator::HandleRestore(int from, uint64_t term, proto::PeerRestore::Reader r,
                                       std::vector<Action>* actions) {
  if (!AcceptChiefLocked(from, term, actions)) return;
  uint64_t epoch = r.getEpoch();
  int64_t step = r.getStep();
  serving_ = false;
  missing_reason_ = step < 0 ? "starting empty" : "restoring checkpoint step " + std::to_string(step);
  missing_since_ = Clock::now();
  // Newer checkpoints belong to a timeline the cluster leaves now (an operator's decision, or a
  // part unusable elsewhere): never offered again (on disk, the next ones overwrite them).
  sealed_.erase(std::remove_if(sealed_.begin(), sealed_.end(), [step](int64_t t) { return t > step; }), sealed_.end());
  if (restore_thread_.joinable()) {
    // A previous restore still loading: it finishes first (its result is for an older epoch).
    actions->push_back([this, epoch, step] {
      std::thread old;
      {
        std::lock_guard<std::mutex> lock(mu_);
        old.swap(restore_thread_);
      }
      if (old.joinable()) old.join();
      std::lock_guard<std::mutex> lock(mu_);
      restore_thread_ = std::thread([this, epoch, step] {
        std::vector<VarPlacement> placements;
        Status s = server_.RestoreEngine(epoch, step, &placements);
        RestoreDone(epoch, step, s, std::move(placements));
      });
    });
    return;
  }
  restore_thread_ = std::thread([this, epoch, step] {
    std::vector<VarPlacement> placements;
    Status s = server_.RestoreEngine(epoch, step, &placements);
    RestoreDone(epoch, step, s, std::move(placements));
  });
}

void ClusterCoordinator::RestoreDone(uint64_t epoch, int64_t step, const Status& status,
                                     std::vector<VarPlacement> placements) {
  std::shared_ptr<wire::OutFrame> reply;
  int chief = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (status.ok()) {
      epoch_ = epoch;
      spdlog::info("cluster: shard {} restored {} at epoch {}", me_,
                   step < 0 ? std::string("an empty state") : "checkpoint step " + std::to_string(step), epoch);
    } else {
      spdlog::error("cluster: shard {} cannot restore checkpoint step {}: {}", me_, step, status.message());
      sealed_.erase(std::remove(sealed_.begin(), sealed_.end(), step), sealed_.end());
      if (step >= 0) unusable_.push_back(step);
    }
    proto::PeerMessage::Builder msg(nullptr);
    reply = NewMessageLocked(&msg);
    auto r = msg.initRestored();
    r.setEpoch(epoch);
    r.setStep(step);
    r.setOk(status.ok());
    r.setMessage(status.message());
    auto list = r.initPlacements(static_cast<unsigned>(placements.size()));
    for (size_t i = 0; i < placements.size(); ++i) ToWire(list[static_cast<unsigned>(i)], placements[i]);
    chief = chief_;
  }
  SendTo(chief, reply);
  if (status.ok()) server_.engine()->ReportIfIdle();
}

void ClusterCoordinator::HandleRestored(int from, uint64_t term, proto::PeerRestored::Reader r,
                                        std::vector<Action>* actions) {
  if (chief_ != me_ || term != term_ || !forming_ || r.getEpoch() != term_) return;
  if (!r.getOk()) {
    spdlog::warn("cluster: shard {} cannot restore step {}: {}; forming again", from, r.getStep(),
                 std::string(r.getMessage()));
    forming_ = false;
    return;
  }
  for (auto p : r.getPlacements()) {
    auto placed = PlacementFromWire(p, shards_);
    Status s = placed.ok() ? placement_.Add(*placed) : placed.status();
    if (!s.ok()) spdlog::warn("cluster: placement from shard {}: {}", from, s.message());
  }
  restored_.insert(from);
  if (static_cast<int>(restored_.size()) < shards_) return;
  forming_ = false;
  running_ = true;
  missing_reason_.clear();
  decision_.reset();
  spdlog::info(
      "cluster: running at epoch {} with {} shard(s) from {} ({} variable(s) placed)", term_, shards_,
      formation_step_ < 0 ? std::string("an empty state") : "checkpoint step " + std::to_string(formation_step_),
      placement_.All().size());
  int required = required_ > 0 ? required_ : local_required_;
  required_ = required;
  auto hb = HeartbeatLocked();
  actions->push_back([this, hb, required] {
    auto engine = server_.engine();
    if (required > 0) engine->SetRequiredReplicas(required);
    engine->PushInitTokens(config_.resolved_init_tokens);
    SendToAll(hb, /*include_self=*/false);  // followers start serving now, not at the next tick
  });
  MaybeCommitLocked(actions);
}

// --- checkpoints ------------------------------------------------------------------------------

void ClusterCoordinator::OnPartWritten(const CheckpointInfo& info, int64_t step) {
  std::shared_ptr<wire::OutFrame> frame;
  int chief = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A trace of `step` on this shard until its seal arrives: if the seal never does (the cluster
    // re-formed first), the step is unusable here, not lost — a chief that did seal it must not
    // ask an operator to give it up (FormationStepLocked).
    if (std::find(unusable_.begin(), unusable_.end(), step) == unusable_.end()) unusable_.push_back(step);
    proto::PeerMessage::Builder msg(nullptr);
    frame = NewMessageLocked(&msg);
    auto p = msg.initPartWritten();
    p.setEpoch(epoch_);
    p.setStep(step);
    p.setShard(static_cast<uint32_t>(me_));
    p.setFile(info.part_file);
    p.setBytes(info.part_bytes);
    p.setChecksum(info.part_checksum);
    chief = chief_;
  }
  SendTo(chief, frame);
}

void ClusterCoordinator::AddSealedLocked(int64_t step) {
  unusable_.erase(std::remove(unusable_.begin(), unusable_.end(), step), unusable_.end());
  if (std::find(sealed_.begin(), sealed_.end(), step) == sealed_.end()) sealed_.push_back(step);
  std::sort(sealed_.rbegin(), sealed_.rend());
  if (config_.keep_checkpoints > 0 && sealed_.size() > static_cast<size_t>(config_.keep_checkpoints)) {
    sealed_.resize(static_cast<size_t>(config_.keep_checkpoints));
  }
}

void ClusterCoordinator::HandlePartWritten(int from, uint64_t term, proto::PeerPart::Reader p,
                                           std::vector<Action>* actions) {
  if (chief_ != me_ || term != term_ || p.getEpoch() != term_ || static_cast<int>(p.getShard()) != from) return;
  std::string file = p.getFile();
  if (file.empty() || file.find('/') != std::string::npos) return;
  int64_t step = p.getStep();
  auto& parts = parts_[step];
  parts[from] = {from, file, p.getBytes(), p.getChecksum()};
  if (static_cast<int>(parts.size()) < shards_) return;
  std::vector<ManifestPart> all;
  for (auto& [shard, part] : parts) all.push_back(part);
  parts_.erase(parts_.begin(), parts_.upper_bound(step));
  proto::PeerMessage::Builder msg(nullptr);
  auto frame = NewMessageLocked(&msg);
  auto seal = msg.initSeal();
  seal.setStep(step);
  auto list = seal.initParts(static_cast<unsigned>(all.size()));
  for (size_t i = 0; i < all.size(); ++i) {
    auto e = list[static_cast<unsigned>(i)];
    e.setEpoch(term_);
    e.setStep(step);
    e.setShard(static_cast<uint32_t>(all[i].shard));
    e.setFile(all[i].file);
    e.setBytes(all[i].bytes);
    e.setChecksum(all[i].checksum);
  }
  actions->push_back([this, frame] { SendToAll(frame, /*include_self=*/true); });
}

void ClusterCoordinator::HandleSeal(int from, uint64_t term, proto::PeerSeal::Reader s, std::vector<Action>* actions) {
  if (!AcceptChiefLocked(from, term, actions) || config_.checkpoint_dir.empty()) return;
  int64_t step = s.getStep();
  std::vector<ManifestPart> parts;
  for (auto p : s.getParts()) {
    std::string file = p.getFile();
    if (file.empty() || file.find('/') != std::string::npos) return;
    parts.push_back({static_cast<int>(p.getShard()), file, p.getBytes(), p.getChecksum()});
  }
  if (static_cast<int>(parts.size()) != shards_) return;
  bool finish = job_done_ && step == final_step_;
  actions->push_back([this, step, parts, finish] {
    auto t0 = Clock::now();
    Status w = WriteManifest(config_.checkpoint_dir, step, shards_, parts);
    if (!w.ok()) {
      spdlog::error("cluster: cannot seal checkpoint step {}: {}", step, w.message());
    } else {
      {
        std::lock_guard<std::mutex> lock(mu_);
        AddSealedLocked(step);
      }
      server_.set_last_checkpoint_step(step);
      spdlog::info("cluster: checkpoint at step {} sealed in {} ({} shards, {:.0f} ms)", step, config_.checkpoint_dir,
                   shards_, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    if (finish) server_.FinishJob();
  });
}

void ClusterCoordinator::RequestCheckpoint(bool timed) {
  std::shared_ptr<wire::OutFrame> frame;
  int chief = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (chief_ == me_) {
      checkpoint_next_ = true;
      return;
    }
    if (timed) return;  // the chief's own timer counts
    proto::PeerMessage::Builder msg(nullptr);
    frame = NewMessageLocked(&msg);
    msg.setCheckpointRequest();
    chief = chief_;
  }
  SendTo(chief, frame);
}

Status ClusterCoordinator::NotChiefLocked() const {
  // UNAVAILABLE: the caller asks the shards who the chief is and tries again.
  if (chief_ < 0) return Unavailable("shard " + std::to_string(me_) + " knows no chief yet (an election is on); retry");
  return Unavailable("shard " + std::to_string(me_) + " is not the chief; the chief is shard " +
                     std::to_string(chief_));
}

// --- workers ----------------------------------------------------------------------------------

Result<VarPlacement> ClusterCoordinator::Place(const std::string& name, DType dtype, const Shape& shape,
                                               const std::string& colocate, bool trainable) {
  std::lock_guard<std::mutex> lock(mu_);
  if (chief_ != me_) return NotChiefLocked();
  if (!running_) return Unavailable("the cluster is not serving yet: " + missing_reason_);
  return placement_.Place(name, dtype, shape, colocate, trainable);
}

Status ClusterCoordinator::Placements(std::vector<VarPlacement>* out, std::vector<uint64_t>* shard_bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (chief_ != me_) return NotChiefLocked();
  if (!running_) return Unavailable("the cluster is not serving yet: " + missing_reason_);
  *out = placement_.All();
  *shard_bytes = placement_.shard_bytes();
  return Status::Ok();
}

void ClusterCoordinator::SetLocalRequired(int required) {
  std::shared_ptr<wire::OutFrame> hb;
  {
    std::lock_guard<std::mutex> lock(mu_);
    local_required_ = required;
    if (chief_ != me_ || required == required_) return;
    required_ = required;
    hb = HeartbeatLocked();
  }
  server_.engine()->SetRequiredReplicas(required);
  SendToAll(hb, /*include_self=*/false);
}

void ClusterCoordinator::OnJobDone() {
  std::shared_ptr<wire::OutFrame> frame;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (chief_ != me_ || job_done_) return;
    proto::PeerMessage::Builder msg(nullptr);
    frame = NewMessageLocked(&msg);
    auto c = msg.initControl();
    c.setEpoch(epoch_);
    c.setJobDone(true);
    // The final checkpoint, unless the last commit already made one at this step.
    bool can = !config_.checkpoint_dir.empty() && running_ && commit_in_flight_ < 0 &&
               (sealed_.empty() || sealed_.front() != open_step_);
    c.setSnapshotStep(can ? open_step_ : -1);
    c.setForceStep(-1);
  }
  SendToAll(frame, /*include_self=*/true);
}

void ClusterCoordinator::HandleControl(int from, uint64_t term, proto::PeerControl::Reader c,
                                       std::vector<Action>* actions) {
  if (!AcceptChiefLocked(from, term, actions)) return;
  // The job's end counts at any epoch: a shard that never joined the chief's epoch (the cluster
  // waits for an operator, say) ends with the others.
  if (c.getEpoch() == epoch_ && c.getForceStep() >= 0) {
    int64_t step = c.getForceStep();
    actions->push_back([this, step] { server_.engine()->ForceStep(step); });
  }
  if (!c.getJobDone() || job_done_) return;
  job_done_ = true;
  int64_t step = c.getSnapshotStep();
  final_step_ = step;
  spdlog::info("cluster: every worker finished{}", step >= 0 ? fmt::format("; final checkpoint at step {}", step) : "");
  actions->push_back([this, step] {
    auto engine = server_.engine();
    engine->tokens().Close(OutOfRange("training is over: all workers finished"));
    std::optional<ShardSnapshot> snap;
    if (step >= 0) snap = engine->SnapshotIfAtBoundary();
    if (snap && snap->step == step) {
      server_.QueueSnapshot(std::move(*snap));
      FinishJobUnlessSealed();
    } else {
      server_.FinishJob();
    }
  });
}

void ClusterCoordinator::FinishJobUnlessSealed() {
  // The seal finishes the job. If it never comes (a shard died meanwhile), give up 10 s after this
  // shard's final part is written (or failed): however long a large part takes, it is waited for.
  const bool busy = server_.CheckpointWriterBusy();
  auto timer = std::make_shared<asio::steady_timer>(io_);
  timer->expires_after(busy ? std::chrono::milliseconds(200) : std::chrono::milliseconds(10000));
  timer->async_wait([this, timer, busy](boost::system::error_code ec) {
    if (ec) return;
    if (busy) return FinishJobUnlessSealed();
    server_.FinishJob();
  });
}

void ClusterCoordinator::OnPrepared(uint64_t epoch, int64_t step, int min_gradients, int max_gradients, int takes,
                                    bool forced) {
  std::shared_ptr<wire::OutFrame> frame;
  int chief = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (epoch != epoch_ || chief_ < 0) return;  // a stale engine, or no chief: the next formation redoes it
    proto::PeerMessage::Builder msg(nullptr);
    frame = NewMessageLocked(&msg);
    auto p = msg.initPrepared();
    p.setEpoch(epoch);
    p.setStep(step);
    p.setMinGradients(min_gradients);
    p.setMaxGradients(max_gradients);
    p.setTakes(takes);
    p.setForced(forced);
    chief = chief_;
  }
  SendTo(chief, frame);
}

}  // namespace psd::server
