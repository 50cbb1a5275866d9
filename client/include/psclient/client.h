// libpsclient: the worker side of psd.
//
//   auto client = psclient::Client::Connect({.host = "127.0.0.1", .port = 7070,
//                                            .worker_name = "worker-0"});
//   client->CreateVariable("w", initial_view);          // create-or-get, idempotent
//   int64_t step = *client->Pull("w", w_view);          // value written into caller memory
//   auto out = client->Push(local_step, {{"w", grad_view}}, /*wait_token=*/true);
//   local_step = out->token;                            // the barrier: the new global step
//
// A cluster of psd shards (ClientOptions::cluster) is used the same way: the client learns where
// each variable lives (whole on one shard, or sliced by rows over several) and fans every call out
// to the shards concerned — requests are all sent before any reply is read, so the shards work in
// parallel. Token waits go to the elected chief shard; pulls check that every shard answered at
// the same global step.
//
// Errors are values (psd::Status / psd::Result); nothing here throws. The codes say what to do:
// kDeadlineExceeded -> retry the wait, kUnavailable -> back off (the next call reconnects),
// kInvalidArgument -> fix the request, kOutOfRange -> training is over, kAborted -> the cluster
// restored a checkpoint: pull the variables again and go on from the step they carry
// (connection_epoch() has changed; SyncReplicasOptimizer does this by itself).
//
// Memory: tensors are passed as views of caller memory; gradients are sent without an extra
// copy when they are 8-byte aligned and a multiple of 8 bytes long, and pulled values are written
// straight into the caller's view. Views with MemoryKind::kCuda need a PSD_WITH_CUDA build and
// answer kUnimplemented otherwise; they are copied on the view's `stream` (after the work queued
// there, waiting for no other stream) through pinned buffers the Client owns, and the copies are
// complete when the call returns (README "GPU trainers").
//
// Thread-safety: a Client may be shared between threads; calls are serialized on its single
// connection (a token wait blocks other calls on the same Client). Use one Client per thread for
// concurrency. Blocking: every call blocks until its reply; token waits are bounded by a deadline.
#ifndef PSCLIENT_CLIENT_H_
#define PSCLIENT_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "psd/export.h"
#include "psd/status.h"
#include "psd/tensor.h"

