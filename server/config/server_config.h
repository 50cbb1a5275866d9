// ServerConfig: everything psd is told at start-up, parsed from flags by main() and validated
// here so that contradictory settings are rejected before anything starts.
#ifndef PSD_SERVER_CONFIG_SERVER_CONFIG_H_
#define PSD_SERVER_CONFIG_SERVER_CONFIG_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/training_config.h"
#include "psd/status.h"

namespace psd::server {

// psd's version (the project's, from CMake), reported by --version, status replies and /metrics.
inline constexpr char kPsdVersion[] = PSD_VERSION;

struct ServerConfig : TrainingConfig {
  // Network.
  std::string host = "127.0.0.1";
  uint16_t port = 7070;   // 0 picks a free port (see port_file)
  std::string port_file;  // if set, the bound port is written there once listening
  // A listening TCP socket to serve on instead of binding host:port (--listen-fd, systemd's
  // LISTEN_FDS; README "Socket activation and --listen-fd"); -1: none. Its bound address must be
  // host:port (port 0: any). From Server::Start() on, the Server owns it (closed with the Server,
  // or by Start() when it fails).
  int listen_fd = -1;
  std::string listen_fd_source = "the passed listening socket";  // names it in errors: "--listen-fd 3"
  int io_threads = 0;  // 0: one per usable core (psd::UsableCores); resolved by Validate
  // --busy-poll: I/O threads poll their sockets without sleeping (each keeps a core busy).
  bool busy_poll = false;
  // Same-host workers may attach a shared-memory segment (README "Same-host shared memory"), of at
  // most shm_max_bytes each.
  bool shared_memory = true;
  uint64_t shm_max_bytes = 4ull << 30;
  // With shared_memory: psd keeps its big buffers in its values segment and same-host workers copy
  // pulled values straight from there (README "Same-host shared memory", *Values in place*); off:
  // psd writes them into each worker's segment.
  bool values_segment = true;
  // Memory for incoming frames across all connections (README "Hardening"): a frame waits for its
  // share (backpressure) instead of failing, and one bigger than all of it is read alone; a frame
  // must arrive within frame_timeout_ms once it holds its share.
  uint64_t max_inflight_bytes = 32ull << 20;
  // Per connection: psd reads no further request while more reply bytes than this wait to be
  // written to it (README "Replies waiting to be read"); workers learn it at hello.
  uint64_t max_queued_reply_bytes = 64ull << 20;
  int64_t frame_timeout_ms = 60000;
  int max_connections = 1024;
  int64_t hello_timeout_ms = 5000;  // a connection must complete its hello within this
  int64_t idle_timeout_s = 0;       // close a connection idle this long (nothing parked); 0: never
  std::string auth_token;           // non-empty: every connection must present it in its hello
  // Non-empty: shards prove to each other that they know it (cluster/peer_auth.h) before a peer
  // link carries messages. Distinct from auth_token, which every worker knows.
  std::string cluster_secret;
  // Protected mode (README "Protected mode"): listening beyond loopback (--host, a cluster entry's
  // address, --metrics-host) needs a secret (auth_token) or TLS, and a cluster with an entry beyond
  // loopback needs cluster_secret, unless `insecure` says so.
  bool insecure = false;

  // Checkpoints (see checkpoint/checkpoint.h). Empty dir: none.
  std::string checkpoint_dir;
  double checkpoint_every_s = 0;  // 0: not by time
  int keep_checkpoints = 3;
  bool restore = true;  // load the newest good checkpoint at start
  // Cluster: the chief may form at an older checkpoint (or empty) than some shard's newest sealed
  // one without an operator's psd_admin recover (README "Losing a shard's checkpoints").
  bool allow_state_loss = false;

  // Cluster (README "Running a cluster"). One entry, or none: a single daemon.
  std::vector<std::string> cluster;    // every shard's host:port, the same list on every shard
  int shard_index = 0;                 // this daemon's entry in `cluster`
  int64_t heartbeat_ms = 100;          // shard-to-shard heartbeat period
  int64_t election_timeout_ms = 1000;  // a shard silent this long counts as gone
  uint64_t slice_bytes = 64ull << 20;  // variables bigger than this are split by rows over several shards
  // Copies of each shard's state (README "Shard replicas"): 1 none; 2 chain replication, each
  // shard's state also kept by the next shard (2+ shards; sync: at each commit, async/ssp: a push
  // is acknowledged once the next shard keeps it).
  int replicas_per_shard = 1;
  // With replicas: a shard gone this long is served by a stand-in that the next shard runs
  // (README "Shard replicas"); 0: never (its process must come back).
  int64_t takeover_after_ms = 1000;
  // Set by the shard that runs a stand-in (never by flags): this Server is a stand-in for shard
  // `shard_index`, serving on `host` at a port the kernel picks, said to be at
  // `advertise_host`:port; its links first go to `peer_links` (where each shard is served now).
  bool stand_in = false;
  std::string advertise_host;
  std::vector<std::string> peer_links;

