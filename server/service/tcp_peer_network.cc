#include "service/tcp_peer_network.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <variant>
#include <vector>

#include "net/byte_stream.h"
#include "net/connection.h"
#include "net/peer_auth.h"
#include "psd.capnp.h"
#include "psd/cluster_list.h"
#include "service/peer_codec.h"
#include "wire/frame.h"

namespace psd::server {

namespace {

// A message ready to write, immutable: its segment table is built once, so one encoding can go
// to several links at once, each writing the same buffers (the table and the segments, a replica
// chunk's data among them, read from the copy it shares: no copy of it is made here).
struct Sealed {
  std::shared_ptr<wire::OutFrame> frame;
  std::vector<asio::const_buffer> buffers;
};
using Bytes = std::shared_ptr<const Sealed>;

Bytes Seal(std::shared_ptr<wire::OutFrame> frame) {
  auto sealed = std::make_shared<Sealed>();
  sealed->buffers = frame->Buffers();
  sealed->frame = std::move(frame);
  return sealed;
}

Bytes Encode(const peer::Message& message) {
  auto frame = std::make_shared<wire::OutFrame>();
  auto req = frame->builder.initRoot<proto::Request>();
  req.setId(0);
  PeerMessageToWire(req.initPeer(), message);
  if (const auto* chunk = std::get_if<peer::ReplicaChunk>(&message.body)) {
    frame->keepalive.push_back(chunk->data.keep());  // the builder may reference its data
  }
  return Seal(std::move(frame));
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
// host and port of a --cluster entry (validated at start-up; [v6]:port too).
static psd::HostPort SplitAddress(const std::string& address) {
  auto hp = psd::ParseHostPort(address, "--cluster entry");
  return hp.ok() ? *hp : psd::HostPort{address, 0};
}

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
        endpoint_(SplitAddress(address_)),
        id_(std::move(id)),
        log_(1, std::chrono::seconds(30)) {}

  void Start() {
    asio::dispatch(strand_, [self = shared_from_this()] { self->Connect(); });
  }

  void Send(Bytes frame) {
    asio::dispatch(strand_, [self = shared_from_this(), frame = std::move(frame)] { self->Enqueue({frame, {}}); });
  }

  // The stream's messages, encoded one at a time as the link gets to them (in order with the rest).
  void SendStream(PeerNetwork::MessageStream next) {
    asio::dispatch(strand_, [self = shared_from_this(), next = std::move(next)]() mutable {
      self->Enqueue({{}, std::move(next)});
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

  // Dials `address` from now on (closing the link to the old one).
  void SetAddress(std::string address) {
    asio::dispatch(strand_, [self = shared_from_this(), address = std::move(address)] {
      if (self->stopped_ || address == self->address_) return;
      spdlog::info("cluster: the link to shard {} now goes to {} (was {})", self->id_.target, address, self->address_);
      self->address_ = address;
      self->endpoint_ = SplitAddress(address);
      ++self->generation_;  // what is under way for the old address ends quietly
      self->retry_.cancel();
      self->handshaking_ = false;
      self->writing_ = false;
      self->Close();
      self->stream_.reset();  // the old stream's handlers see they are stale
      self->moving_ = true;
      self->Connect();
    });
  }

 private:
  // A frame to write, or a stream whose next message is encoded (into `frame`) when it is written.
  struct Queued {
    Bytes frame;
    PeerNetwork::MessageStream next;
  };

  void Enqueue(Queued q) {
    // Down: dropped (the receiver saw the link close), unless it is being moved to a new address
    // (the receiver there never had this link: what the cluster sends it meanwhile waits).
    if ((!up_ && !moving_) || stopped_) return;
    if (queue_.size() > kMaxQueued) {
      // A peer that reads nothing: it will be seen as gone. (A replica copy is one entry however
      // many chunks it has: its stream makes them as they are written.)
      if (drop_log_.Allow() >= 0) {
        spdlog::warn("cluster: the link to shard {} ({}) has {} messages queued unwritten; dropping more", id_.target,
                     address_, queue_.size());
      }
      return;
    }
    queue_.push_back(std::move(q));
    if (!writing_) WriteNext();
  }

  Bytes Hello(const std::string& nonce) const {
    auto hello = std::make_shared<wire::OutFrame>();
    auto req = hello->builder.initRoot<proto::Request>();
    req.setId(0);
    auto h = req.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setWorkerName("shard-" + std::to_string(id_.me));
    // With a cluster secret the proof stands for the token: the token is not sent to a listener
    // that has not proved itself a shard yet (the other side's proof comes with its answer).
    if (id_.cluster_secret.empty()) h.setAuthToken(id_.auth_token);
    h.setPeer(true);
    h.setShardIndex(id_.me);
    h.setClusterSize(id_.shards);
    if (!nonce.empty()) h.setPeerNonce(kj::arrayPtr(reinterpret_cast<const kj::byte*>(nonce.data()), nonce.size()));
    return Seal(std::move(hello));
  }

  void Connect() {
    if (stopped_) return;
    resolver_.async_resolve(
        endpoint_.host, std::to_string(endpoint_.port),
        [self = shared_from_this(), gen = generation_](boost::system::error_code ec,
                                                       tcp::resolver::results_type results) {
          if (gen != self->generation_) return;  // the link moved meanwhile
          if (ec) return self->Retry();
          self->stream_ = std::make_shared<ByteStream>(tcp::socket(self->strand_), self->tls_);
          self->ArmConnectDeadline();
          asio::async_connect(
              self->stream_->lowest(), results,
              [self, stream = self->stream_](boost::system::error_code ec, const tcp::endpoint&) {
                if (stream != self->stream_) return;  // the link moved meanwhile
                if (ec) return self->Retry();
                boost::system::error_code ignored;
                self->stream_->lowest().set_option(tcp::no_delay(true), ignored);
                // A peer whose host dies mid-link sends no FIN: keepalive notices (as on accepted links).
                Connection::DetectDeadPeer(self->stream_->lowest().native_handle());
                if (self->stream_->tls()) {
                  Status s = wire::SetTlsServerName(self->stream_->tls_stream(), self->endpoint_.host);
                  if (!s.ok()) {
                    spdlog::error("peer link to {}: {}", self->address_, s.message());
                    return self->Retry();
                  }
                }
                self->stream_->async_handshake(
                    wire::ssl::stream_base::client,
                    asio::bind_executor(self->strand_, [self, stream](const boost::system::error_code& ec) {
                      if (stream != self->stream_) return;
                      if (ec) {
                        self->LogHandshakeError(ec);
                        return self->Retry();
                      }
                      self->retry_.cancel();  // the connect deadline: the link is through
                      self->up_ = true;
                      self->moving_ = false;
                      if (self->id_.cluster_secret.empty()) {
                        self->queue_.push_front({self->Hello(""), {}});
                        self->WriteNext();
                        return self->ReadLoop();
                      }
                      self->StartHandshake();
                    }));
              });
        });
  }

  // The TCP connect and the TLS handshake get kHandshakeTimeout: an address that accepts and then
  // says nothing (a host gone mid-handshake, something else listening there) is dialed again,
  // not waited on for good.
  void ArmConnectDeadline() {
    retry_.expires_after(kHandshakeTimeout);
    retry_.async_wait([self = shared_from_this(), stream = stream_](boost::system::error_code ec) {
      if (ec || stream != self->stream_ || self->up_) return;
      if (!self->stopped_ && self->log_.Allow() >= 0) {
        spdlog::warn("cluster: the link to shard {} ({}) is not through after {} s ({}); retrying", self->id_.target,
                     self->address_, kHandshakeTimeout.count(),
                     self->tls_ ? "TCP connect and TLS handshake" : "TCP connect");
      }
      // The attempt's handlers see a stream that is no longer the link's, and end quietly.
      auto old = std::move(self->stream_);
      old->Close();
      self->Retry();
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
    retry_.async_wait([self = shared_from_this(), stream = stream_](boost::system::error_code ec) {
      if (!ec && stream == self->stream_ && self->handshaking_) self->Fail("no answer to the peer hello within 5 s");
    });
    Bytes hello = Hello(nonce_);
    asio::async_write(*stream_, hello->buffers,
                      [self = shared_from_this(), hello, stream = stream_](boost::system::error_code ec, size_t) {
                        if (stream != self->stream_) return;
                        if (ec) return self->Fail("cannot send the hello: " + ec.message());
                        self->ReadReplyHeader();
                      });
  }

  void ReadReplyHeader() {
    asio::async_read(*stream_, asio::buffer(first_, sizeof(first_)),
                     [self = shared_from_this(), stream = stream_](boost::system::error_code ec, size_t) {
                       if (stream != self->stream_) return;
                       if (ec) return self->Fail("no answer to the hello: " + ec.message());
                       uint32_t count = 0;
                       size_t rest = 0;
                       Status s = wire::ParseFirstWord(self->first_, &count, &rest);
                       if (!s.ok()) return self->Fail(s.message());
                       self->table_.assign(1 + rest / 4, 0);
                       self->table_[0] = self->first_[1];
                       asio::async_read(*stream, asio::buffer(self->table_.data() + 1, rest),
                                        [self, count, stream](boost::system::error_code ec, size_t) {
                                          if (stream != self->stream_) return;
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
    asio::async_read(*stream_, asio::buffer(body, total * sizeof(capnp::word)), TransferAll{},
                     [self = shared_from_this(), stream = stream_](boost::system::error_code ec, size_t) {
                       if (stream != self->stream_) return;
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
                       self->queue_.push_front({self->proof_, {}});
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
    proof_ = Seal(std::move(frame));
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
    moving_ = false;  // the new address does not answer either: like any link that is down
    if (stopped_) return;
    retry_.expires_after(std::chrono::milliseconds(100));
    retry_.async_wait([self = shared_from_this(), gen = generation_](boost::system::error_code ec) {
      if (!ec && gen == self->generation_) self->Connect();
    });
  }

  void Close() {
    up_ = false;
    queue_.clear();
    if (stream_) stream_->Close();
  }

  // A TLS failure is a configuration error: say so once per cause, not every 100 ms.
  void LogHandshakeError(const boost::system::error_code& ec) {
    std::string text =
        wire::TlsErrorText(ec, stream_ && stream_->tls() ? stream_->tls_stream().native_handle() : nullptr);
    if (text == last_tls_error_) return;
    last_tls_error_ = text;
    spdlog::error("peer link to {}: TLS handshake failed: {}", address_, text);
  }

  void ReadLoop() {
    stream_->async_read_some(asio::buffer(scratch_),
                             asio::bind_executor(strand_, [self = shared_from_this(), stream = stream_](
                                                              boost::system::error_code ec, size_t) {
                               if (stream != self->stream_) return;
                               if (ec) {
                                 if (self->up_) self->Retry();
                                 return;
                               }
                               self->ReadLoop();
                             }));
  }

  void WriteNext() {
    // A stream at the front: its next message is encoded now; an ended one leaves the queue.
    while (!queue_.empty() && up_ && !queue_.front().frame) {
      Queued& q = queue_.front();
      std::optional<peer::Message> message = q.next ? q.next() : std::nullopt;
      if (message) {
        q.frame = Encode(*message);
      } else {
        queue_.pop_front();
      }
    }
    if (queue_.empty() || !up_) {
      writing_ = false;
      if (stopped_) Close();
      return;
    }
    writing_ = true;
    auto frame = queue_.front().frame;
    asio::async_write(*stream_, frame->buffers, TransferAll{},
                      asio::bind_executor(strand_, [self = shared_from_this(), frame, stream = stream_](
                                                       boost::system::error_code ec, size_t) {
                        if (stream != self->stream_) return;
                        if (!self->queue_.empty()) {
                          Queued& q = self->queue_.front();
                          if (q.next) {
                            q.frame = nullptr;  // written: the stream's next message comes next
                          } else {
                            self->queue_.pop_front();
                          }
                        }
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
  std::string address_;
  psd::HostPort endpoint_;   // address_ split once ([v6]:port too); validated at start-up or by the codec
  uint64_t generation_ = 0;  // SetAddress: handlers of the old address's attempts do nothing
  bool moving_ = false;      // SetAddress: messages wait for the new link instead of being dropped
  const Identity id_;
  peer_auth::LogLimiter log_;
  peer_auth::LogLimiter drop_log_{1, std::chrono::seconds(30)};
  static constexpr size_t kMaxQueued = 4096;
  std::deque<Queued> queue_;
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

TcpPeerNetwork::TcpPeerNetwork(asio::io_context& io, Options options) : io_(io), options_(std::move(options)) {
  const int shards = static_cast<int>(options_.addresses.size());
  links_.resize(static_cast<size_t>(shards));
  for (int i = 0; i < shards; ++i) {
    if (i == options_.me) continue;
    PeerLink::Identity id{options_.auth_token, options_.cluster_secret, static_cast<uint32_t>(options_.me),
                          static_cast<uint32_t>(i), static_cast<uint32_t>(shards)};
    links_[static_cast<size_t>(i)] =
        std::make_shared<PeerLink>(io_, options_.addresses[static_cast<size_t>(i)], std::move(id), options_.tls);
  }
}

TcpPeerNetwork::~TcpPeerNetwork() = default;

void TcpPeerNetwork::Start() {
  if (options_.cluster_secret.empty()) {
    spdlog::info("shard links: a peer's hello is believed (no --cluster-secret-file)");
  } else {
    spdlog::info("shard links: each end proves the cluster secret (--cluster-secret-file)");
  }
  for (auto& l : links_) {
    if (l) l->Start();
  }
}

void TcpPeerNetwork::Stop() {
  // Give queued messages (a seal, the last commit) a moment to leave.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (std::chrono::steady_clock::now() < deadline) {
    bool idle = true;
    for (auto& l : links_) idle = idle && (!l || l->idle());
    if (idle) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& l : links_) {
    if (l) l->Stop();
  }
}

void TcpPeerNetwork::Send(int shard, const peer::Message& message) {
  if (shard < 0 || shard >= static_cast<int>(links_.size())) return;
  if (shard == options_.me) {
    // Handled like a received message, on the io_context (never inside the caller's stack).
    if (events_ != nullptr)
      asio::post(io_, [events = events_, me = options_.me, message] { events->OnMessage(me, message); });
    return;
  }
  if (auto& l = links_[static_cast<size_t>(shard)]) l->Send(Encode(message));
}

void TcpPeerNetwork::SendStream(int shard, MessageStream next) {
  if (shard < 0 || shard >= static_cast<int>(links_.size())) return;
  if (shard == options_.me) return PeerNetwork::SendStream(shard, std::move(next));  // each posted
  if (auto& l = links_[static_cast<size_t>(shard)]) l->SendStream(std::move(next));
}

void TcpPeerNetwork::Retarget(int shard, const std::string& address) {
  if (shard < 0 || shard >= static_cast<int>(links_.size()) || shard == options_.me) return;
  if (auto& l = links_[static_cast<size_t>(shard)]) l->SetAddress(address);
}

void TcpPeerNetwork::SendToAll(const peer::Message& message, bool include_self, int shards, int me) {
  Bytes bytes;
  for (int i = 0; i < shards && i < static_cast<int>(links_.size()); ++i) {
    if (i == me) {
      if (include_self) Send(i, message);
    } else if (auto& l = links_[static_cast<size_t>(i)]) {
      if (!bytes) bytes = Encode(message);
      l->Send(bytes);
    }
  }
}

}  // namespace psd::server