namespace psclient {

using psd::Code;
using psd::ConstTensorView;
using psd::DType;
using psd::MemoryKind;
using psd::Result;
using psd::Shape;
using psd::Status;
using psd::TensorView;

struct ClientOptions {
  std::string host = "127.0.0.1";  // an IP address or a host name (resolved at every connect)
  uint16_t port = 7070;
  // A cluster: every shard's "host:port", in psd's --cluster order (empty: host and port above).
  std::vector<std::string> cluster;
  std::string worker_name;         // stable identity; default "worker-<pid>"
  uint64_t incarnation = 0;        // bump on every restart; default: derived from the clock
  int connect_timeout_ms = 10000;  // bounds each (re)connect: name lookup, TCP connect, hello;
                                   // a refused connect is retried until then; then kUnavailable
                                   // (a cluster's shard lost after its first connect: 500 ms a
                                   // call, so the other shards' answers come through at once)
  // No call waits longer than this for its reply (a token wait: its own timeout + 10 s if longer);
  // past it the call fails with kDeadlineExceeded and the connection is reset. Keep it above
  // psd's --token-timeout-ms when waits use the daemon's default. (With shared buffers attached, a
  // reset first asks the daemon to touch them no more and waits up to 5 s for its answer: the
  // buffers are the caller's again when the call returns.)
  int64_t request_timeout_ms = 300000;
  uint64_t max_frame_bytes = 1ull << 30;  // largest reply accepted
  // A push bigger than this travels in frames of at most this many bytes, gradients cut into
  // chunks (psd adds each chunk as it arrives and holds one frame per connection, not the push);
  // a push of any size is sent, whatever psd's --max-frame-bytes (0: always one frame).
  uint64_t push_frame_bytes = 1ull << 20;
  // Values bigger than this are pulled in several replies of at most this many bytes (element
  // ranges, asked back to back), each copied into the caller's view as it arrives: the client
  // holds one reply, not the model, and a value of any size is read (`pull_after` values bigger
  // than this are pulled after the token). Within max_frame_bytes (0: one reply per pull, bounded
  // by max_frame_bytes).
  uint64_t pull_frame_bytes = 16ull << 20;
  // Latency-critical jobs: a reply that is not there yet is waited for by spinning on the socket
  // for up to this many microseconds before sleeping (0: sleep at once). Lower latency for small
  // steps at the cost of a core busy while the call waits; plain TCP only (TLS ignores it).
  int64_t busy_poll_us = 0;
  // Same-host shared memory (README "Same-host shared memory"): when a daemon offers it at hello
  // (it is on this host and in this network namespace), tensors move through a shared segment of
  // this many bytes instead of the socket; the connection stays the control path. Virtual size:
  // pages are used only as touched (about the biggest push plus pull of one call). A call that
  // does not fit, and any failure to attach, goes over TCP. 0: never.
  uint64_t shared_memory_bytes = 1ull << 30;
  // With that segment, the connection's frames too (requests and replies, not only tensors) move
  // through a shared-memory lane psd makes for it (two rings and eventfd doorbells; the TCP
  // connection stays open beside it, its end the daemon's end): a small step then costs no
  // loopback TCP. Plain TCP only (with TLS the frames stay on the TLS stream). False: frames over TCP.
  bool shm_lane = true;
  // Through that segment, a push or a pull that copies more than this many bytes moves in pieces
  // of about this size, each named by its own frame, so that one side's copy of a piece overlaps
  // the other side's work on the last (the client copies gradient piece k+1 in while psd adds
  // piece k; psd writes value range k+1 while the client copies range k out). 0: one piece.
  uint64_t shm_piece_bytes = 4ull << 20;
  // Threads that help copy big tensors (over 1 MiB) into and out of that segment: each such copy
  // is split between the calling thread and those of them idle at that moment, while at most two
  // copies of this client run at once. Idle, they sleep. 0: the calling thread alone.
  int copy_threads = 2;
  // Room for Client::AllocateShared's buffers, all together (virtual: pages are used only as
  // touched). Attached to a same-host daemon with the segment above when psd maps that much (its
  // --shm-max-bytes). 0: AllocateShared is refused.
  uint64_t shared_buffer_bytes = 1ull << 30;
  // An observer (admin tools, dashboards) is not a worker: it may only call GetStatus and
  // RequestCheckpoint, never becomes chief and does not count for the job.
  bool observer = false;
  std::string auth_token;  // psd's shared secret when it runs with --auth-token-file
  // TLS, for a psd that runs with --tls-cert-file: set `tls` (or any tls_* file). psd's certificate
  // is always verified: against tls_ca_file (default: the system's trust store) and the host dialled
  // (or tls_server_name).
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;  // this client's certificate and key, for psd --tls-require-client-cert
  std::string tls_key_file;
  std::string tls_server_name;  // the name psd's certificate must carry when it differs from the host
  bool tls_enabled() const { return tls || !tls_ca_file.empty() || !tls_cert_file.empty() || !tls_server_name.empty(); }
};

// The daemon's job settings, as announced in the handshake.
struct JobConfig {
  int replicas_to_aggregate = 0;
  int total_replicas = 0;
  int tokens_per_step = 0;
  int init_tokens = 0;
  std::string optimizer;
  double learning_rate = 0;
  bool reduction_sum = false;
  std::vector<std::string> slot_names;
  std::string mode;             // sync, async, ssp
  int64_t staleness_bound = 0;  // ssp
  double soft_sync_fraction = 0;
  int64_t step_deadline_ms = 0;
  double ema_decay = 0;
};

// How replicas' assignments to a variable combine (TF VariableAggregation); for a sync-on-read
// variable, how a read combines the replicas' own values.
enum class Aggregation { kNone, kSum, kMean, kOnlyFirstReplica };

struct VariableOptions {
  bool trainable = true;
  bool average = false;       // keep an exponential moving average on the daemon (psd --ema-decay)
  std::string optimizer;      // empty: the job's optimizer; else one of psd's, with the job's hyper-parameters
  std::string colocate_with;  // cluster: place on the same shard(s) as this existing variable
  Aggregation aggregation = Aggregation::kNone;
  // Each replica keeps its own value on the daemon (metrics, counters, batch-norm statistics);
  // a read combines them by `aggregation` (SUM, MEAN or ONLY_FIRST_REPLICA). Not trainable.
  bool sync_on_read = false;
};

// Distribution-aware primitives (README "Writing distribution-aware algorithms").
enum class ReduceOp { kSum, kMean };

struct ReduceResult {
  bool accepted = false;  // false: stale (tagged with an older step than the round), dropped
  int64_t step = 0;       // the destination's round it counted for
};

struct ReduceItem {
  ConstTensorView value;    // this replica's contribution
  std::string destination;  // a non-trainable variable, where the result lands
  TensorView result;        // the reduced value is written here (data == nullptr: not wanted)
};

// TF's CollectiveHints: values are packed into messages of at most bytes_per_pack per shard
// (0: one message per shard); timeout_ms bounds the wait for the other replicas (0: psd's).
struct CollectiveHints {
  uint64_t bytes_per_pack = 0;
  int64_t timeout_ms = 0;
};

enum class UpdateOp { kAssign, kAssignAdd, kAssignSub, kScale };

struct UpdateOptions {
  // true: one caller speaks for all replicas (applied at once). false: this replica's share —
  // combined by the variable's aggregation (or, sync-on-read, this replica's own value).
  bool cross_replica = true;
  int64_t local_step = 0;  // replica context: staleness as for gradients
  int64_t timeout_ms = 0;  // replica context: wait for the other replicas at most this long
  double factor = 1;       // kScale
  // Cross-replica, sync mode: staged and published with the next step's commit (on every shard),
  // so every replica reading after its token sees the new value at the same step.
  bool at_next_step = false;
};

// "h:p,h:p,..." (psd's --cluster syntax) as ClientOptions::cluster entries; empty items skipped.
// Client::Connect validates the entries (psd/cluster_list.h: ports 1..65535, no duplicates).
PSD_EXPORT std::vector<std::string> ParseClusterList(const std::string& list);

// The environment contract of the psrun launcher (README "Launching your trainer (psrun)"):
//   PSD_CLUSTER          "host:port[,host:port...]", every shard (one entry: a single daemon)
//   PSD_WORKER_INDEX     0..N-1               PSD_NUM_WORKERS   N
//   PSD_WORKER_NAME      "worker-<index>"     PSD_CHIEF_ELIGIBLE "1" for worker 0 only, else "0"
//   PSD_AUTH_TOKEN_FILE  the shared secret's file (unset: psd runs without one)
// Read only when a trainer asks (the daemon never reads environment variables).
struct LaunchEnvironment {
  // cluster (or host + port for a one-entry list), worker_name, auth_token; the rest defaults.
  ClientOptions options;
  int worker_index = -1;  // -1: PSD_WORKER_INDEX unset
  int num_workers = -1;   // -1: PSD_NUM_WORKERS unset
  // The launcher's pick for one-off work outside psd (exports, summaries, downloads): worker 0.
  // psd's own chief (Client::is_chief(), who initializes variables) is the first worker to say
  // hello; the launcher starts worker 0 first, but the two may differ.
  bool chief_eligible = false;
};

// Looks a variable up: its value, or std::nullopt when it is unset.
using EnvironmentLookup = std::function<std::optional<std::string>(const std::string& name)>;

// Reads the contract through `lookup` (default: the process environment). Errors
// (kInvalidArgument, naming the variable and what to set): PSD_CLUSTER unset or empty, an entry
// that is not host:port with a port in 1..65535, an index or count that is not a number, an index
// outside 0..N-1, PSD_CHIEF_ELIGIBLE other than 0/1, an unreadable or empty token file.
// PSD_WORKER_NAME defaults to "worker-<index>" when only the index is set.
PSD_EXPORT Result<LaunchEnvironment> ReadLaunchEnvironment(const EnvironmentLookup& lookup = {});
// ReadLaunchEnvironment().options: what Client::Connect needs to join the launched job.
PSD_EXPORT Result<ClientOptions> ClientOptionsFromEnvironment(const EnvironmentLookup& lookup = {});

// Where a variable lives in a cluster.
struct SlicePart {
  int shard = 0;
  int64_t row_begin = 0;  // sliced: rows [row_begin, row_end) of the whole variable
  int64_t row_end = 0;
};

struct VariablePlacement {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;          // the whole variable
  bool sliced = false;  // false: parts[0] holds the whole variable
  std::vector<SlicePart> parts;
};

struct PlacementMap {
  std::vector<VariablePlacement> variables;  // sorted by name
  std::vector<uint64_t> shard_bytes;         // bytes of values placed on each shard
};

struct VariableInfo {
  std::string name;
  DType dtype;
  Shape shape;
  bool created;  // this call created it
  bool trainable;
};

struct Gradient {
  std::string name;
  ConstTensorView grad;
};

// IndexedSlices: rows `indices` of variable `name` get `values` ([indices.size(), row dims...]).
// Indices may be in any order and repeat: Push sorts them and sums repeated rows before sending.
struct SparseGradient {
  std::string name;
  std::vector<int64_t> indices;
  ConstTensorView values;
  std::optional<Shape> dense_shape;  // TF's has_known_shape; checked against the variable
};

struct PushResult {
  bool accepted;      // false: stale (tagged with a step older than the accumulator's), dropped
  int64_t step;       // the accumulator's step (async/ssp: the global step) when the push was handled
  int64_t staleness;  // global step - local step when it was handled
};

struct PSD_EXPORT PushOutcome {
  std::vector<PushResult> results;  // one per gradient, in push order
  bool waited = false;              // a token wait was requested
  Status token_status;              // its outcome (kDeadlineExceeded, kOutOfRange, ...)
  int64_t token = 0;                // the new local step, when token_status is OK
  bool is_chief = false;
  int step_gradients = 0;    // gradients averaged (fewest per variable) in the last committed step
  int64_t pulled_step = -1;  // with pull_after: the step of the values written (-1: none)

