#include "config/server_config.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/ip/address.hpp>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <type_traits>

#include "psd/cluster_list.h"
#include "psd/cores.h"

namespace psd::server {

Result<bool> IsLoopbackAddress(const std::string& ip) {
  boost::system::error_code ec;
  auto addr = boost::asio::ip::make_address(ip, ec);
  if (ec) return InvalidArgument("'" + ip + "' is not an IP address");
  return addr.is_loopback();
}

Result<uint64_t> ParseByteSize(const std::string& text, const std::string& flag) {
  auto bad = [&] {
    return InvalidArgument(flag + " '" + text +
                           "' is not a size: write bytes, or a whole number with K, M, G or T (powers of 1024), "
                           "e.g. 64M or 1G");
  };
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == 0 || digits > 19) return bad();
  uint64_t value = std::stoull(text.substr(0, digits));
  std::string unit = text.substr(digits);
  while (!unit.empty() && unit[0] == ' ') unit.erase(0, 1);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  int shift = 0;
  if (!unit.empty()) {
    const std::string prefixes = "KMGT";
    size_t p = prefixes.find(unit[0]);
    if (p == std::string::npos) return bad();
    shift = 10 * static_cast<int>(p + 1);
    std::string rest = unit.substr(1);
    if (!rest.empty() && rest != "B" && rest != "IB") return bad();
  }
  if (shift > 0 && value > (UINT64_MAX >> shift)) return InvalidArgument(flag + " '" + text + "' is too large");
  return value << shift;
}

std::string FormatByteSize(uint64_t bytes) {
  static const char* kUnits[] = {"TiB", "GiB", "MiB", "KiB"};
  for (int i = 0; i < 4; ++i) {
    int shift = 10 * (4 - i);
    if (bytes != 0 && bytes % (1ull << shift) == 0) return std::to_string(bytes >> shift) + " " + kUnits[i];
  }
  return std::to_string(bytes) + " bytes";
}

namespace {

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

}  // namespace

Status CheckConfigFile(const std::string& path, const std::vector<std::string>& known_keys) {
  std::ifstream f(path);
  if (!f) return InvalidArgument("--config " + path + ": cannot read the file");
  std::set<std::string> known(known_keys.begin(), known_keys.end());
  std::string line;
  for (int n = 1; std::getline(f, line); ++n) {
    std::string where = path + ":" + std::to_string(n) + ": ";
    std::string t = Trim(line);
    if (t.empty() || t[0] == '#' || t[0] == ';') continue;
    if (t[0] == '[') {
      return InvalidArgument(where + "section " + t +
                             " is not supported: psd's config file is flat, every key is a flag at the top level "
                             "(remove the header)");
    }
    size_t eq = t.find('=');
    if (eq == std::string::npos) {
      return InvalidArgument(where + "expected `key = value` (a flag name without its dashes), got '" + t + "'");
    }
    std::string key = Trim(t.substr(0, eq));
    if (key.size() >= 2 && (key.front() == '"' || key.front() == '\'') && key.back() == key.front()) {
      key = key.substr(1, key.size() - 2);
    }
    if (known.count(key) > 0) continue;
    std::string dashed = key;
    std::replace(dashed.begin(), dashed.end(), '_', '-');
    while (!dashed.empty() && dashed[0] == '-') dashed.erase(0, 1);
    if (known.count(dashed) > 0) {
      return InvalidArgument(where + "key '" + key + "' is spelled '" + dashed +
                             "' (keys are the flags without their leading dashes)");
    }
    std::string best;
    size_t best_d = 4;
    for (const std::string& k : known_keys) {
      size_t d = EditDistance(dashed, k);
      if (d < best_d) best_d = d, best = k;
    }
    return InvalidArgument(where + "unknown key '" + key + "'" +
                           (best.empty() ? std::string(" (psd --help lists the flags; keys are flags without dashes)")
                                         : " (did you mean " + best + "?)"));
  }
  return Status::Ok();
}

