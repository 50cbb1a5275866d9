// WorkerSession: the wire service of one connection (README "Architecture"): where a frame's
// Cap'n Proto request becomes calls on the training core, the worker registry and the cluster, and
// their results become the reply. It never touches the socket: its Connection (net/connection.h)
// reads and writes the frames, and the session tells it which role the hello admitted (worker,
// observer, shard), which sets what the connection may send. Its handlers live in
// worker_session.cc (hello, variables, tokens, operators), session_push.cc (pushes, and the copy of
// what psd reads in a worker's segment before it is answered), session_pull.cc (values, slots,
// rows), session_peer.cc (a shard link's hello and proof) and session_collectives.cc (reduce_to,
// update); how values are put into replies is service/reply_values.h.
//
// Malformed input: a well-framed message that fails to decode or validate gets an error reply
// and the connection stays usable; a peer message from anything but a proven shard link, or in
// another shard's name, closes it. Nothing a peer sends reaches an assertion.
//
// Thread-safety: every member is touched only on the connection's strand.
#ifndef PSD_SERVER_SERVICE_WORKER_SESSION_H_
#define PSD_SERVER_SERVICE_WORKER_SESSION_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/token_queue.h"
#include "net/connection.h"
#include "net/parked_reply.h"
#include "net/peer_auth.h"
#include "net/shm_listener.h"
#include "psd.capnp.h"
#include "service/reply_values.h"
#include "wire/asio.h"
#include "wire/frame.h"

namespace psd::server {

class ServiceHost;
class TrainingEngine;

class WorkerSession : public FrameHandler, public std::enable_shared_from_this<WorkerSession> {
 public:
  // `host` outlives the session.
  WorkerSession(ServiceHost& host, std::shared_ptr<Connection> conn);

  // FrameHandler (on the connection's strand).
  void OnFrame(const wire::InFrame& frame) override;
  std::shared_ptr<wire::OutFrame> ErrorReply(uint64_t id, const Status& status) override;
  bool Busy() override;
  void OnClosed() override;

 private:
  using TokenDone = std::function<void(const Status&, int64_t token)>;
  // A parked token wait (WaitForToken): a timer and a callback, never a thread.
  struct TokenWait {
    // Its deadline, made when it is armed (on the strand): a wait answered by the handler that
    // parked it (the push that completes a step; with one worker, every push) never arms one, and
    // a timer costs a lookup of asio's timer service under its registry's lock to make, and a lock
    // of the reactor's timer queue to destroy.
    std::optional<asio::steady_timer> timer;
    std::function<bool(const Status&)> cancel;  // removes the parked wait; false if already released
    bool from_queue = false;                    // a token-queue wait (a delivered token goes back if unused)
    std::shared_ptr<TrainingEngine> engine;     // whose queue it waits on
    bool done = false;
    TokenDone on_done;
    int64_t timeout_ms = 0;
    std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  };
  // Token waits answered while this session's frame handler runs on this thread (the push that
  // completes a step releases a token to its own parked wait, or one is there already): finished
  // when the handler returns (FinishInline) instead of through a post to the strand, which costs
  // an allocation, a strand hand-off and the I/O loop's wake-up. A wait parked by the handler and
  // not answered in it has its deadline armed then, not before, so a wait answered in the handler
  // never arms and cancels a timer.
  struct Answered {
    std::shared_ptr<TokenWait> wait;
    Status status;
    int64_t token = 0;
  };
  static thread_local WorkerSession* handling_;  // the session whose OnFrame runs on this thread
  std::vector<Answered> answered_inline_;
  // Replies handed to the connection or the waiting list (Send, WhenSettled): a token wait's answer
  // that throws before it hands its reply over has sent nothing (FinishTokenWait).
  uint64_t replies_handed_ = 0;
  std::vector<std::shared_ptr<TokenWait>> unarmed_;
  void FinishInline();
  void ArmTokenDeadline(const std::shared_ptr<TokenWait>& w);

