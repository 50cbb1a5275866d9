// Connection: one peer's socket. Reads frames (size-checked before any allocation), dispatches
// requests to the engine and writes replies with scatter-gather writes. All members are touched
// only on the connection's strand.
//
// Before its hello is accepted (worker, observer or peer), a connection may send only a hello, in
// a frame of at most kPreHelloFrameBytes (refused from the header, before any allocation), and must
// complete it within --hello-timeout-ms; afterwards it is closed when idle (no frame received and
// nothing parked) past --idle-timeout-s. After an observer's hello (a tool: status, checkpoint,
// placement) frames stay within kPreHelloFrameBytes too: only workers and peers send big ones.
//
// Memory: the body buffer of a worker's or a shard's connection is charged to the server's
// FrameBudget (--max-inflight-bytes) before it is allocated (other connections' frames are at most
// kPreHelloFrameBytes, so --max-connections bounds them, and they never wait for the budget).
// When the budget is spent the connection stops reading until its share is granted
// (backpressure); once granted, the frame must arrive within --frame-timeout-ms or the connection
// is closed. After a frame, a buffer kept for reuse stays
// charged, unless others are waiting for the budget: then it is given back at once.
//
// Malformed input: a frame whose header is bad or over --max-frame-bytes gets an error reply and
// the connection is closed (the stream cannot be resynchronised); a well-framed message that
// fails to decode or validate gets an error reply and the connection stays usable. Nothing a
// peer sends reaches an assertion.
#ifndef PSD_SERVER_NET_CONNECTION_H_
#define PSD_SERVER_NET_CONNECTION_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <set>

#include "cluster/peer_auth.h"
#include "net/byte_stream.h"
#include "net/parked_reply.h"
#include "psd.capnp.h"
#include "core/token_queue.h"
#include "wire/asio.h"
#include "wire/frame.h"

namespace psd::server {

class Server;

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // The largest frame read before the hello is accepted (a hello is well under 1 KiB).
  static constexpr uint64_t kPreHelloFrameBytes = 64 << 10;

  Connection(Server& server, tcp::socket socket, uint64_t id);
  uint64_t id() const { return id_; }
  void Start();
  // Closes once queued replies are written (bounded by the socket; any thread).
  void CloseGracefully();

 private:
  struct TokenWait;
  using TokenDone = std::function<void(const Status&, int64_t token)>;

  void ReadHeader();
  void ReadTable(uint32_t segment_count, size_t rest);
  void ReadBody(uint32_t segment_count);
  // Reads the body of body_sizes_ once the budget holds it.
  void ReadGrantedBody();
  // Gives the body buffer's memory and its budget share back.
  void ReleaseBuffer();
  // Gives the budget share back (CloseNow: the buffer goes with the connection).
  void ReleaseCharge();
  void OnFrame();
  // Answers `id` with `status` and closes once the reply is written.
  void FailStream(const Status& status, uint64_t id = 0);
  void CloseNow();
  // The per-connection timer: the hello deadline until greeted_, then the idle check.
  void ArmTimer(std::chrono::steady_clock::duration after);
  void OnTimer();
  bool Busy();  // a token wait or a collective is parked