  int accepted() const;
  int stale() const;
};

struct JobStatus {
  int64_t global_step = 0;
  bool is_chief = false;
  int64_t tokens_queued = 0;
  int workers_connected = 0;
  int workers_finished = 0;
  int replicas_required = 0;
  int64_t accepted_pushes = 0;
  int64_t stale_pushes = 0;
  int last_step_gradients = 0;
  int64_t max_staleness = 0;
  double learning_rate = 0;
  int64_t last_checkpoint_step = -1;
  JobConfig config;
  // Cluster (a single daemon: shard 0 of 1, chief 0, epoch 0, "running").
  int shard_index = 0;  // the shard that answered
  int shards = 1;
  int chief_shard = 0;  // -1: none elected right now
  uint64_t term = 0;
  uint64_t cluster_epoch = 0;
  std::string cluster_state;
  std::vector<int> missing_shards;
  // Where each shard is served now: its --cluster entry, or a stand-in's address (host:port) while
  // the next shard serves it after a takeover (README "Shard replicas"). Empty: a single daemon.
  std::vector<std::string> shard_addresses;
  // The daemon that answered.
  std::string version;
  double uptime_s = 0;
  bool ready = false;  // restored, formed and serving workers
};

namespace internal {
class SharedArena;
}

// Host memory shared with same-host daemons (Client::AllocateShared; README "Zero-copy shared
// buffers"). Views of it are used like any host memory in Push, Pull and pull_after: a same-host
// psd reads gradients from it and writes pulled values into it in place, with no copy on either
// side; with a daemon on another host (or shared memory off) it is plain memory that travels over
// TCP. Move-only. The block goes back to its client's arena when this goes (it may outlive the
// Client). While a call that uses it runs, the daemon may read or write it: change it only
// between calls.
class PSD_EXPORT SharedBuffer {
 public:
  SharedBuffer() = default;
  ~SharedBuffer();
  SharedBuffer(SharedBuffer&& other) noexcept;
  SharedBuffer& operator=(SharedBuffer&& other) noexcept;
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  void* data() const;
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data());
  }

 private:
  friend class Client;
  std::shared_ptr<internal::SharedArena> arena_;
  uint64_t offset_ = 0;
  size_t bytes_ = 0;
};