  // Answers `id` with `status` and closes once the reply is written.
  void FailStream(const Status& status, uint64_t id) { conn_->FailStream(status, id); }
  // Every reply but a push frame's with more to come (`keep_held`) ends the worker's call, after
  // which it may write its segment again: the gradients the engine still points at in it are
  // copied first (SettleHeld). Where that copy finds no memory the reply waits (WhenSettled), and
  // every frame after it behind it. `on_drop`: what to undo if the frame is never sent whole (it
  // waits and the connection closes, or the connection drops it: a token it carries goes back).
  // Either the frame is handed over (replies_handed_ counts it) or, out of memory, this throws
  // having sent nothing.
  void Send(std::shared_ptr<wire::OutFrame> frame, bool keep_held = false, std::function<void()> on_drop = nullptr) {
    if (unsettled_.empty() && (keep_held || SettleHeld())) {
      conn_->Send(std::move(frame), std::move(on_drop));
    } else {
      SendLater(std::move(frame), std::move(on_drop));
    }
    ++replies_handed_;
  }
  // Runs `then` once what psd still reads in the worker's segment is copied (SettleHeld): now, or,
  // when the copy finds no memory, from a try every kSettleRetry on the strand that makes it, in
  // order with what waits already; or, if the connection closes first, `on_drop` instead. Values
  // written into the segment go through it.
  template <typename F, typename D = std::function<void()>>
  void WhenSettled(F&& then, D&& on_drop = {}) {
    if (unsettled_.empty() && SettleHeld()) return then();
    Unsettled({std::function<void()>(std::forward<F>(then)), std::function<void()>(std::forward<D>(on_drop))});
    ++replies_handed_;  // its fate is the waiting list's: `then` runs, or `on_drop`
  }
  // What the hello admitted is the connection's role (it also sets what the connection may send).
  bool greeted() const { return conn_->role() != Connection::Role::kNone; }  // any hello accepted
  bool is_worker() const { return conn_->role() == Connection::Role::kWorker; }

  void Dispatch(proto::Request::Reader req);
  void HandleHello(uint64_t id, proto::Hello::Reader r);
  void HandleUseLane(uint64_t id);  // Request.useLane
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
  // want: empty, or per name the dtype to deliver (unset: the variable's own). ranges: empty, or
  // per name the elements to deliver (as a flat [count]; INVALID_ARGUMENT outside the value).
  // to_shm: write them into this connection's shared memory there instead (Pull.toShm), or, where
  // the worker maps the values segment and the value is kept there as asked, name it in place.
  Status AddValues(wire::OutFrame& frame, proto::PullReply::Builder p, const std::vector<std::string>& names,
                   bool averages, const std::vector<std::optional<DType>>& want = {},
                   const std::vector<ElementRange>& ranges = {}, std::optional<ShmTarget> to_shm = std::nullopt);
  // A request's shared-memory target (unset when it has none).
  static std::optional<ShmTarget> TargetOf(bool has, proto::ShmTarget::Reader r);
  // FAILED_PRECONDITION: values asked into shared-memory segment `segment`, which the connection
  // does not have.
  static Status NoSegment(unsigned segment);
  // A tensor of a request: in the frame, or in this connection's shared memory (*lease, taken on
  // the first such tensor, keeps the segments mapped and unrevoked while the caller reads them).
  Result<wire::TensorRef> ReadTensorIn(proto::Tensor::Reader t, ShmSlot::Lease* lease) const;
  void HandlePush(uint64_t id, proto::Push::Reader r);
  // Async/ssp on a cluster with --replicas-per-shard 2: a change is acknowledged only once the next
  // shard keeps a copy of this shard's part that holds it (cluster/replication.cc).
  bool CopiesOnArrival() const;
  // Runs `then` on the strand (not if the connection closed meanwhile) once a copy taken after
  // this call, of what the engine of `epoch` applied, is kept by the next shard — OK — or with
  // UNAVAILABLE when the cluster stops serving or re-forms first. Only when CopiesOnArrival().
  // `then` answers request `id` (AnswerPosted).
  void AfterCopy(uint64_t id, uint64_t epoch, std::function<void(const Status&)> then);
  // Runs `answer`, an answer to request `id` that runs from a post after its handler returned (a
  // parked collective's, one after a copy): what it throws — no memory for the reply, the values it
  // carries in another dtype, say — answers `id` with RESOURCE_EXHAUSTED instead (AnswerFailed), so
  // the worker never waits out its deadline for a reply that will not come. A throw inside a
  // handler closes the connection (Connection::OnBody); a posted one would reach the I/O loop.
  template <typename F>
  void AnswerPosted(uint64_t id, F&& answer) {
    try {
      answer();
    } catch (const std::exception& e) {
      AnswerFailed(id, e.what());
    }
  }
  // Answers `id` with RESOURCE_EXHAUSTED naming `why`, or, without memory even for that, closes.
  void AnswerFailed(uint64_t id, const std::string& why);
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
  // `after`: the local step of the push the wait follows (sync: it takes a token released after
  // that step, or an initial one; TokenQueue); negative (TokenQueue::kAnyStep): a wait of no known
  // step, any token.
  std::shared_ptr<TokenWait> WaitForToken(int64_t timeout_ms, TokenDone done, int64_t after = TokenQueue::kAnyStep);
  // The deadline of a parked wait a request asks for: <= 0 is psd's default
  // (--token-timeout-ms); more than kMaxWaitMs (7 days) is kMaxWaitMs, so any value a peer
  // sends stays a deadline (and milliseconds never overflow as clock ticks).
  static constexpr int64_t kMaxWaitMs = 7LL * 24 * 3600 * 1000;
  int64_t WaitMs(int64_t requested) const;
  // Answers a wait once (its on_done). Never loses a token: one for a closed connection, or whose
  // answer could not be made, goes back to the queue (the worker then hears ResourceExhausted).
  void FinishTokenWait(const std::shared_ptr<TokenWait>& w, const Status& s, int64_t token);

