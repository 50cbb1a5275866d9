// Server: the daemon (README "Architecture"). Owns the io_context, its thread pool, the acceptor and
// the live connections (each a net/ Connection whose frames go to a service/ WorkerSession), the
// engine slot (a new TrainingEngine per cluster epoch), the worker registry, the checkpoint writer,
// the ops endpoints and the job's lifecycle, and wires them; the service sees it only as a
// ServiceHost.
//
// Threading model: each of `config.io_threads` threads runs an io_context of its own, and an
// accepted connection is handed to the one with the fewest live connections: its reads, writes and handlers stay
// on one thread, so a frame never hops between threads on its way in or out (with one shared
// io_context every completion went through a queue all threads contend on, and small frames paid
// for it: a 4 KiB step took 3-9x the socket floor on 16 cores). One more thread runs io_, the
// control plane: the acceptor, timers, the ops endpoints, the shared-memory listener, the peer
// links this shard dials and the cluster strand. Each connection's handlers run on that
// connection's strand, so they never run concurrently with each other; shared state lives in
// TrainingEngine/WorkerRegistry behind their own locks. A blocked token wait is a
// parked callback plus a timer, never a parked thread, so 64 waiting workers need no 64 threads.
//
// Lifetime: Start() binds and starts the threads; Wait() blocks until a stop is requested
// (RequestStop(), a signal handled by the caller, or --exit-when-done once every worker has
// finished); Stop() closes the acceptor and the connections (after flushing their replies, at
// most ~2 s) and joins the threads. Several Servers can live in one process (tests).
#ifndef PSD_SERVER_DAEMON_SERVER_H_
#define PSD_SERVER_DAEMON_SERVER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "base/waiting_queue.h"
#include "checkpoint/checkpoint.h"
#include "cluster/coordinator.h"
#include "config/server_config.h"
#include "core/converted_values.h"
#include "core/ssp_gate.h"
#include "core/training_engine.h"
#include "core/worker_registry.h"
#include "daemon/checkpoint_writer.h"
#include "daemon/cluster_host.h"
#include "net/connection.h"
#include "net/frame_budget.h"
#include "net/frame_pool.h"
#include "net/peer_auth.h"
#include "ops/metrics.h"
#include "psd/status.h"
#include "service/service_host.h"
#include "service/tcp_peer_network.h"
#include "wire/asio.h"
#include "wire/tls.h"

namespace psd::server {

class Connection;
namespace ops {
class OpsService;
}

class Server : public ServiceHost {
 public:
  // `config` must have passed Validate().
  static Result<std::unique_ptr<Server>> Create(ServerConfig config);
  ~Server();

  // Binds the data port (and the metrics port), starts the I/O threads, restores the newest
  // checkpoint (single daemon) and then becomes ready: --port-file is written and systemd is
  // notified only then (a cluster shard: once the cluster has formed and serves).
  Status Start();
  uint16_t port() const { return port_; }
  // The metrics/status HTTP port (0: --metrics-port is off).
  uint16_t metrics_port() const;
  // Blocks until a stop is requested. Returns true if the job ended because all workers finished.
  bool Wait();
  void RequestStop();
  void Stop();

  // Whether workers are served now: Ok, or Unavailable saying what psd waits for (restoring a
  // checkpoint, a missing shard, the cluster forming). /readyz and the readiness signals use it.
  Status Serving() const override;
  ops::Metrics& metrics() override { return metrics_; }
  ShmListener* shm() override { return shm_.get(); }
  // Published values converted to the dtypes readers ask for (shared by all connections).
  ConvertedValues& converted_values() override { return converted_values_; }
  // Memory for incoming frames across all connections (--max-inflight-bytes).
  FrameBudget& frame_budget() { return frame_budget_; }
  const FramePool& frame_pool() const { return frame_pool_; }
  // What each accepted connection is told (limits, the frame budget, counters); a harness that
  // serves a socket of its own builds its Connection with it.
  const ConnectionEnv& connection_env() const { return conn_env_; }
  int connection_count() const;
  // Live connections per I/O thread (each thread's io_context), in thread order.
  std::vector<int> ConnectionsPerIoThread() const EXCLUDES(conns_mu_);
  double uptime_s() const override;
  double start_unix_s() const { return start_unix_s_; }
  // The whole placement map with bytes per shard (a single daemon, or the chief of a serving
  // cluster); an error elsewhere (ask the chief).
  Status PlacementMap(std::vector<VarPlacement>* all, std::vector<uint64_t>* shard_bytes) const override;

