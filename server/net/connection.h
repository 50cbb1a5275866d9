// Connection: one socket's frames, and nothing else (the transport layer, README "Architecture").
// It reads frames (size-checked before any allocation), hands each whole frame to its
// FrameHandler (the wire service: service/worker_session.h) and writes the frames it is given,
// in order, with scatter-gather writes. It knows frames, not what they say: the handler decodes
// them, and never touches the socket.
//
// Before the handler admits a role (worker, observer or shard), a connection reads only frames of
// at most kPreHelloFrameBytes (refused from the header, before any allocation), and the role must
// be admitted within --hello-timeout-ms; afterwards it is closed when idle (no frame received and
// the handler not Busy) past --idle-timeout-s. An observer's frames (a tool: status, checkpoint,
// placement) stay within kPreHelloFrameBytes too: only workers and shards send big ones.
//
// Memory: the body buffer of a worker's or a shard's connection is charged to the daemon's
// FrameBudget (--max-inflight-bytes) before it is allocated (other connections' frames are at most
// kPreHelloFrameBytes, so --max-connections bounds them, and they never wait for the budget).
// When the budget is spent the connection stops reading until its share is granted
// (backpressure); once granted, the frame must arrive within --frame-timeout-ms or the connection
// is closed. After a frame, a buffer kept for reuse stays charged, unless others are waiting for
// the budget: then it is given back at once.
//
// Malformed input: a frame whose header is bad or over --max-frame-bytes gets the handler's error
// reply and the connection is closed (the stream cannot be resynchronised).
//
// Thread-safety: every member is touched only on the connection's strand, except Start (once) and
// CloseGracefully (any thread). Handler calls run on the strand.
#ifndef PSD_SERVER_NET_CONNECTION_H_
#define PSD_SERVER_NET_CONNECTION_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "net/byte_stream.h"
#include "net/frame_budget.h"
#include "net/peer_auth.h"
#include "psd/status.h"
#include "wire/asio.h"
#include "wire/frame.h"

namespace psd::server {

// What a connection's frames go to. Every call runs on the connection's strand.
class FrameHandler {
 public:
  virtual ~FrameHandler() = default;
  // A whole frame arrived; `frame` is valid until the call returns.
  virtual void OnFrame(const wire::InFrame& frame) = 0;
  // The reply a broken stream gets before the connection closes (`id` 0: not known).
  virtual std::shared_ptr<wire::OutFrame> ErrorReply(uint64_t id, const Status& status) = 0;
  // Something is parked (a token wait, a collective): the connection is not idle.
  virtual bool Busy() = 0;
  // The connection closed; called once, after which nothing is sent.
  virtual void OnClosed() = 0;
};

// What a connection is told by the daemon that accepted it.
struct ConnectionEnv {
  int64_t hello_timeout_ms = 5000;
  int64_t idle_timeout_s = 0;  // 0: never
  int64_t frame_timeout_ms = 60000;
  uint64_t max_frame_bytes = 256ull << 20;
  // --max-queued-reply-bytes: on any connection, the reply bytes (their messages' segments: a
  // pull's values are referenced, `pull_rows` replies and errors are copies) that may wait to be
  // written before psd stops reading requests until they go out. A worker that pipelines requests
  // and never reads would otherwise grow psd without bound (40 `pull_rows` of 4096 rows took
  // 640 MB). One request's reply is queued whole; reading resumes below the bound. libpsclient
  // leaves at most half of it unread while it sends (it learns the bound at hello).
  uint64_t max_queued_reply_bytes = 64ull << 20;
  FrameBudget* budget = nullptr;  // required; outlives the connection
  // Where big frames' body buffers come from (null: the heap); outlives the connection.
  wire::BufferSource* frame_buffers = nullptr;
  std::shared_ptr<wire::ssl::context> tls;
  // Rate limit of what a connection that has not said hello (or an observer's) makes psd log: a
  // failed TLS handshake, no hello in time, a refused frame. Null: every line.
  peer_auth::LogLimiter* stranger_log = nullptr;
  // Counters (may be empty).
  std::function<void(uint64_t bytes)> on_bytes_in;
  std::function<void(uint64_t bytes)> on_bytes_out;
  std::function<void()> on_frame_timeout;
  std::function<void()> on_reads_paused;  // too many replies, or reply bytes, were waiting
};

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // The largest frame read before a role is admitted (a hello is well under 1 KiB).
  static constexpr uint64_t kPreHelloFrameBytes = 64 << 10;
  // Replies that may wait to be written, on a connection without a hello or an observer's, before
  // psd stops reading its next request: one that sends requests and never reads the answers is
  // held up by TCP, not by psd's memory. Workers and shards pipeline up to
  // ConnectionEnv::max_queued_reply_bytes of replies (a chunked push has a reply per frame).
  static constexpr size_t kMaxQueuedRepliesUntrusted = 8;
  // The most segments a message may have on such a connection (a hello has one or two).
  static constexpr uint32_t kMaxSegmentsUntrusted = 16;