  void Dispatch(proto::Request::Reader req);
  void HandleHello(uint64_t id, proto::Hello::Reader r);
  // A shard's hello: with a cluster secret, answered with this shard's challenge and proof; the
  // link is a peer's only once HandlePeerProof verified the dialer's (cluster/peer_auth.h).
  void HandlePeerHello(uint64_t id, proto::Hello::Reader r);
  void HandlePeerProof(uint64_t id, capnp::Data::Reader proof);
  // The transcript of the pending challenge (peer_claim_, peer_nonces_).
  peer_auth::Transcript PendingTranscript() const;
  // Logs a refused impersonation attempt (rate-limited across connections).
  void LogSpoof(const std::string& what);
  void HandleCreate(uint64_t id, proto::CreateVariable::Reader r);
  void HandlePull(uint64_t id, proto::Pull::Reader r);
  // Puts the named variables' current values (one step) into a reply, referencing them in place.
  // want: empty, or per name the dtype to deliver (unset: the variable's own).
  Status AddValues(wire::OutFrame& frame, proto::PullReply::Builder p, const std::vector<std::string>& names,
                   bool averages, const std::vector<std::optional<DType>>& want = {});
  void HandlePush(uint64_t id, proto::Push::Reader r);
  void HandleWaitToken(uint64_t id, proto::WaitToken::Reader r);
  void HandleStatus(uint64_t id);
  void HandleFinish(uint64_t id);
  void HandleGetSlot(uint64_t id, proto::GetSlot::Reader r);
  void HandlePullRows(uint64_t id, proto::PullRows::Reader r);
  void HandleSetLearningRate(uint64_t id, double lr);
  void HandleCheckpoint(uint64_t id);
  void HandleRecover(uint64_t id, proto::Recover::Reader r);  // an operator's (README "Losing a shard's checkpoints")
  void HandlePlace(uint64_t id, proto::Place::Reader r);
  void HandleReduce(uint64_t id, proto::Reduce::Reader r);
  void HandleUpdate(uint64_t id, proto::Update::Reader r);
  // Arms a deadline for a parked collective: `expire` runs on the strand if it passes first; a
  // reply sent before it cancels it (ParkedReply::Answer).
  void ArmDeadline(int64_t timeout_ms, const std::shared_ptr<ParkedReply>& reply, std::function<void()> expire);
  void HandleGetPlacement(uint64_t id);
  // Cluster: this daemon's shard, the chief and the epoch of `engine_epoch`.
  template <typename B>
  void FillCluster(B b, uint64_t engine_epoch);

  // Waits for a token with a deadline; `done` runs on the strand exactly once.
  // Parks a token wait bounded by timeout_ms (<= 0: psd's default); `done` runs on the strand.
  // Returns the parked wait (its cancel answers `done` with a status), or nullptr when answered
  // at once.
  std::shared_ptr<TokenWait> WaitForToken(int64_t timeout_ms, TokenDone done);
  void FinishTokenWait(const std::shared_ptr<TokenWait>& w, const Status& s, int64_t token);

  std::shared_ptr<wire::OutFrame> NewReply(uint64_t id, proto::Response::Builder* resp);
  void SendError(uint64_t id, const Status& status);
  void Send(std::shared_ptr<wire::OutFrame> frame);
  void WriteNext();

  Server& server_;
  ByteStream stream_;  // plain TCP, or TLS with --tls-cert-file
  asio::strand<asio::io_context::executor_type> strand_;
  const uint64_t id_;

  uint32_t first_[2] = {0, 0};
  std::vector<uint32_t> table_;
  wire::InFrame in_;
  std::vector<uint32_t> body_sizes_;  // the frame whose body is awaited
  uint64_t body_words_ = 0;
  uint64_t charged_ = 0;            // bytes of the server's FrameBudget this connection holds
  asio::steady_timer frame_timer_;  // --frame-timeout-ms for the body being read
  uint64_t body_gen_ = 0;           // bumped per body read: a stale frame-timer expiry is ignored
  bool reading_body_ = false;
  bool hello_done_ = false;  // a worker's hello was accepted
  bool greeted_ = false;     // any hello (worker, observer, peer) was accepted
  asio::steady_timer timer_;
  std::chrono::steady_clock::time_point hello_deadline_;
  std::chrono::steady_clock::time_point last_frame_ = std::chrono::steady_clock::now();
  // Parked reduce/update replies.
  std::set<std::shared_ptr<ParkedReply>> collectives_;
  bool authenticated_ = false;  // a hello with the right token (or no token required)
  uint32_t worker_index_ = 0;
  int peer_shard_ = -1;   // another shard of the cluster (after its peer hello; its proof with a secret)
  int peer_claim_ = -1;   // the shard a peer hello claims while its proof is awaited
  bool closing_ = false;  // close once the write queue drains
  bool closed_ = false;
  // While a peer's proof is awaited: the dialer's nonce followed by this shard's.
  std::string peer_nonces_;

  std::deque<std::shared_ptr<wire::OutFrame>> write_queue_;
  bool writing_ = false;
  std::set<std::shared_ptr<TokenWait>> parked_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_NET_CONNECTION_H_