class PSD_EXPORT Client {
 public:
  // Connects and performs the handshake (protocol version, worker identity).
  static Result<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // The job settings of the last handshake — a copy: a reconnect on another thread may change
  // them. These getters and connection_epoch() may be called from any thread, during any call.
  JobConfig config() const;
  uint32_t worker_id() const;
  // Whether the daemon designated this worker as chief (as of the last reply that said so).
  bool is_chief() const;
  // The global step when the handshake happened.
  int64_t initial_global_step() const;

  // Create-or-get. `initial.data == nullptr` means zeros. An existing variable with another
  // dtype, shape or trainability is kAlreadyExists.
  Result<VariableInfo> CreateVariable(const std::string& name, ConstTensorView initial, bool trainable = true);
  Result<VariableInfo> CreateVariable(const std::string& name, ConstTensorView initial, const VariableOptions& options);

  // Writes the variable's value into `out` (dtype and shape must match). Returns the global step
  // the value reflects. The multi-variable form reads every value at one step, in one round trip.
  // A failed pull may have written some of the views (a reply is read straight into the caller's
  // memory as it arrives): their contents are then unspecified. The same holds for Push's
  // pull_after views when the push fails or its token does not come.
  Result<int64_t> Pull(const std::string& name, TensorView out);
  Result<int64_t> Pull(const std::vector<std::pair<std::string, TensorView>>& outs);
  // The moving averages (TF's shadow variables) of variables created with average = true.
  Result<int64_t> PullAverages(const std::vector<std::pair<std::string, TensorView>>& outs);
  // Selected rows (any order, repeats allowed) of a variable into `out` ([rows.size(), row dims...]).
  // More rows than a reply of ClientOptions::pull_frame_bytes holds are read in several replies
  // (at one global step: replies that straddle a commit are read again).
  Result<int64_t> PullRows(const std::string& name, const std::vector<int64_t>& rows, TensorView out);