Status PrepareCheckpointDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return InvalidArgument("--checkpoint-dir " + dir + " cannot be created: " + ec.message());
  if (!std::filesystem::is_directory(dir, ec))
    return InvalidArgument("--checkpoint-dir " + dir + " is not a directory");
  std::string probe = dir + "/.psd-write-probe-" + std::to_string(::getpid());
  auto fail = [&](const char* what) {
    std::string why = std::strerror(errno);
    return InvalidArgument("--checkpoint-dir " + dir + " is not writable (" + what + " a probe file: " + why +
                           "); give psd a directory it can write, or fix its owner/permissions");
  };
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return fail("cannot create");
  bool ok = ::write(fd, "psd\n", 4) == 4;
  if (!ok) {
    Status s = fail("cannot write");
    ::close(fd);
    ::unlink(probe.c_str());
    return s;
  }
  ok = ::fsync(fd) == 0;
  Status s = ok ? Status::Ok() : fail("cannot fsync");
  ::close(fd);
  if (::unlink(probe.c_str()) != 0 && s.ok()) s = fail("cannot remove");
  return s;
}

Status EnsureFdLimit(int max_connections) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return Status::Ok();  // cannot tell: let accept() report it
  uint64_t need = static_cast<uint64_t>(max_connections) + kReservedFds;
  if (lim.rlim_cur == RLIM_INFINITY || lim.rlim_cur >= need) return Status::Ok();
  if (lim.rlim_max != RLIM_INFINITY && lim.rlim_max < need) {
    return InvalidArgument("--max-connections " + std::to_string(max_connections) + " needs " + std::to_string(need) +
                           " file descriptors (" + std::to_string(kReservedFds) +
                           " for psd itself), but the process may open at most " + std::to_string(lim.rlim_max) +
                           " (hard limit; soft limit " + std::to_string(lim.rlim_cur) +
                           "): lower --max-connections to " +
                           std::to_string(lim.rlim_max > kReservedFds ? lim.rlim_max - kReservedFds : 1) +
                           " or raise the limit (ulimit -n, systemd LimitNOFILE=)");
  }
  rlim_t old = lim.rlim_cur;
  lim.rlim_cur = lim.rlim_max == RLIM_INFINITY ? need : lim.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) {
    return InvalidArgument("--max-connections " + std::to_string(max_connections) + " needs " + std::to_string(need) +
                           " file descriptors but the soft limit is " + std::to_string(old) +
                           " and raising it failed: " + std::strerror(errno));
  }
  return Status::Ok();
}

Status ValidateClusterSecret(std::string_view secret, std::string_view auth_token) {
  if (secret.size() < kMinClusterSecretBytes) {
    return InvalidArgument("--cluster-secret-file holds " + std::to_string(secret.size()) +
                           " characters; use at least " + std::to_string(kMinClusterSecretBytes) +
                           " random ones, e.g. `openssl rand -hex 32 > FILE` (the same file on every shard): anyone "
                           "who reaches a shard can test guesses of a weaker one offline");
  }
  if (!auth_token.empty() && secret == auth_token) {
    return InvalidArgument(
        "--cluster-secret-file holds the same secret as --auth-token-file: every worker knows that one and could act "
        "as a shard; give the shards their own secret (`openssl rand -hex 32 > FILE`)");
  }
  return Status::Ok();
}

Status ServerConfig::ResolveListenAddress(bool host_given, bool port_given) {
  if (cluster.empty()) return Status::Ok();
  if (shard_index < 0 || shard_index >= shards()) {
    return InvalidArgument("--shard-index " + std::to_string(shard_index) + " is outside the --cluster list of " +
                           std::to_string(shards()) + " shard(s): use 0.." + std::to_string(shards() - 1));
  }
  auto me = psd::ParseHostPort(cluster[static_cast<size_t>(shard_index)], "--cluster entry");
  if (!me.ok()) return me.status();
  if (!port_given) port = me->port;
  if (!host_given) host = IsLoopbackAddress(me->host).ok() ? me->host : "0.0.0.0";
  return Status::Ok();
}