  // Who the handler admitted: what the connection may send.
  enum class Role {
    kNone,      // no hello yet: small frames only, within --hello-timeout-ms
    kObserver,  // a tool: small frames only
    kWorker,    // frames up to --max-frame-bytes, charged to the budget
    kShard,     // the same, for another shard's peer link
  };

  Connection(tcp::socket socket, const ConnectionEnv& env, uint64_t id);
  uint64_t id() const { return id_; }
  // A peer whose host died (power, a partition) sends no FIN: its connection would look open
  // forever, its worker never counted gone (--worker-grace-s never starts; TF #5022). Start() turns
  // on TCP keepalive (probes after kKeepAliveIdleS idle, every kKeepAliveIntervalS, kKeepAliveProbes
  // of them): an idle dead host's connection closes within about a minute, a live one that computes
  // for hours is untouched (its kernel answers). (No TCP_USER_TIMEOUT: it also ends a connection
  // whose reader keeps a zero window that long, as a worker still sending a big push before it reads
  // the replies; data unacknowledged by a dead host ends with the kernel's retransmissions.)
  static constexpr int kKeepAliveIdleS = 30;
  static constexpr int kKeepAliveIntervalS = 5;
  static constexpr int kKeepAliveProbes = 4;
  // The options above on `fd` (false: the kernel refused one; the connection works without it).
  static bool DetectDeadPeer(int fd);
  // Starts the handshake (TLS) and the reads; `handler` gets the frames. Call once.
  void Start(std::shared_ptr<FrameHandler> handler);

  // On the strand:
  // Queues a frame; written after those queued before. Either it is queued, or (out of memory)
  // this throws having changed nothing. A frame the connection never writes whole (it is closed
  // first, or the write fails) is dropped and its `on_unsent` runs, on the strand: what the frame
  // carried is undone (a token in it goes back to the queue).
  void Send(std::shared_ptr<wire::OutFrame> frame, std::function<void()> on_unsent = nullptr);
  // Runs such an undo (nothing if empty) for a frame never written whole, here or in a sender's
  // own waiting list; logs what it throws.
  void RunOnUnsent(const std::function<void()>& on_unsent);
  // Sends `frame` (an error reply) and closes once it is written; reads stop now.
  void SendAndClose(std::shared_ptr<wire::OutFrame> frame);
  // Logs `status`, answers request `id` (0: not known) with the handler's error reply and closes
  // once it is written: for input after which the stream cannot go on.
  void FailStream(const Status& status, uint64_t id = 0);
  void CloseNow();
  void set_role(Role role) {
    role_ = role;
    if (role != Role::kNone) awaiting_hello_ = false;
  }
  // For the daemon's queue of connections that have not said hello (base/waiting_queue.h): at
  // --max-connections the one that has waited longest makes room for a newcomer. Any thread.
  bool waiting() const { return awaiting_hello_.load(); }
  // Closes it if it still has said no hello; false once it has (or is closed).
  bool Evict();
  // The hello was answered with "retry later": --hello-timeout-ms starts again. A client that said
  // a valid hello is not one of those that make room at --max-connections (Evict).
  void RestartHelloDeadline() {
    hello_deadline_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(env_.hello_timeout_ms);
    awaiting_hello_ = false;
  }
  Role role() const { return role_; }
  // No hello yet, or an observer's: small frames, not charged to the budget, few replies queued.
  bool untrusted() const { return role_ == Role::kNone || role_ == Role::kObserver; }
  bool closed() const { return closed_; }
  // On the strand, while handling a frame (Request.useLane): every frame after this one, both ways,
  // travels in `lane` (the worker's shared-memory lane, common/wire/shm_lane.h); the socket is then
  // only watched for its end, after which what the lane holds is read and the connection closes. Refused (nothing
  // changes) unless this is a worker's plain TCP connection, not on a lane yet, with nothing read beyond this frame and
  // no reply still being written.
  Status UseLane(std::shared_ptr<wire::ShmLane> lane);
  bool on_lane() const { return stream_.on_lane(); }
  // The TLS stream (null for plain TCP), for handshake details the handler logs.
  ByteStream& stream() { return stream_; }

  // The strand every handler call runs on; completions that touch the handler post here.
  const asio::strand<asio::io_context::executor_type>& strand() const { return strand_; }

  // Closes once queued frames are written (bounded by the socket). Any thread.
  void CloseGracefully();