  // Pushes gradients tagged with `local_step`. With wait_token, the daemon also waits (up to
  // timeout_ms; <= 0: the daemon's default) for a token and returns it in the same reply.
  Result<PushOutcome> Push(int64_t local_step, const std::vector<Gradient>& grads, bool wait_token = false,
                           int64_t timeout_ms = 0);
  // Dense and sparse gradients in one message; results are dense ones first, then sparse ones.
  // With `pull_after`, the reply also carries those variables' values — once the token is in when
  // it waits, else as they are after this push (written into the views; pulled_step says their
  // step): push, barrier and the next step's pull in one round trip.
  Result<PushOutcome> Push(int64_t local_step, const std::vector<Gradient>& grads,
                           const std::vector<SparseGradient>& sparse, bool wait_token = false, int64_t timeout_ms = 0,
                           const std::vector<std::pair<std::string, TensorView>>* pull_after = nullptr);

  // Chief only: the learning rate from the next step on (schedules live in the trainer).
  Status SetLearningRate(double learning_rate);

  // Asks psd for a checkpoint at the next step boundary (FailedPrecondition without
  // --checkpoint-dir). GetStatus().last_checkpoint_step tells when it is written.
  Status RequestCheckpoint();

  // Cluster, an operator's decision (psd_admin recover; README "Losing a shard's checkpoints"):
  // the chief refuses to form because a shard lacks checkpoints that others hold; form anyway,
  // at checkpoint `step` (< 0: the newest every shard can restore), or `empty` at step 0. The
  // newer checkpoints are then lost. kFailedPrecondition: no decision is awaited (or a single
  // psd); kInvalidArgument: a step not every shard can restore (the message lists those that are).
  Status Recover(int64_t step, bool empty);

  // Bumps on every (re)connection and whenever the cluster restored a checkpoint: a trainer that
  // sees it change re-reads the global step.
  uint64_t connection_epoch() const;

  // Cluster.
  int shards() const;
  int chief_shard() const;
  uint64_t cluster_epoch() const;
  // Where a variable lives (asks the chief shard unless known).
  Result<VariablePlacement> Placement(const std::string& name);
  // The whole placement map, from the chief shard.
  Result<PlacementMap> GetPlacementMap();