namespace {

std::string Num(double v) {
  std::string s = std::to_string(v);
  s.erase(s.find_last_not_of('0') + 1);
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

// "--flag must be in [lo, hi], got v".
template <typename T>
Status InRange(const char* flag, T v, T lo, T hi, const std::string& note = "") {
  if (v >= lo && v <= hi) return Status::Ok();
  if constexpr (std::is_floating_point_v<T>) {
    return InvalidArgument(std::string(flag) + " must be in [" + Num(lo) + ", " + Num(hi) + "]" + note + ", got " +
                           Num(v));
  } else {
    return InvalidArgument(std::string(flag) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]" +
                           note + ", got " + std::to_string(v));
  }
}

// "--flag must be >= lo, got v" (integers).
Status AtLeast(const char* flag, int64_t v, int64_t lo, const std::string& note = "") {
  if (v >= lo) return Status::Ok();
  return InvalidArgument(std::string(flag) + " must be >= " + std::to_string(lo) + note + ", got " + std::to_string(v));
}

Status SizeInRange(const char* flag, uint64_t v, uint64_t lo, uint64_t hi) {
  if (v >= lo && v <= hi) return Status::Ok();
  return InvalidArgument(std::string(flag) + " must be in [" + FormatByteSize(lo) + ", " + FormatByteSize(hi) +
                         "], got " + FormatByteSize(v));
}

}  // namespace

std::vector<std::string> ServerConfig::Cautions() const {
  std::vector<std::string> cautions;
  if (const int cores = UsableCores(); busy_poll && io_threads >= cores) {
    // Measured on 2 cores, one worker beside psd: a 4 KiB step 7-8x slower than with --threads 1.
    cautions.push_back("--busy-poll with " + std::to_string(io_threads) + " I/O thread(s) on the " +
                       std::to_string(cores) +
                       " core(s) psd may use: each spins on a core all the time, so workers or anything else on "
                       "this host run only when one yields, and small steps get several times slower; give "
                       "--threads fewer than the cores psd may use (--threads 1 serves one or a few workers)");
  }
  return cautions;
}