 private:
  void ReadHeader();
  void ReadTable(uint32_t segment_count, size_t rest);
  void ReadBody(uint32_t segment_count);
  // Reads the body of body_sizes_ once the budget holds it.
  void ReadGrantedBody();
  void OnBody();  // the body is in: hand the frame over, then read the next header
  // Runs `then` once ahead_, empty, holds at least `need` (ahead_.Small) bytes; closes on error.
  template <typename F>
  void FillAhead(size_t need, F then);
  // A read failed with `ec`: closes (saying why when the worker broke its lane).
  void ReadFailed(const boost::system::error_code& ec);
  // Logs that the worker broke its lane, when `ec` says so (the connection then closes).
  void NoteLaneBroken(const boost::system::error_code& ec);
  // On a lane: the socket's end ends the reads once the lane is read (a byte on it, or an error,
  // closes the connection at once).
  void WatchSocket();
  // Reads n bytes into dst, then runs `then`: what the read-ahead holds first, then a small rest
  // through the read-ahead (one read that may bring the next frame's start too), a big one in place.
  template <typename F>
  void ReadExact(void* dst, size_t n, F then);
  // Gives the body buffer's memory and its budget share back.
  void ReleaseBuffer();
  void KeepOrReleaseBuffer();  // after a frame: keep the buffer for the next one, offered back to the budget
  void WithdrawIdle();         // the kept buffer is about to be used: no longer idle
  void EndIdleOffer();         // closed: the budget forgets the offer
  // Gives the budget share back (CloseNow; the buffer goes once DropBufferIfClosed may).
  void ReleaseCharge();
  // Closed and no read lands in the body buffer: its memory goes back.
  void DropBufferIfClosed();
  // Logs a warning about this connection, rate-limited while it is untrusted (env_.stranger_log).
  void Warn(const std::string& what);
  // The per-connection timer: the hello deadline until a role is admitted, then the idle check.
  void ArmTimer(std::chrono::steady_clock::duration after);
  void OnTimer();
  // Writes the queued frames in turn. Plain TCP, not closing: each is first offered to the socket
  // from here, and one the socket takes whole is done with no completion to run.
  void WriteNext();
  // The front frame is done with: `n` of its bytes went out, all of them unless `ec`. False: the
  // write failed and the connection closed.
  bool FrameWritten(const boost::system::error_code& ec, size_t n);
  void WriteQueued();  // WriteNext's loop (it may throw; WriteNext closes then)
  // Replies waiting past kMaxQueuedRepliesUntrusted (untrusted) or --max-queued-reply-bytes (any role).
  bool TooManyQueued() const;

  const ConnectionEnv env_;
  ByteStream stream_;  // plain TCP, or TLS with --tls-cert-file
  asio::strand<asio::io_context::executor_type> strand_;
  const uint64_t id_;
  std::shared_ptr<FrameHandler> handler_;  // reset when closed (it may hold this connection)

  // What one read brought beyond what was asked for: the next header, a small frame's table and
  // body. A small frame then costs one read (and one completion) instead of three; a body beyond
  // what is held is read in place. 16 KiB, allocated at the first read; per connection, never more.
  wire::ReadAhead ahead_{16 << 10};

  uint32_t first_[2] = {0, 0};
  std::vector<uint32_t> table_;
  wire::InFrame in_;
  std::vector<uint32_t> body_sizes_;  // the frame whose body is awaited
  uint64_t body_words_ = 0;
  uint64_t charged_ = 0;            // bytes of the daemon's FrameBudget this connection holds
  asio::steady_timer frame_timer_;  // --frame-timeout-ms for the body being read
  uint64_t body_gen_ = 0;           // bumped per body read: a stale frame-timer expiry is ignored
  bool reading_body_ = false;
  bool read_in_place_ = false;    // a read into the body buffer is under way (it must outlive it)
  bool awaiting_share_ = false;   // a frame's header is in, its budget share not yet granted
  bool read_paused_ = false;      // too many replies wait (TooManyQueued): reads resume as they go out
  bool idle_offered_ = false;     // the kept buffer is idle: its charge may be reclaimed (OfferIdle)
  bool idle_registered_ = false;  // the budget holds this connection's offer (until an Acquire runs it)
  Role role_ = Role::kNone;
  asio::steady_timer timer_;
  std::chrono::steady_clock::time_point hello_deadline_;
  // The last frame read or reply written (--idle-timeout-s counts from it).
  std::chrono::steady_clock::time_point last_frame_ = std::chrono::steady_clock::now();
  bool closing_ = false;  // close once the write queue drains
  bool closed_ = false;
  std::atomic<bool> awaiting_hello_{true};  // no role admitted yet, not closed (read off the strand)

  struct Queued {
    std::shared_ptr<wire::OutFrame> frame;
    uint64_t bytes = 0;               // its body bytes
    std::function<void()> on_unsent;  // run if it is dropped unwritten (Send)
  };
  std::deque<Queued> write_queue_;
  uint64_t queued_bytes_ = 0;  // their sum
  bool writing_ = false;       // the queue's front is being written (now, or asynchronously)
  // Runs on_unsent of every frame queued and not being written, and empties the queue (closed).
  void DropQueued();
};

}  // namespace psd::server

#endif  // PSD_SERVER_NET_CONNECTION_H_
