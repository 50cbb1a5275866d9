// psd: the parameter-server daemon. Parses flags into a ServerConfig, starts the Server and
// runs until SIGINT/SIGTERM or, with --exit-when-done, until every worker has finished.
#include <fcntl.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <thread>
#include <tuple>

#include "config/server_config.h"
#include "daemon/server.h"
#include "ops/sd_listen.h"
#include "psd/allocator.h"
#include "psd/cluster_list.h"
#include "psd/listen_socket.h"
#include "psd/secret.h"

namespace {

std::atomic<psd::server::Server*> g_server{nullptr};

}  // namespace

int main(int argc, char** argv) {
  psd::TuneAllocator();  // before the first big buffer (psd/allocator.h)
  psd::server::ServerConfig cfg;
  CLI::App app{"psd — parameter-server daemon for synchronous (SyncReplicasOptimizer-style) training"};
  app.set_version_flag("--version", std::string("psd ") + psd::server::kPsdVersion);
  auto* config_opt = app.set_config("--config", "",
                                    "read flags from this file (TOML/INI: `replicas-to-aggregate = 2`); command-line "
                                    "flags win; unknown keys and [sections] are errors");
  std::string reduction = "mean";
  std::string mode = "sync";
  std::string staleness_lr = "none";
  std::string auth_token_file;
  std::string cluster_secret_file;
  psd::server::OptimizerParams& opt = cfg.optimizer;

  auto* host_opt = app.add_option("--host", cfg.host,
                                  "IP address to listen on (a cluster shard: its --cluster entry's, if an IP address)")
                       ->capture_default_str();
  auto* port_opt = app.add_option("--port", cfg.port,
                                  "TCP port to listen on; 0 picks a free one (see --port-file); a cluster shard: "
                                  "its --cluster entry's")
                       ->capture_default_str();
  app.add_option("--port-file", cfg.port_file, "write the bound port to this file once listening");
  auto* listen_fd_opt =
      app.add_option("--listen-fd", cfg.listen_fd,
                     "serve on this inherited listening TCP socket instead of binding (launchers: psrun, tests); it "
                     "must be bound to --host/--port, or this shard's --cluster entry. systemd socket activation "
                     "(LISTEN_PID/LISTEN_FDS, one ListenStream=) passes it without this flag");
  app.add_option("--threads", cfg.io_threads,
                 "I/O threads serving connections (0: one per core this process may use: its CPU affinity and cgroup "
                 "quota)")
      ->capture_default_str();
  app.add_flag("--busy-poll", cfg.busy_poll,
               "latency-critical jobs: I/O threads poll their sockets instead of sleeping (each of --threads keeps a "
               "core busy all the time; pair with ClientOptions::busy_poll_us)");
  app.add_flag("!--no-shared-memory", cfg.shared_memory,
               "do not offer shared memory to workers on this host (they then move tensors over TCP)");
  app.add_flag("!--no-values-segment", cfg.values_segment,
               "keep psd's buffers in its heap and write pulled values into each same-host worker's segment, instead "
               "of letting the workers copy them from psd's read-only values segment");
  std::string shm_max_bytes = "4G";
  app.add_option("--shm-max-bytes", shm_max_bytes,
                 "largest shared-memory segment a same-host worker may attach (SIZE; pages count only once "
                 "touched: about the biggest push plus pull of one call)")
      ->type_name("SIZE")
      ->capture_default_str();
  app.add_option("--replicas-to-aggregate,-R", cfg.replicas_to_aggregate,
                 "fresh gradients per variable that complete a step (TF replicas_to_aggregate)")
      ->capture_default_str();
  auto* backup = app.add_option("--backup-replicas,-B", cfg.backup_replicas,
                                "backup replicas: workers beyond R whose late gradients are dropped "
                                "(default 0; alternative to --total-replicas)");
  auto* total = app.add_option("--total-replicas,-N", cfg.total_replicas,
                               "total workers (TF total_num_replicas; default R + backup replicas)")
                    ->excludes(backup);
  app.add_option("--init-tokens", cfg.init_tokens,
                 "tokens queued at start (TF get_init_tokens_op num_tokens); -1 = R; must be >= R - N")
      ->capture_default_str();
  app.add_option("--reduction", reduction, "how gradients are aggregated: mean or sum")
      ->check(CLI::IsMember({"mean", "sum"}))
      ->capture_default_str();
  app.add_flag("--deterministic", cfg.deterministic,
               "sync: sum each step's gradients in a fixed order (by worker name, not arrival): bit-identical "
               "parameters run after run, for a model-sized buffer per gradient of a step");
  app.add_option("--mode", mode,
                 "consistency: sync (N-of-M with backups), async (apply on arrival), ssp (bounded staleness)")
      ->check(CLI::IsMember({"sync", "async", "ssp"}))
      ->capture_default_str();
  app.add_option("--staleness", cfg.staleness_bound,
                 "ssp: how many clocks a worker may run ahead of the slowest live worker")
      ->capture_default_str();
  app.add_option("--staleness-lr", staleness_lr,
                 "async/ssp learning-rate scaling: none, inverse (lr / staleness), workers (lr / N)")
      ->check(CLI::IsMember({"none", "inverse", "workers"}))
      ->capture_default_str();
  app.add_option("--soft-sync-fraction", cfg.soft_sync_fraction,
                 "sync: a step proceeds once ceil(f * N) workers' gradients arrived (0: off, R decides)")
      ->capture_default_str();
  app.add_option("--step-deadline-ms", cfg.step_deadline_ms,
                 "sync: commit a step this many ms after its first gradient with what arrived (0: off)")
      ->capture_default_str();
  app.add_option("--optimizer", opt.name, "server-side optimizer: sgd, momentum, adagrad, adam, rmsprop, ftrl")
      ->capture_default_str();
  app.add_option("--learning-rate,--lr", opt.learning_rate, "optimizer learning rate")->capture_default_str();
  app.add_option("--momentum", opt.momentum, "momentum: the momentum coefficient")->capture_default_str();
  app.add_flag("--nesterov", opt.nesterov, "momentum: Nesterov momentum");
  app.add_option("--beta1", opt.beta1, "adam: first-moment decay")->capture_default_str();
  app.add_option("--beta2", opt.beta2, "adam: second-moment decay")->capture_default_str();
  app.add_option("--epsilon", opt.epsilon, "adam, rmsprop: numerical stability term")->capture_default_str();
  app.add_option("--initial-accumulator", opt.initial_accumulator, "adagrad, ftrl: initial accumulator value")
      ->capture_default_str();
  app.add_option("--rho", opt.rho, "rmsprop: decay of the mean square")->capture_default_str();
  app.add_option("--rms-momentum", opt.rms_momentum, "rmsprop: momentum")->capture_default_str();
  app.add_option("--l1", opt.l1, "ftrl: L1 regularization strength")->capture_default_str();
  app.add_option("--l2", opt.l2, "ftrl: L2 regularization strength")->capture_default_str();
  app.add_option("--lr-power", opt.lr_power, "ftrl: learning-rate power (<= 0)")->capture_default_str();
  app.add_option(
         "--apply-threads", cfg.apply_threads,
         "threads that split the optimizer update of variables over 1M elements (0: one per core, as --threads)")
      ->capture_default_str();
  app.add_option("--ema-decay", cfg.ema_decay,
                 "keep exponential moving averages of variables created with average=true (0: off)")
      ->capture_default_str();
  app.add_flag("--ema-num-updates", cfg.ema_num_updates,
               "EMA decay = min(decay, (1 + step) / (10 + step)), TF's num_updates rule");
  app.add_option("--checkpoint-dir", cfg.checkpoint_dir,
                 "write checkpoints here and restore the newest good one at start");
  app.add_option("--checkpoint-every-steps", cfg.checkpoint_every_steps, "checkpoint every N global steps (0: off)")
      ->capture_default_str();
  app.add_option("--checkpoint-every-s", cfg.checkpoint_every_s, "checkpoint every N seconds (0: off)")
      ->capture_default_str();
  app.add_option("--keep-checkpoints", cfg.keep_checkpoints, "checkpoints to keep (0: all)")->capture_default_str();
  app.add_flag("!--no-restore", cfg.restore, "start fresh even if --checkpoint-dir has a checkpoint");
  app.add_flag("--allow-state-loss", cfg.allow_state_loss,
               "cluster: when some shard lacks the newest sealed checkpoint, form at the newest one every shard "
               "has (or empty) instead of waiting for `psd_admin recover` (logged at error level)");
  app.add_option("--token-timeout-ms", cfg.default_token_timeout_ms,
                 "deadline in milliseconds for a token wait when the worker gives none")
      ->capture_default_str();
  std::string max_frame_bytes = "256M", max_model_bytes = "16G", slice_bytes = "64M", max_inflight_bytes = "32M",
              max_queued_reply_bytes = "64M";
  app.add_option("--max-frame-bytes", max_frame_bytes,
                 "largest accepted message (bytes, or with K/M/G/T: 64M, 1G; powers of 1024); bigger frames are "
                 "refused before allocation, and workers learn the limit at hello")
      ->type_name("SIZE")
      ->capture_default_str();
  app.add_option("--max-inflight-bytes", max_inflight_bytes,
                 "memory for incoming frames across all connections (SIZE); a frame that does not fit waits for "
                 "its share (the sender sees backpressure, not an error), and one bigger than all of it is read "
                 "alone")
      ->type_name("SIZE")
      ->capture_default_str();
  app.add_option("--max-queued-reply-bytes", max_queued_reply_bytes,
                 "per connection: stop reading its requests while more reply bytes than this (SIZE) wait to be "
                 "written to it, until they go out (a client that sends and never reads holds up itself, not psd's "
                 "memory); libpsclient learns it at hello and reads replies before it could make psd wait")
      ->type_name("SIZE")
      ->capture_default_str();
  app.add_option("--frame-timeout-ms", cfg.frame_timeout_ms,
                 "close a connection whose frame has not fully arrived this many milliseconds after it got its "
                 "share of --max-inflight-bytes (a slow sender cannot hold memory for long)")
      ->capture_default_str();
  app.add_option("--max-connections", cfg.max_connections, "most concurrent connections")->capture_default_str();
  app.add_option("--hello-timeout-ms", cfg.hello_timeout_ms,
                 "close a connection that has not completed its hello within this many milliseconds")
      ->capture_default_str();
  app.add_option("--idle-timeout-s", cfg.idle_timeout_s,
                 "close a connection that sent nothing and has nothing parked for this many seconds (0: never; "
                 "a client reconnects on its next call)")
      ->capture_default_str();
  app.add_option("--auth-token-file", auth_token_file,
                 "file holding a shared secret every worker and tool must present (none: no authentication)");
  app.add_option("--tls-cert-file", cfg.tls_cert_file,
                 "PEM certificate chain: serve TLS on the data port (workers, tools and shards must then use TLS); "
                 "a shard also presents it to the shards it dials");
  app.add_option("--tls-key-file", cfg.tls_key_file, "PEM private key of --tls-cert-file");
  app.add_option("--tls-ca-file", cfg.tls_ca_file,
                 "PEM CA certificates that verify clients' certificates (--tls-require-client-cert) and the other "
                 "shards' (default for shards: the system's trust store)");
  app.add_flag("--tls-require-client-cert", cfg.tls_require_client_cert,
               "mutual TLS: every worker, tool and shard must present a certificate signed by --tls-ca-file");
  app.add_option("--cluster-secret-file", cluster_secret_file,
                 "file holding the cluster's own secret (not the workers' token; the same file on every shard): "
                 "shards prove they know it before a peer link carries messages");
  app.add_flag("--insecure", cfg.insecure,
               "allow listening beyond loopback (--host, a cluster entry, --metrics-host) without "
               "--auth-token-file or mutual TLS, and a cluster beyond loopback without --cluster-secret-file "
               "(protected mode refuses them otherwise)");
  app.add_option("--max-model-bytes", max_model_bytes,
                 "memory the variables may take (bytes, or 16G...), counting their slots, averages and update "
                 "buffers; creating more is refused")
      ->type_name("SIZE")
      ->capture_default_str();
  std::string cluster, cluster_file;
  app.add_option("--cluster", cluster,
                 "every shard's host:port, comma-separated, the same list on every shard (none: a single daemon)");
  app.add_option("--cluster-file", cluster_file, "a file with one host:port per line (instead of --cluster)");
  app.add_option("--shard-index", cfg.shard_index, "this daemon's position in the cluster list")->capture_default_str();
  app.add_option("--heartbeat-ms", cfg.heartbeat_ms, "shard-to-shard heartbeat period")->capture_default_str();
  app.add_option("--replicas-per-shard", cfg.replicas_per_shard,
                 "cluster: copies of each shard's state (2: the next shard keeps one, so losing a shard loses no "
                 "committed step; async/ssp: no acknowledged push)")
      ->capture_default_str();
  app.add_option("--takeover-after-ms", cfg.takeover_after_ms,
                 "with --replicas-per-shard 2: a shard gone this long is served by a stand-in that the next shard "
                 "runs from its copy, until the shard's own process is back (0: never; wait for the process)")
      ->capture_default_str();
  app.add_option("--election-timeout-ms", cfg.election_timeout_ms,
                 "a shard silent this long counts as gone (a new chief is elected if it was the chief)")
      ->capture_default_str();
  app.add_option("--slice-bytes", slice_bytes,
                 "variables bigger than this (bytes, or 64M...) are split along their first dimension over several "
                 "shards")
      ->type_name("SIZE")
      ->capture_default_str();
  app.add_option("--metrics-port", cfg.metrics_port,
                 "HTTP port for /metrics (Prometheus), /healthz, /readyz and the status page at / (-1: off; 0: a "
                 "free port, see --metrics-port-file)")
      ->capture_default_str();
  app.add_option("--metrics-host", cfg.metrics_host,
                 "IP address the metrics port listens on (loopback by default; 0.0.0.0 for scrapers and probes "
                 "from other hosts)")
      ->capture_default_str();
  app.add_option("--metrics-port-file", cfg.metrics_port_file, "write the bound metrics port to this file");
  app.add_flag("--exit-when-done", cfg.exit_when_done, "exit with status 0 once every worker has finished");
  app.add_option("--worker-grace-s", cfg.worker_grace_s,
                 "seconds a worker may stay disconnected without finishing before steps stop waiting for its "
                 "gradients (0: wait for it forever)")
      ->capture_default_str();
  app.add_option("--summary-interval-s", cfg.summary_interval_s,
                 "seconds between progress summaries at info level (0: none)")
      ->capture_default_str();
  app.add_option("--log-level", cfg.log_level, "trace, debug, info, warn, error or off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}))
      ->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  // Signals are turned into a stop request by a dedicated thread (sigwait), so no async-signal
  // unsafe work happens in a handler. Blocked before any thread exists (the apply pool, the I/O
  // threads) so that every thread inherits the mask.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  cfg.reduction = reduction == "sum" ? psd::server::Reduction::kSum : psd::server::Reduction::kMean;
  cfg.mode = *psd::server::ParseMode(mode);  // CLI11 checked the value
  cfg.staleness_lr = *psd::server::ParseStalenessLr(staleness_lr);
  auto fail = [](const std::string& message) {
    std::cerr << "psd: " << message << "\n";
    return 2;
  };
  if (config_opt->count() > 0) {
    // CLI11 ignores unknown keys and [sections] silently; psd refuses them, naming the line.
    std::vector<std::string> known;
    for (const CLI::Option* o : app.get_options()) {
      for (const std::string& n : o->get_lnames()) {
        if (n != "help" && n != "version" && n != "config") known.push_back(n);
      }
      for (const std::string& n : o->get_snames()) {
        if (n != "h") known.push_back(n);  // (help is no key, short or long)
      }
    }
    psd::Status s = psd::server::CheckConfigFile(config_opt->as<std::string>(), known);
    if (!s.ok()) return fail(s.message());
  }
  // -1 means "not given" in ServerConfig; given, it must be in range.
  if (backup->count() > 0 && cfg.backup_replicas < 0) {
    return fail("-B/--backup-replicas must be >= 0, got " + std::to_string(cfg.backup_replicas));
  }
  if (total->count() > 0 && cfg.total_replicas < 1) {
    return fail("-N/--total-replicas must be >= 1, got " + std::to_string(cfg.total_replicas));
  }
  for (auto [flag, text, out] :
       {std::tuple{"--max-frame-bytes", &max_frame_bytes, &cfg.max_frame_bytes},
        std::tuple{"--max-model-bytes", &max_model_bytes, &cfg.max_model_bytes},
        std::tuple{"--slice-bytes", &slice_bytes, &cfg.slice_bytes},
        std::tuple{"--max-inflight-bytes", &max_inflight_bytes, &cfg.max_inflight_bytes},
        std::tuple{"--max-queued-reply-bytes", &max_queued_reply_bytes, &cfg.max_queued_reply_bytes},
        std::tuple{"--shm-max-bytes", &shm_max_bytes, &cfg.shm_max_bytes}}) {
    auto bytes = psd::server::ParseByteSize(*text, flag);
    if (!bytes.ok()) return fail(bytes.status().message());
    *out = *bytes;
  }
  if (!cluster.empty() && !cluster_file.empty()) return fail("give --cluster or --cluster-file, not both");
  if (!cluster_file.empty() || !cluster.empty()) {
    auto list = cluster_file.empty() ? psd::ParseClusterList(cluster) : psd::ReadClusterFile(cluster_file);
    if (!list.ok()) return fail(list.status().message());
    cfg.cluster = std::move(*list);
  }
  // A shard (or a one-entry --cluster) listens where the cluster list says, unless told otherwise.
  psd::Status listen = cfg.ResolveListenAddress(host_opt->count() > 0, port_opt->count() > 0);
  if (!listen.ok()) return fail(listen.message());
  // A socket bound by the launcher: --listen-fd, or systemd's socket activation (LISTEN_PID and
  // LISTEN_FDS: systemd's contract, read here as sd_listen_fds(3) does, then unset).
  auto sd_fd = psd::server::ops::SdListenFd(std::getenv("LISTEN_PID"), std::getenv("LISTEN_FDS"), ::getpid());
  for (const char* var : {"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"}) ::unsetenv(var);
  if (!sd_fd.ok()) return fail(sd_fd.status().message());
  if (listen_fd_opt->count() > 0) {
    if (*sd_fd >= 0) return fail("--listen-fd and systemd's LISTEN_FDS both pass a socket: give one");
    if (cfg.listen_fd < 0)
      return fail("--listen-fd must be an open descriptor number (>= 0), got " + std::to_string(cfg.listen_fd));
    cfg.listen_fd_source = "--listen-fd " + std::to_string(cfg.listen_fd);
  } else if (*sd_fd >= 0) {
    cfg.listen_fd = *sd_fd;
    cfg.listen_fd_source = "the socket systemd passed (LISTEN_FDS)";
  }
  if (cfg.listen_fd >= 0) {
    ::fcntl(cfg.listen_fd, F_SETFD, FD_CLOEXEC);
    auto bound = psd::InspectListeningSocket(cfg.listen_fd, cfg.listen_fd_source);
    if (!bound.ok()) return fail(bound.status().message());
    // A single daemon listens where the socket is bound unless --host/--port say otherwise (then
    // they must agree: Server::Start checks); protected mode judges the socket's real address.
    if (cfg.cluster.empty() && host_opt->count() == 0) cfg.host = bound->ip;
    if (cfg.cluster.empty() && port_opt->count() == 0) cfg.port = bound->port;
  }
  if (!auth_token_file.empty()) {
    auto token = psd::ReadSecretFile(auth_token_file);
    if (!token.ok()) {
      std::cerr << "psd: --auth-token-file: " << token.status().message() << "\n";
      return 2;
    }
    cfg.auth_token = *token;
  }
  if (!cluster_secret_file.empty()) {
    auto secret = psd::ReadSecretFile(cluster_secret_file);
    if (!secret.ok()) return fail("--cluster-secret-file: " + secret.status().message());
    cfg.cluster_secret = *secret;
  }

  // systemd's readiness protocol (Type=notify): the one variable psd reads, systemd's contract.
  if (const char* notify = std::getenv("NOTIFY_SOCKET")) cfg.notify_socket = notify;

  spdlog::set_default_logger(spdlog::stderr_color_mt("psd"));
  spdlog::set_level(spdlog::level::from_str(cfg.log_level));
  spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e [%^%l%$] %v");

  auto server = psd::server::Server::Create(cfg);
  if (!server.ok()) {
    std::cerr << "psd: " << server.status().message() << "\n";
    return 2;
  }
  psd::Status started = (*server)->Start();
  if (!started.ok()) {
    std::cerr << "psd: " << started.message() << "\n";
    return 1;
  }
  g_server = server->get();
  std::thread signals([&set] {
    int sig = 0;
    if (sigwait(&set, &sig) == 0 && sig != 0) {
      spdlog::info("signal {} received; shutting down", sig);
      if (auto* s = g_server.load()) s->RequestStop();
    }
  });
  signals.detach();
  bool done = (*server)->Wait();
  (*server)->Stop();
  spdlog::info("psd stopped{}", done ? ": all workers finished" : "");
  g_server = nullptr;
  return 0;
}