Status ServerConfig::Validate() {
  if (metrics_port < -1 || metrics_port > 65535) {
    return InvalidArgument("--metrics-port must be -1 (off), 0 (any free port) or a port up to 65535, got " +
                           std::to_string(metrics_port));
  }
  if (!metrics_port_file.empty() && metrics_port < 0) {
    return InvalidArgument(
        "--metrics-port-file needs --metrics-port (0: a port the kernel picks, written to that file); the metrics "
        "port is off, so the file would never be written");
  }
  // Worker counts and tokens are bounded: each token is queued at start (and N of them at every
  // step), so a mistyped 1e9 would exhaust memory instead of being refused.
  constexpr int kMaxReplicas = 1 << 16, kMaxInitTokens = 1 << 20;
  PSD_RETURN_IF_ERROR(InRange("-R/--replicas-to-aggregate", replicas_to_aggregate, 1, kMaxReplicas));
  PSD_RETURN_IF_ERROR(InRange("-B/--backup-replicas", backup_replicas, -1, kMaxReplicas, " (-1: not given)"));
  if (total_replicas != -1) PSD_RETURN_IF_ERROR(InRange("-N/--total-replicas", total_replicas, 1, kMaxReplicas));
  PSD_RETURN_IF_ERROR(InRange("--init-tokens", init_tokens, -1, kMaxInitTokens, " (-1: the default, R)"));
  if (backup_replicas >= 0 && total_replicas >= 0 && total_replicas != replicas_to_aggregate + backup_replicas) {
    return InvalidArgument("--total-replicas " + std::to_string(total_replicas) +
                           " contradicts --replicas-to-aggregate " + std::to_string(replicas_to_aggregate) +
                           " + --backup-replicas " + std::to_string(backup_replicas) +
                           "; give only one of --total-replicas and --backup-replicas");
  }
  if (total_replicas < 0) total_replicas = replicas_to_aggregate + std::max(backup_replicas, 0);
  auto tokens = ResolveInitTokens(init_tokens, replicas_to_aggregate, total_replicas);
  if (!tokens.ok()) {
    return InvalidArgument(tokens.status().message() + "; raise --init-tokens to at least " +
                           std::to_string(replicas_to_aggregate - total_replicas));
  }
  resolved_init_tokens = *tokens;
  tokens_per_step = std::max(total_replicas, replicas_to_aggregate);
  PSD_RETURN_IF_ERROR(InRange("--threads", io_threads, 0, 256, " (0: one per core)"));
  io_threads = std::min(ThreadsOrCores(io_threads), 256);
  concurrent_adds = io_threads;
  PSD_RETURN_IF_ERROR(SizeInRange("--max-frame-bytes", max_frame_bytes, 4ull << 10, 16ull << 30));
  PSD_RETURN_IF_ERROR(SizeInRange("--max-model-bytes", max_model_bytes, 4ull << 10, 1ull << 50));
  PSD_RETURN_IF_ERROR(SizeInRange("--max-inflight-bytes", max_inflight_bytes, 64ull << 10, 1ull << 50));
  PSD_RETURN_IF_ERROR(SizeInRange("--max-queued-reply-bytes", max_queued_reply_bytes, 64ull << 10, 1ull << 50));
  PSD_RETURN_IF_ERROR(SizeInRange("--shm-max-bytes", shm_max_bytes, 64ull << 10, 1ull << 44));
  PSD_RETURN_IF_ERROR(InRange("--frame-timeout-ms", frame_timeout_ms, int64_t{1}, int64_t{86400000}));
  PSD_RETURN_IF_ERROR(optimizer.Validate());
  PSD_RETURN_IF_ERROR(InRange("--apply-threads", apply_threads, 0, 256, " (0: one per core)"));
  apply_threads = std::min(ThreadsOrCores(apply_threads), 256);
  PSD_RETURN_IF_ERROR(AtLeast("--staleness", staleness_bound, 0));
  PSD_RETURN_IF_ERROR(InRange("--soft-sync-fraction", soft_sync_fraction, 0.0, 1.0, " (0: off)"));
  // Waits are bounded (a week): beyond that a deadline overflows the clocks it is added to and fires at once.
  constexpr int64_t kWeekMs = int64_t{7} * 24 * 3600 * 1000;
  PSD_RETURN_IF_ERROR(InRange("--step-deadline-ms", step_deadline_ms, int64_t{0}, kWeekMs, " (0: off)"));
  if (mode != Mode::kSync && (soft_sync_fraction > 0 || step_deadline_ms > 0)) {
    return InvalidArgument("--soft-sync-fraction and --step-deadline-ms need --mode sync");
  }
  if (mode != Mode::kSync && deterministic) {
    return InvalidArgument(
        "--deterministic needs --mode sync (async and ssp apply each push as it arrives, so "
        "their order is the arrival order): drop --deterministic or use --mode sync");
  }
  if (mode == Mode::kSync && staleness_lr != StalenessLr::kNone) {
    return InvalidArgument("--staleness-lr needs --mode async or ssp");
  }
  if (!(ema_decay >= 0 && ema_decay < 1))
    return InvalidArgument("--ema-decay must be in [0, 1), got " + Num(ema_decay));
  PSD_RETURN_IF_ERROR(AtLeast("--checkpoint-every-steps", checkpoint_every_steps, 0, " (0: off)"));
  PSD_RETURN_IF_ERROR(InRange("--checkpoint-every-s", checkpoint_every_s, 0.0, 1e9, " (0: off)"));
  if (checkpoint_dir.empty() && (checkpoint_every_steps > 0 || checkpoint_every_s > 0)) {
    return InvalidArgument("--checkpoint-every-steps/--checkpoint-every-s need --checkpoint-dir");
  }
  PSD_RETURN_IF_ERROR(AtLeast("--keep-checkpoints", keep_checkpoints, 0, " (0: keep all)"));
  PSD_RETURN_IF_ERROR(InRange("--token-timeout-ms", default_token_timeout_ms, int64_t{1}, kWeekMs));
  PSD_RETURN_IF_ERROR(InRange("--max-connections", max_connections, 1, 1 << 20));
  PSD_RETURN_IF_ERROR(InRange("--hello-timeout-ms", hello_timeout_ms, int64_t{1}, int64_t{3600000}));
  PSD_RETURN_IF_ERROR(InRange("--idle-timeout-s", idle_timeout_s, int64_t{0}, int64_t{1} << 30, " (0: never)"));
  PSD_RETURN_IF_ERROR(InRange("--worker-grace-s", worker_grace_s, 0.0, 1e9, " (0: wait forever)"));
  PSD_RETURN_IF_ERROR(InRange("--summary-interval-s", summary_interval_s, 0.0, 1e9, " (0: none)"));
  PSD_RETURN_IF_ERROR(InRange("--heartbeat-ms", heartbeat_ms, int64_t{1}, int64_t{3600000}));
  PSD_RETURN_IF_ERROR(InRange("--election-timeout-ms", election_timeout_ms, int64_t{2}, int64_t{86400000}));
  if (election_timeout_ms <= heartbeat_ms) {
    return InvalidArgument("--election-timeout-ms must be > --heartbeat-ms (" + std::to_string(heartbeat_ms) +
                           "), got " + std::to_string(election_timeout_ms));
  }
  if (shards() > 256) return InvalidArgument("--cluster has more than 256 shards");
  if (shard_index < 0 || shard_index >= shards()) {
    return InvalidArgument("--shard-index " + std::to_string(shard_index) + " is outside the --cluster list of " +
                           std::to_string(shards()) + " shard(s): use 0.." + std::to_string(shards() - 1));
  }
  PSD_RETURN_IF_ERROR(psd::ValidateClusterList(cluster, "--cluster"));
  if (clustered()) {
    if (heartbeat_ms < 10 || election_timeout_ms < 3 * heartbeat_ms) {
      return InvalidArgument("--heartbeat-ms must be >= 10 and --election-timeout-ms >= 3 x --heartbeat-ms");
    }
  }
  PSD_RETURN_IF_ERROR(SizeInRange("--slice-bytes", slice_bytes, 4ull << 10, 1ull << 50));
  PSD_RETURN_IF_ERROR(InRange("--replicas-per-shard", replicas_per_shard, 1, 2));
  if (replicas_per_shard > 1 && !clustered()) {
    return InvalidArgument(
        "--replicas-per-shard 2 needs a --cluster of 2 or more shards (a copy lives on the next shard)");
  }
  PSD_RETURN_IF_ERROR(InRange("--takeover-after-ms", takeover_after_ms, int64_t{0}, int64_t{3600000}));
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return InvalidArgument("TLS needs both --tls-cert-file and --tls-key-file");
  }
  if (!tls_enabled() && (tls_require_client_cert || !tls_ca_file.empty())) {
    return InvalidArgument("--tls-ca-file and --tls-require-client-cert need --tls-cert-file and --tls-key-file");
  }
  if (tls_require_client_cert && tls_ca_file.empty()) {
    return InvalidArgument(
        "--tls-require-client-cert needs --tls-ca-file (the CA that signs the clients' certificates)");
  }
  if (!cluster_secret.empty()) PSD_RETURN_IF_ERROR(ValidateClusterSecret(cluster_secret, auth_token));
  return CheckProtectedMode();
}