  std::shared_ptr<wire::OutFrame> NewReply(uint64_t id, proto::Response::Builder* resp);
  void SendError(uint64_t id, const Status& status);

  ServiceHost& host_;
  const std::shared_ptr<Connection> conn_;
  const uint64_t id_;  // the connection's
  // Parked reduce/update replies.
  std::set<std::shared_ptr<ParkedReply>> collectives_;
  bool authenticated_ = false;  // a hello with the right token (or no token required)
  uint32_t worker_index_ = 0;
  std::string worker_name_;  // the worker's stable name (orders a step's sum with --deterministic)
  int peer_shard_ = -1;      // another shard of the cluster (after its peer hello; its proof with a secret)
  int peer_claim_ = -1;      // the shard a peer hello claims while its proof is awaited
  // While a peer's proof is awaited: the dialer's nonce followed by this shard's.
  std::string peer_nonces_;
  std::set<std::shared_ptr<TokenWait>> parked_;
  // Async/ssp with replicas: replies waiting for the next shard to keep their copy (AfterCopy).
  int awaiting_copies_ = 0;
  // A worker's shared-memory segment, once attached (offered at its hello when psd has a ShmListener).
  std::shared_ptr<ShmSlot> shm_;
  // Sync mode: the hold (GradRef::hold) passed with the gradients this call's pushes read from the
  // worker's segment (it keeps the segment mapped). The worker leaves them as they are until it is
  // answered; before that, whatever the engine still points at is copied (TrainingEngine::
  // ResolveHeld, unless the step's take did it already) and the hold let go.
  std::shared_ptr<const void> held_;
  std::weak_ptr<TrainingEngine> held_engine_;  // the engine held_ was first passed to
  bool pushes_wait_ = true;                    // this worker's last push waited for the token (sync)
  // False: psd had no memory for the copy (TrainingEngine::ResolveHeld); the hold stays.
  bool SettleHeld();
  // What waits for SettleHeld (WhenSettled), in order: run once a try every kSettleRetry on the
  // strand (settle_timer_) makes the copy, or dropped when the connection closes. A worker has a
  // call or two in flight: one with more than kMaxUnsettled waiting is closed.
  static constexpr std::chrono::milliseconds kSettleRetry{50};
  static constexpr size_t kMaxUnsettled = 64;
  struct Waiting {
    std::function<void()> run;
    std::function<void()> on_drop;  // (may be empty)
  };
  std::vector<Waiting> unsettled_;
  std::optional<asio::steady_timer> settle_timer_;
  void Unsettled(Waiting waiting);
  void SendLater(std::shared_ptr<wire::OutFrame> frame, std::function<void()> on_drop);
  void RetrySettle();
  // Drops what waits (their on_drop run), and closes the connection when `close`.
  void DropUnsettled(bool close);
  // A PullRows answer (HandlePullRows, once settled when the rows go into the worker's segment).
  void AnswerPullRows(uint64_t id, const std::vector<int64_t>& rows, const std::string& name,
                      const std::optional<ShmTarget>& target, bool has_dtype, proto::DType dtype);
  // The published buffers that replies named in the values segment (ValuesSegment), per reply
  // (request id), oldest first: held until the worker says it read them (Request.valuesRead), the
  // connection closes, or newer replies push them out (a worker that never says so reads what it
  // gets): at most kMaxHeldReplies replies, and distinct buffers of at most kHeldModels versions of
  // the model's values. An honest worker holds what its pulls in flight name (one step's values
  // in sync, two while it pipelines; a version per thread pulling in async); one that never says it
  // read them would otherwise keep an old version of the model alive per reply, 64 of them.
  // `new_reply`: the first value a reply names (one entry per reply); `value_bytes`: the engine's.
  static constexpr size_t kMaxHeldReplies = 64;
  static constexpr uint64_t kHeldModels = 8;
  Mutex held_mu_;
  std::deque<std::pair<uint64_t, std::vector<std::shared_ptr<const Buffer>>>> held_values_ GUARDED_BY(held_mu_);
  std::unordered_map<const Buffer*, uint32_t> held_refs_ GUARDED_BY(held_mu_);  // replies naming each buffer
  uint64_t held_bytes_ GUARDED_BY(held_mu_) = 0;                                // of the distinct buffers
  void HoldValue(uint64_t id, std::shared_ptr<const Buffer> value, bool new_reply, uint64_t value_bytes)
      EXCLUDES(held_mu_);
  void ValuesRead(uint64_t id) EXCLUDES(held_mu_);
  // Drops the oldest held reply's buffers (into *out, let go by the caller outside the lock).
  void DropOldestHeldLocked(std::vector<std::vector<std::shared_ptr<const Buffer>>>* out) REQUIRES(held_mu_);
  // A value bigger than a frame arriving in chunks (CreateVariable.chunked, Update.chunked):
  // gathered here, used with the last chunk; dropped by any request of another kind, a chunk that
  // does not follow, or the connection's end.
  struct PendingValue {
    proto::Request::Which kind = proto::Request::CREATE_VARIABLE;  // the request the chunks belong to
    std::string name;                                              // the variable's
    DType dtype = DType::kFloat32;                                 // of the chunks
    Shape shape;
    std::shared_ptr<Buffer> value;  // the whole value, filled in order (a create's is adopted by the engine)
    size_t filled = 0;              // bytes received
    // A create's: its bytes reserved against --max-model-bytes until it is a variable (or dropped).
    std::shared_ptr<void> reservation;
  };
  std::optional<PendingValue> pending_value_;
  // The push in progress (Push.more): the last row so far of each sparse gradient whose rows
  // continue in a later frame (Gradient.rowsMore), by variable.
  std::map<std::string, int64_t, std::less<>> sparse_rows_last_;
  bool in_push_ = false;          // the last push frame was taken with more to come
  bool push_unfinished_ = false;  // a push's frames were taken and its last one was not
  bool push_refused_ = false;     // a frame of a push was refused: the rest of it is, to its last frame
  // Adds one chunk of a `kind` request for variable `name` (chunkOffset, chunkedShape and more as
  // the request says); *complete: the last one came and pending_value_ is whole. Errors drop it.
  Status GatherChunk(proto::Request::Which kind, const std::string& name, int64_t offset,
                     capnp::List<int64_t>::Reader shape, bool more, const wire::TensorRef& chunk, bool* complete);
  // GatherChunk for request `id` whose chunk is `*t`: once the last chunk came, `*t` is the whole
  // value and the result holds it (keep it while `*t` is used); nullopt once request `id` is
  // answered (`none` for a chunk taken, the error for one refused).
  std::optional<PendingValue> TakeChunk(uint64_t id, proto::Request::Which kind, const std::string& name,
                                        int64_t offset, capnp::List<int64_t>::Reader shape, bool more,
                                        wire::TensorRef* t);
};

}  // namespace psd::server

#endif  // PSD_SERVER_SERVICE_WORKER_SESSION_H_