  // The engine serving now. A cluster replaces it when it restores a checkpoint: callers hold the
  // pointer for the duration of one request.
  std::shared_ptr<TrainingEngine> engine() const override;
  // The engine's figures, its counters (pushes accepted and stale, the largest staleness) counted
  // over this process's life: an engine replaced by a cluster restore hands its counts on.
  EngineStats Stats() const;
  // Null for a single daemon.
  ClusterCoordinator* coordinator() override { return coordinator_.get(); }
  // The stand-in this shard runs for its predecessor (takeover), given to `fn` while it serves.
  void WithStandIn(const std::function<void(Server&)>& fn) {
    if (cluster_host_) cluster_host_->WithStandIn(fn);
  }
  WorkerRegistry& workers() override { return workers_; }
  SspGate& ssp() override { return ssp_; }
  const ServerConfig& config() const override { return config_; }
  // TLS contexts (null without --tls-cert-file): the data port's, and the one a shard dials its
  // peers with.
  const std::shared_ptr<wire::ssl::context>& tls_context() const { return tls_; }
  const std::shared_ptr<wire::ssl::context>& peer_tls_context() const { return peer_tls_; }
  // Rate limit of the log lines about refused peer impersonations (all connections).
  peer_auth::LogLimiter& spoof_log() override { return spoof_log_; }

  // Schedules a checkpoint (at the next step boundary). No-op without --checkpoint-dir.
  Status RequestCheckpoint() override;
  int64_t last_checkpoint_step() const override { return last_checkpoint_step_.load(); }
  void set_last_checkpoint_step(int64_t step) { last_checkpoint_step_ = step; }
  // Hands a snapshot to the checkpoint writer (the newest pending one wins).
  void QueueSnapshot(ShardSnapshot snap);
  // True while a snapshot is queued or being written.
  bool CheckpointWriterBusy() const;

  // Cluster: replaces the engine with a fresh one for `epoch`, restored from checkpoint `step`
  // (-1: empty at step 0). The old engine's token waits fail ABORTED. *placements: the parts the
  // new engine holds.
  // `live` (replication): restores that kept copy of step `step` instead of the checkpoint.
  Status RestoreEngine(uint64_t epoch, int64_t step, std::vector<VarPlacement>* placements,
                       const ShardSnapshot* live = nullptr);
  // The job is over (cluster: after the final checkpoint): stops if --exit-when-done.
  void FinishJob();
  // Ends the job (closes the token queue and gate; with --exit-when-done, stops) if every worker
  // has finished (or, with --exit-when-done, every one is gone). A cluster's chief tells the
  // others; a shard that becomes chief checks again (the last chief may have gone first).
  void EndJobIfDone();

  // Called by connections. OnHello returns the worker's index, or RESOURCE_EXHAUSTED when the
  // job's N worker slots are taken (WorkerRegistry::Hello).
  Result<uint32_t> OnHello(uint64_t conn, const std::string& name, uint64_t incarnation) override;
  void OnWorkerFinished(uint64_t conn) override;
  void OnConnectionClosed(uint64_t conn) override;

 private:
  // The TLS contexts are made (and checked) by Create.
  Server(ServerConfig config, std::shared_ptr<wire::ssl::context> tls, std::shared_ptr<wire::ssl::context> peer_tls);
  // A new engine with the server's callbacks wired.
  Result<std::shared_ptr<TrainingEngine>> MakeEngine(uint64_t epoch);
  void Accept();
  void ScheduleSummary();
  void LogSummary();
  void UpdateRequired();
  void ArmStepDeadline(int64_t step);
  // A take that ran out of memory (TrainingEngine::set_on_take_deferred) is tried again after
  // kTakeRetryMs, until one gets its memory.
  static constexpr int kTakeRetryMs = 50;
  void RetryTakesSoon();
  void ScheduleCheckpointTimer();
  // Restores the newest good checkpoint of --checkpoint-dir into the (empty) engine.
  Status RestoreAtStart();
  // Serves on config_.listen_fd after checking that it listens on host:port; closes it on error.
  Status AdoptListenFd();
  // Once ready: writes --port-file and tells systemd. A cluster shard polls until it serves.
  Status BecomeReady();
  void WatchReadiness();
  void WriteSnapshot(const ShardSnapshot& snap);
  ConnectionEnv MakeConnectionEnv();
  // The coordinator's heartbeat (cluster only).
  void ScheduleClusterTick();