Status ServerConfig::CheckProtectedMode() const {
  // Protected mode, as Redis does it: a daemon reachable beyond this host must be protected.
  // The data port is protected by the shared secret or by mutual TLS (a client certificate signed
  // by --tls-ca-file); the metrics port only by the secret.
  if (insecure) return Status::Ok();
  bool mutual_tls = tls_enabled() && tls_require_client_cert;
  struct Listener {
    const char* flag;
    const std::string* ip;
  };
  std::vector<Listener> listeners = {{"--host", &host}};
  if (metrics_port >= 0) listeners.push_back({"--metrics-host", &metrics_host});
  for (const Listener& l : listeners) {
    auto loopback = IsLoopbackAddress(*l.ip);
    // (Where client certificates protect the data port, the token is not what does.)
    if (!auth_token.empty() && !(l.ip == &host && mutual_tls)) {
      // The token is what protects a listener beyond loopback: a short one is guessed (nothing
      // slows down wrong guesses over HTTP), so it is held to the cluster secret's length.
      if ((loopback.ok() && *loopback) || auth_token.size() >= kMinSecretBytes) continue;
      return InvalidArgument("--auth-token-file holds " + std::to_string(auth_token.size()) +
                             " characters, too few to protect a daemon reachable beyond this host (" + l.flag + " " +
                             *l.ip + "); use at least " + std::to_string(kMinSecretBytes) +
                             " random ones, e.g. `openssl rand -hex 32 > FILE` (the same file for every worker, tool "
                             "and shard)");
    }
    if (!loopback.ok()) return InvalidArgument(std::string(l.flag) + ": " + loopback.status().message());
    if (*loopback || (l.ip == &host && mutual_tls)) continue;
    std::string what = std::string(l.flag) + " " + *l.ip;
    if (l.ip == &host && !cluster.empty()) what += " (this shard's --cluster entry)";
    return InvalidArgument("protected mode: psd would listen on " + what +
                           ", beyond loopback, without authentication. Give every worker, tool and shard a shared "
                           "secret with --auth-token-file FILE (or, for the data port, mutual TLS: --tls-cert-file, "
                           "--tls-key-file, --tls-ca-file and --tls-require-client-cert), or, on a network you trust, "
                           "pass --insecure to allow it deliberately (or listen on 127.0.0.1)");
  }
  // The shards' links: the workers' token does not protect them (every worker knows it), and a
  // server-only TLS would not say which shard dials; only the cluster secret proves a shard.
  if (!clustered() || !cluster_secret.empty()) return Status::Ok();
  const std::string remedy =
      "Give every shard the same secret with --cluster-secret-file FILE (not the workers' --auth-token-file; "
      "`openssl rand -hex 32 > FILE`), or, on a network you trust, pass --insecure to allow it deliberately";
  for (const std::string& entry : cluster) {
    auto hp = psd::ParseHostPort(entry, "--cluster entry");
    if (!hp.ok()) return hp.status();
    auto loopback = IsLoopbackAddress(hp->host);
    if (loopback.ok() && *loopback) continue;
    return InvalidArgument("protected mode: the --cluster list has " + entry +
                           ", beyond loopback, and no cluster secret: anyone who reaches a shard's port could act "
                           "as a shard. " +
                           remedy);
  }
  // Where this shard listens counts as much as the list: loopback entries do not keep a shard
  // listening on 0.0.0.0 out of reach.
  auto here = IsLoopbackAddress(host);
  if (!here.ok()) return InvalidArgument("--host: " + here.status().message());
  if (!*here) {
    return InvalidArgument("protected mode: this shard listens on --host " + host +
                           ", beyond loopback, and there is no cluster secret: anyone who reaches its port could act "
                           "as a shard (the workers' token and certificates do not prove one). " +
                           remedy);
  }
  return Status::Ok();
}

}  // namespace psd::server