  // Waits for a token: the barrier. Returns the token's step. kDeadlineExceeded after timeout_ms
  // (nothing is lost), kOutOfRange once training is over.
  Result<int64_t> WaitToken(int64_t timeout_ms = 0);

  Result<JobStatus> GetStatus();
  Result<int64_t> GlobalStep();

  // The status of one shard (a cluster's other shards answer too while the chief is gone).
  Result<JobStatus> GetShardStatus(int shard);

  // Optimizer slots: names come from the handshake; values are read from the daemon.
  std::vector<std::string> SlotNames() const;
  Status GetSlot(const std::string& variable, const std::string& slot, TensorView out);

  // --- distribution-aware primitives (TF StrategyExtended) -----------------------------------
  // reduce_to: this replica's `value` for `destination` (a non-trainable variable) at local_step.
  // Returns once the round's required replicas contributed (the destination then holds their
  // sum or mean, also written to `result` if given), or DEADLINE_EXCEEDED.
  Result<ReduceResult> ReduceTo(ReduceOp op, int64_t local_step, ConstTensorView value, const std::string& destination,
                                TensorView result = {}, int64_t timeout_ms = 0);
  // batch_reduce_to: many reductions in one round trip per shard (packed per `hints`).
  Result<std::vector<ReduceResult>> BatchReduceTo(ReduceOp op, int64_t local_step, const std::vector<ReduceItem>& items,
                                                  const CollectiveHints& hints = {});
  // broadcast_to: one worker (typically the chief) sets `value` on every destination. By default
  // at once (a replica reading after this returns sees it); with at_next_step (sync mode) it is
  // published with the next step's commit, so every replica reads it at that same step.
  Status BroadcastTo(ConstTensorView value, const std::vector<std::string>& destinations, bool at_next_step = false);
  // update(variable, fn): assign / assign_add / assign_sub / scale computed where the variable
  // lives. Returns whether this call's value was applied (ONLY_FIRST_REPLICA ignores replicas
  // other than 0; a stale replica-context call is dropped).
  Result<bool> Update(const std::string& variable, UpdateOp op, ConstTensorView value,
                      const UpdateOptions& options = {});

  // colocate_vars_with(v): while the returned scope lives, variables this client creates without
  // an explicit colocate_with are placed on the same shard(s) as `variable`.
  class ColocationScope {
   public:
    ColocationScope(ColocationScope&& other) noexcept : client_(other.client_), previous_(std::move(other.previous_)) {
      other.client_ = nullptr;
    }
    ~ColocationScope();

   private:
    friend class Client;
    ColocationScope(Client* client, std::string previous) : client_(client), previous_(std::move(previous)) {}
    Client* client_;
    std::string previous_;
  };
  ColocationScope ColocateVarsWith(const std::string& variable);

  // Role queries. This worker's replica id is worker_id() (order of first hello at the chief).
  Result<std::vector<std::string>> WorkerDevices();   // the job's workers, by replica id
  std::vector<std::string> ParameterDevices() const;  // the shards, "host:port"
  bool should_init() const { return is_chief(); }
  bool should_checkpoint() const { return is_chief(); }
  bool should_save_summary() const { return is_chief(); }
  // Requests sent so far over all shards (to check batching).
  uint64_t requests_sent() const;
  // Shards whose connection moves tensors through shared memory now (ClientOptions::
  // shared_memory_bytes), and, for the others, why not (empty when all use it; also says where
  // the shared buffers could not be attached).
  int shared_memory_shards() const;
  std::string shared_memory_status() const;
  // Of those, the shards whose frames too travel in a shared-memory lane (ClientOptions::shm_lane).
  int shared_memory_lanes() const;

  // `bytes` of host memory (64-byte aligned, zeroed) shared with same-host daemons: tensors in it
  // move with no copy on either side (SharedBuffer). RESOURCE_EXHAUSTED past
  // ClientOptions::shared_buffer_bytes in all, FAILED_PRECONDITION when that is 0. Any thread.
  Result<SharedBuffer> AllocateShared(size_t bytes);

  // Declares this worker done. With --exit-when-done the daemon exits once all workers did.
  Status Finish();

 private:
  class Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace psclient

#endif  // PSCLIENT_CLIENT_H_