  const ServerConfig config_;
  ops::Metrics metrics_;
  ConvertedValues converted_values_;
  std::shared_ptr<wire::ssl::context> tls_, peer_tls_;
  FrameBudget frame_budget_{config_.max_inflight_bytes};
  FramePool frame_pool_{frame_budget_.limit()};  // the budget's frames' buffers, kept within its limit
  peer_auth::LogLimiter spoof_log_;
  // Lines any stranger can cause (a refused or evicted connection, a failed TLS handshake, a
  // missing hello): rate-limited like spoofing attempts.
  peer_auth::LogLimiter refusal_log_;
  peer_auth::LogLimiter connection_log_;
  // Data-port connections that have not said hello yet, oldest first (Accept's eviction).
  WaitingQueue<Connection> awaiting_hello_;
  // How far over --max-connections evictions may take the count until the evicted have closed.
  static constexpr int kEvictionSlack = 16;
  const ConnectionEnv conn_env_;  // what every accepted connection is told (limits, budget, counters)
  const std::chrono::steady_clock::time_point start_time_ = std::chrono::steady_clock::now();
  const double start_unix_s_ = ops::UnixNow();
  mutable Mutex ready_mu_;
  std::string not_ready_ GUARDED_BY(ready_mu_);  // why a single daemon does not serve yet ("": it does)
  std::chrono::steady_clock::time_point not_ready_since_ GUARDED_BY(ready_mu_);
  std::atomic<bool> became_ready_{false};
  mutable Mutex engine_mu_;
  std::shared_ptr<TrainingEngine> engine_ GUARDED_BY(engine_mu_);
  // What the engines replaced so far counted (Stats adds it to the current one's).
  int64_t retired_accepted_ GUARDED_BY(engine_mu_) = 0;
  int64_t retired_stale_ GUARDED_BY(engine_mu_) = 0;
  int64_t retired_max_staleness_ GUARDED_BY(engine_mu_) = 0;
  WorkerRegistry workers_;
  SspGate ssp_;

  asio::io_context io_;  // the control plane (see "Threading model")
  std::unique_ptr<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  // The connections' io_contexts, one per I/O thread (each run by its thread alone), kept running
  // while idle by their guards; declared before everything holding their sockets or timers.
  std::vector<std::unique_ptr<asio::io_context>> conn_ios_;
  std::vector<asio::executor_work_guard<asio::io_context::executor_type>> conn_work_;
  tcp::acceptor acceptor_;
  std::unique_ptr<ShmListener> shm_;  // with --shared-memory (the default)
  // Accept loop state (touched only by the single outstanding accept's handler and its timer).
  asio::steady_timer accept_backoff_;
  int accept_backoff_ms_ = 0;  // > 0: in an episode of running out of descriptors
  asio::steady_timer summary_timer_;
  asio::strand<asio::io_context::executor_type> deadline_strand_;
  asio::steady_timer step_deadline_;  // soft sync; touched only on deadline_strand_
  asio::steady_timer take_retry_;     // RetryTakesSoon; touched only on deadline_strand_
  bool take_retry_armed_ = false;     // on deadline_strand_
  std::vector<std::thread> threads_;
  // A cluster shard's protocol, its links and its view of this Server (null for a single daemon);
  // the coordinator is ticked every --heartbeat-ms on cluster_strand_.
  std::unique_ptr<ServerShardHost> cluster_host_;
  std::unique_ptr<TcpPeerNetwork> peer_network_;
  std::unique_ptr<ClusterCoordinator> coordinator_;  // after io_ and the two above: destroyed before them
  asio::strand<asio::io_context::executor_type> cluster_strand_;
  asio::steady_timer cluster_tick_;  // on cluster_strand_
  // The coordinator's lane: its actions (a committed step applied and copied for the next shard, a
  // copy that came rebuilt, ...) run on this thread of their own, one at a time in the order they
  // were decided, never on the threads that send and hear heartbeats. Drained and joined in Stop()
  // once the coordinator stopped, before the host's threads are.
  asio::io_context cluster_lane_{1};
  std::unique_ptr<asio::executor_work_guard<asio::io_context::executor_type>> cluster_lane_work_;
  std::thread cluster_lane_thread_;
  std::unique_ptr<ops::OpsService> ops_;  // after io_: destroyed before it
  asio::steady_timer ready_timer_;
  uint16_t port_ = 0;
  std::atomic<bool> accepting_{false};  // Start() got as far as serving connections
  std::atomic<uint64_t> next_conn_id_{1};

  mutable Mutex conns_mu_;
  std::map<uint64_t, std::weak_ptr<Connection>> conns_ GUARDED_BY(conns_mu_);
  // Which I/O thread each live connection is on, and how many each has: an accepted connection
  // goes to the one with the fewest (so tools that come and go leave the workers spread).
  std::map<uint64_t, size_t> conn_io_of_ GUARDED_BY(conns_mu_);
  std::vector<int> conn_io_load_ GUARDED_BY(conns_mu_);
  Mutex stop_mu_;
  CondVar stop_cv_;
  bool stop_requested_ GUARDED_BY(stop_mu_) = false;
  bool job_done_ GUARDED_BY(stop_mu_) = false;
  std::atomic<bool> stopped_{false};

  // Checkpoints: snapshots are handed to one writer thread (the newest pending one wins).
  asio::steady_timer checkpoint_timer_;
  CheckpointWriter ckpt_writer_{[this](const ShardSnapshot& snap) { WriteSnapshot(snap); },
                                [this] { engine()->RequestSnapshot(); }};  // a deferred operator request
  std::atomic<int64_t> last_checkpoint_step_{-1};
  std::atomic<bool> stop_window_warned_{false};

  // Summary bookkeeping (only touched by the summary timer's handler).
  int64_t last_summary_step_ = 0;
  std::chrono::steady_clock::time_point last_summary_time_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_DAEMON_SERVER_H_