  // Operations (README "Monitoring"): /metrics, /healthz, /readyz and the status page over HTTP.
  std::string metrics_host = "127.0.0.1";
  int metrics_port = -1;          // -1: off; 0: the kernel picks (see metrics_port_file)
  std::string metrics_port_file;  // if set, the bound metrics port is written there
  std::string notify_socket;      // systemd's $NOTIFY_SOCKET (main reads it): READY=1 once ready

  // Waits and lifetime.
  int64_t default_token_timeout_ms = 60000;
  bool exit_when_done = false;
  double worker_grace_s = 30;  // a worker gone this long without finishing no longer holds steps (0: never)
  double summary_interval_s = 10.0;
  std::string log_level = "info";

  // TLS on the data port, worker and peer links alike (README "TLS"). A shard dials its peers with
  // the same files: cert/key as its client certificate, ca to verify them.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_ca_file;
  bool tls_require_client_cert = false;  // mutual TLS: every worker, tool and shard presents a certificate
  bool tls_enabled() const { return !tls_cert_file.empty(); }

  int shards() const { return cluster.empty() ? 1 : static_cast<int>(cluster.size()); }
  bool clustered() const { return shards() > 1; }

  // A shard (or a one-entry --cluster) listens on its own cluster entry: its port unless
  // `port_given`, its address (when the entry is an IP address; else 0.0.0.0) unless `host_given`.
  // An error when shard_index is outside the list.
  Status ResolveListenAddress(bool host_given, bool port_given);
  // Resolves N, tokens per step and init tokens, range-checks every numeric setting and enforces
  // protected mode; returns an error naming the flag to change and its allowed range.
  Status Validate();
  // The protected-mode part of Validate(): an error when a listener is beyond loopback without
  // auth_token, TLS or `insecure`, or a cluster has an entry beyond loopback (a host name counts)
  // without cluster_secret or `insecure`.
  Status CheckProtectedMode() const;
  // Settings that are valid but likely a mistake (after Validate()), each a sentence that says what
  // to change: the daemon logs them as warnings at start.
  std::vector<std::string> Cautions() const;
};

// Whether `ip` is a loopback address (127.0.0.0/8 or ::1). An error when it is not an IP address.
Result<bool> IsLoopbackAddress(const std::string& ip);

// A size flag's value: bytes, or a number with a suffix K, M, G or T (powers of 1024; "KiB",
// "MB"... are accepted as the same), e.g. "64M". The error names `flag`.
Result<uint64_t> ParseByteSize(const std::string& text, const std::string& flag);
// The size in the largest unit that divides it ("256 MiB", "4097 bytes").
std::string FormatByteSize(uint64_t bytes);

// Strict config files: every line of `path` must be blank, a comment ('#' or ';') or
// `key = value` with `key` one of `known_keys` (flag names without dashes). Errors name the line:
// "psd.conf:7: unknown key 'replicas-to-agregate' (did you mean replicas-to-aggregate?)";
// `[section]` headers and snake_case spellings of known keys are errors too.
Status CheckConfigFile(const std::string& path, const std::vector<std::string>& known_keys);

// Creates `dir` (and its parents) if missing and checks that a file can be written, synced and
// removed there. The error says what is wrong and which flag to change.
Status PrepareCheckpointDir(const std::string& dir);

// File descriptors psd needs besides its workers' connections: listeners, checkpoint files, logs
// (64), the metrics port's sessions (up to 64), shard links and shared-memory segments.
inline constexpr uint64_t kReservedFds = 192;
// Makes room for `max_connections` descriptors: raises the soft RLIMIT_NOFILE up to the hard one
// if needed; an error naming both numbers when even the hard limit is too low.
Status EnsureFdLimit(int max_connections);

// An auth token shorter than this does not protect a listener beyond loopback (it is guessed
// online, one hello at a time).
inline constexpr size_t kMinSecretBytes = 16;
// A cluster secret shorter than this is refused at start. Anyone who reaches a shard's port gets
// one proof (the answer to a peer hello, an HMAC over nonces it knows) and can test guesses of the
// secret against it offline: only a random secret of this length (128 bits and more as hex) makes
// that hopeless. The deploy files and psrun write 64 hex digits.
inline constexpr size_t kMinClusterSecretBytes = 32;
// Checks a cluster secret read from --cluster-secret-file: long enough and not the workers' secret.
Status ValidateClusterSecret(std::string_view secret, std::string_view auth_token);

}  // namespace psd::server

#endif  // PSD_SERVER_CONFIG_SERVER_CONFIG_H_
