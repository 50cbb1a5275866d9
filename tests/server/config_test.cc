#include <sched.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "config/server_config.h"
#include "psd/cluster_list.h"
#include "psd/cores.h"

using namespace psd;
using psd::server::ServerConfig;

TEST_CASE("total replicas defaults to R plus backups, tokens per step is max(N, R)", "[config]") {
  ServerConfig c;
  c.replicas_to_aggregate = 2;
  c.backup_replicas = 1;
  REQUIRE(c.Validate().ok());
  CHECK(c.total_replicas == 3);
  CHECK(c.tokens_per_step == 3);
  CHECK(c.resolved_init_tokens == 2);  // TF default: R

  ServerConfig d;
  d.replicas_to_aggregate = 4;
  d.total_replicas = 2;
  REQUIRE(d.Validate().ok());
  CHECK(d.tokens_per_step == 4);
}

TEST_CASE("the I/O and apply thread counts default to one per core this process may use", "[config]") {
  ServerConfig c;
  REQUIRE(c.Validate().ok());
  CHECK(c.io_threads == psd::UsableCores());
  CHECK(c.apply_threads == psd::UsableCores());
  ServerConfig given;
  given.io_threads = 3;
  given.apply_threads = 5;
  REQUIRE(given.Validate().ok());
  CHECK(given.io_threads == 3);
  CHECK(given.apply_threads == 5);

  // The affinity mask counts, not the machine: pinned to one CPU, one thread each.
  cpu_set_t saved;
  REQUIRE(sched_getaffinity(0, sizeof(saved), &saved) == 0);
  int first = 0;
  while (!CPU_ISSET(first, &saved)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  REQUIRE(sched_setaffinity(0, sizeof(one), &one) == 0);
  int pinned = psd::UsableCores();
  ServerConfig p;
  Status s = p.Validate();
  REQUIRE(sched_setaffinity(0, sizeof(saved), &saved) == 0);
  REQUIRE(s.ok());
  CHECK(pinned == 1);
  CHECK(p.io_threads == 1);
  CHECK(p.apply_threads == 1);
}

TEST_CASE("busy-poll on every core psd may use is a caution that says what to change", "[config]") {
  const int cores = psd::UsableCores();
  ServerConfig all;
  all.busy_poll = true;  // --threads 0: one per core
  REQUIRE(all.Validate().ok());
  auto cautions = all.Cautions();
  REQUIRE(cautions.size() == 1);
  CHECK_THAT(cautions[0], Catch::StartsWith("--busy-poll with " + std::to_string(cores) + " I/O thread(s) on the " +
                                            std::to_string(cores) + " core(s) psd may use"));
  CHECK_THAT(cautions[0], Catch::Contains("give --threads fewer than the cores psd may use"));
  ServerConfig sleeping;  // threads that sleep in epoll_wait take no core while idle
  REQUIRE(sleeping.Validate().ok());
  CHECK(sleeping.Cautions().empty());
  if (cores < 2) return;  // no thread count below the cores to try
  ServerConfig fewer;
  fewer.busy_poll = true;
  fewer.io_threads = cores - 1;
  REQUIRE(fewer.Validate().ok());
  CHECK(fewer.Cautions().empty());
}

TEST_CASE("contradictory or impossible flags are rejected with what to change", "[config]") {
  ServerConfig c;
  c.replicas_to_aggregate = 2;
  c.backup_replicas = 1;
  c.total_replicas = 5;
  Status s = c.Validate();
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Contains("--total-replicas") && Catch::Contains("--backup-replicas"));

  ServerConfig z;
  z.replicas_to_aggregate = 0;
  CHECK_THAT(z.Validate().message(), Catch::Contains("--replicas-to-aggregate"));

  ServerConfig o;
  o.optimizer.name = "adamw";
  CHECK_THAT(o.Validate().message(), Catch::Contains("--optimizer"));

  // Shard replicas: a copy lives on the next shard of a cluster, in every mode.
  ServerConfig r;
  r.replicas_per_shard = 2;
  CHECK_THAT(r.Validate().message(), Catch::Contains("--replicas-per-shard 2 needs a --cluster"));
  r.cluster = {"127.0.0.1:7001", "127.0.0.1:7002"};
  CHECK(r.Validate().ok());
  r.mode = psd::server::Mode::kAsync;
  CHECK(r.Validate().ok());
  r.mode = psd::server::Mode::kSsp;
  CHECK(r.Validate().ok());
  r.mode = psd::server::Mode::kSync;
  r.replicas_per_shard = 3;
  CHECK_THAT(r.Validate().message(), Catch::Contains("--replicas-per-shard"));
  // Takeover: 0 (off) up to an hour.
  r.replicas_per_shard = 2;
  r.takeover_after_ms = 0;
  CHECK(r.Validate().ok());
  r.takeover_after_ms = -1;
  CHECK_THAT(r.Validate().message(), Catch::Contains("--takeover-after-ms"));
  r.takeover_after_ms = 3600001;
  CHECK_THAT(r.Validate().message(), Catch::Contains("--takeover-after-ms"));
}

TEST_CASE("init tokens follow get_init_tokens_op", "[config]") {
  CHECK(*server::ResolveInitTokens(-1, 3, 5) == 3);
  CHECK(*server::ResolveInitTokens(0, 3, 5) == 0);
  CHECK(*server::ResolveInitTokens(2, 4, 2) == 2);
  auto few = server::ResolveInitTokens(1, 4, 2);
  REQUIRE(!few.ok());
  CHECK(few.status().message() == "Too few tokens to finish the first step: 1 (given) vs 2 (needed)");

  ServerConfig c;
  c.replicas_to_aggregate = 4;
  c.total_replicas = 2;
  c.init_tokens = 1;
  Status s = c.Validate();
  CHECK_THAT(s.message(), Catch::StartsWith("Too few tokens to finish the first step: 1 (given) vs 2 (needed)"));
  CHECK_THAT(s.message(), Catch::Contains("--init-tokens"));
}

namespace {

// Validate()'s message for `c`, or "" when it passes.
std::string ValidateMessage(ServerConfig c) {
  Status s = c.Validate();
  return s.ok() ? "" : s.message();
}

}  // namespace

TEST_CASE("every numeric flag is range-checked with the flag and its range in the message", "[config]") {
  auto with = [](auto set) {
    ServerConfig c;
    set(c);
    return ValidateMessage(c);
  };
  CHECK(with([](ServerConfig&) {}) == "");
  CHECK_THAT(with([](ServerConfig& c) { c.backup_replicas = -2; }),
             Catch::Contains("-B/--backup-replicas must be in [-1, 65536] (-1: not given), got -2"));
  CHECK_THAT(with([](ServerConfig& c) { c.total_replicas = 0; }),
             Catch::Contains("-N/--total-replicas must be in [1, 65536], got 0"));
  // Each token is queued: a mistyped huge count exhausted memory at start (or at every step).
  CHECK_THAT(with([](ServerConfig& c) { c.replicas_to_aggregate = 1000000000; }),
             Catch::Contains("-R/--replicas-to-aggregate must be in [1, 65536], got 1000000000"));
  CHECK_THAT(with([](ServerConfig& c) { c.total_replicas = 1 << 17; }),
             Catch::Contains("-N/--total-replicas must be in [1, 65536]"));
  CHECK_THAT(with([](ServerConfig& c) { c.init_tokens = 1000000000; }),
             Catch::Contains("--init-tokens must be in [-1, 1048576] (-1: the default, R), got 1000000000"));
  CHECK(with([](ServerConfig& c) {
          c.replicas_to_aggregate = 65536;
          c.init_tokens = 1 << 20;
        }) == "");
  // A port file with the metrics port off would never be written (a launcher waiting for it hangs).
  CHECK_THAT(with([](ServerConfig& c) { c.metrics_port_file = "/tmp/never"; }),
             Catch::Contains("--metrics-port-file needs --metrics-port"));
  CHECK_THAT(with([](ServerConfig& c) { c.summary_interval_s = -5; }),
             Catch::Contains("--summary-interval-s must be in [0, 1000000000] (0: none), got -5"));
  CHECK_THAT(with([](ServerConfig& c) { c.io_threads = -1; }),
             Catch::Contains("--threads must be in [0, 256] (0: one per core), got -1"));
  CHECK_THAT(with([](ServerConfig& c) { c.apply_threads = 257; }),
             Catch::Contains("--apply-threads must be in [0, 256] (0: one per core), got 257"));
  CHECK_THAT(with([](ServerConfig& c) { c.heartbeat_ms = 0; }), Catch::Contains("--heartbeat-ms must be in [1,"));
  CHECK_THAT(with([](ServerConfig& c) { c.election_timeout_ms = 100; }),
             Catch::Contains("--election-timeout-ms must be > --heartbeat-ms (100), got 100"));
  CHECK_THAT(with([](ServerConfig& c) { c.staleness_bound = -1; }), Catch::Contains("--staleness must be >= 0"));
  CHECK_THAT(with([](ServerConfig& c) { c.soft_sync_fraction = 1.5; }),
             Catch::Contains("--soft-sync-fraction must be in [0, 1]"));
  CHECK_THAT(with([](ServerConfig& c) { c.worker_grace_s = -1; }), Catch::Contains("--worker-grace-s must be in [0,"));
  CHECK_THAT(with([](ServerConfig& c) { c.keep_checkpoints = -1; }),
             Catch::Contains("--keep-checkpoints must be >= 0"));
  CHECK_THAT(with([](ServerConfig& c) { c.max_connections = 0; }), Catch::Contains("--max-connections must be in [1,"));
  CHECK_THAT(with([](ServerConfig& c) { c.max_frame_bytes = 100; }),
             Catch::Contains("--max-frame-bytes must be in [4 KiB, 16 GiB], got 100 bytes"));
  CHECK_THAT(with([](ServerConfig& c) { c.max_frame_bytes = 32ull << 30; }), Catch::Contains("got 32 GiB"));
  CHECK_THAT(with([](ServerConfig& c) { c.max_inflight_bytes = 1000; }),
             Catch::Contains("--max-inflight-bytes must be in [64 KiB"));
  CHECK_THAT(with([](ServerConfig& c) { c.frame_timeout_ms = 0; }),
             Catch::Contains("--frame-timeout-ms must be in [1,"));
  CHECK_THAT(with([](ServerConfig& c) { c.slice_bytes = 1; }), Catch::Contains("--slice-bytes must be in [4 KiB"));
  CHECK_THAT(with([](ServerConfig& c) { c.checkpoint_every_steps = -1; }),
             Catch::Contains("--checkpoint-every-steps must be >= 0"));
  CHECK_THAT(with([](ServerConfig& c) { c.checkpoint_every_s = -1; }),
             Catch::Contains("--checkpoint-every-s must be in [0,"));
  CHECK_THAT(with([](ServerConfig& c) { c.optimizer.learning_rate = 0; }),
             Catch::Contains("--learning-rate must be > 0"));
  CHECK_THAT(with([](ServerConfig& c) { c.optimizer.momentum = 1; }), Catch::Contains("--momentum must be in [0, 1)"));
  CHECK_THAT(with([](ServerConfig& c) { c.optimizer.beta2 = std::nan(""); }),
             Catch::Contains("--beta1/--beta2 must be in [0, 1)"));  // NaN is out of every range
  CHECK_THAT(with([](ServerConfig& c) { c.default_token_timeout_ms = 0; }),
             Catch::Contains("--token-timeout-ms must be in [1, 604800000], got 0"));
  // Past a week a deadline added to a clock overflowed and fired at once (every step forced).
  CHECK_THAT(with([](ServerConfig& c) { c.default_token_timeout_ms = INT64_MAX; }),
             Catch::Contains("--token-timeout-ms must be in [1, 604800000]"));
  CHECK_THAT(with([](ServerConfig& c) { c.step_deadline_ms = INT64_MAX; }),
             Catch::Contains("--step-deadline-ms must be in [0, 604800000] (0: off)"));
  CHECK_THAT(with([](ServerConfig& c) { c.election_timeout_ms = INT64_MAX; }),
             Catch::Contains("--election-timeout-ms must be in [2, 86400000]"));
}

TEST_CASE("size flags take K, M, G, T suffixes (powers of 1024)", "[config]") {
  using psd::server::ParseByteSize;
  CHECK(*ParseByteSize("4096", "--max-frame-bytes") == 4096);
  CHECK(*ParseByteSize("512K", "--max-frame-bytes") == 512ull << 10);
  CHECK(*ParseByteSize("64M", "--max-frame-bytes") == 64ull << 20);
  CHECK(*ParseByteSize("64m", "--max-frame-bytes") == 64ull << 20);
  CHECK(*ParseByteSize("1G", "--max-frame-bytes") == 1ull << 30);
  CHECK(*ParseByteSize("1GiB", "--max-frame-bytes") == 1ull << 30);
  CHECK(*ParseByteSize("2T", "--max-model-bytes") == 2ull << 40);
  for (const char* bad : {"", "M", "64X", "1.5G", "-1", "64 MB extra", "99999999999999999999"}) {
    auto r = ParseByteSize(bad, "--slice-bytes");
    INFO(bad);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::StartsWith("--slice-bytes '"));
  }
  CHECK_THAT(ParseByteSize("64X", "--slice-bytes").status().message(),
             Catch::Contains("K, M, G or T (powers of 1024), e.g. 64M"));
  CHECK_FALSE(ParseByteSize("16777216T", "--max-model-bytes").ok());  // 2^64: overflows
  CHECK(psd::server::FormatByteSize(256ull << 20) == "256 MiB");
  CHECK(psd::server::FormatByteSize(4097) == "4097 bytes");
}

namespace {

struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/psd_config_test.XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string Write(const std::string& name, const std::string& text) const {
    std::ofstream(path + "/" + name) << text;
    return path + "/" + name;
  }
  std::string path;
};

const std::vector<std::string> kKeys = {"replicas-to-aggregate", "backup-replicas", "learning-rate", "host", "R"};

}  // namespace

TEST_CASE("config files are strict: unknown keys, sections and snake_case are errors naming the line", "[config]") {
  TempDir dir;
  using psd::server::CheckConfigFile;
  std::string ok = dir.Write("ok.conf",
                             "# comment\n; comment\n\nreplicas-to-aggregate = 2\n  learning-rate=0.1  \n"
                             "host = \"0.0.0.0\"  # trailing\nR = 3\n");
  CHECK(CheckConfigFile(ok, kKeys).ok());
  std::string typo = dir.Write("psd.conf", "# c\n\nreplicas-to-agregate = 4\n");
  Status s = CheckConfigFile(typo, kKeys);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK(s.message() == typo + ":3: unknown key 'replicas-to-agregate' (did you mean replicas-to-aggregate?)");
  s = CheckConfigFile(dir.Write("a.conf", "learning-rate = 1\n[server]\nhost = \"x\"\n"), kKeys);
  CHECK_THAT(s.message(), Catch::Contains("a.conf:2: section [server] is not supported"));
  s = CheckConfigFile(dir.Write("b.conf", "replicas_to_aggregate = 2\n"), kKeys);
  CHECK_THAT(s.message(),
             Catch::EndsWith("b.conf:1: key 'replicas_to_aggregate' is spelled 'replicas-to-aggregate' (keys are the "
                             "flags without their leading dashes)"));
  s = CheckConfigFile(dir.Write("c.conf", "zzzzzzzzzz = 1\n"), kKeys);
  CHECK_THAT(s.message(), Catch::Contains("c.conf:1: unknown key 'zzzzzzzzzz' (psd --help lists the flags"));
  s = CheckConfigFile(dir.Write("d.conf", "host\n"), kKeys);
  CHECK_THAT(s.message(), Catch::Contains("d.conf:1: expected `key = value`"));
  CHECK_FALSE(CheckConfigFile(dir.path + "/missing.conf", kKeys).ok());
}

TEST_CASE("protected mode: beyond loopback needs a token (or TLS) or --insecure", "[config]") {
  ServerConfig c;
  c.host = "0.0.0.0";
  std::string m = ValidateMessage(c);
  CHECK_THAT(m, Catch::StartsWith("protected mode: psd would listen on --host 0.0.0.0") &&
                    Catch::Contains("--auth-token-file") && Catch::Contains("--insecure"));
  c.insecure = true;
  CHECK(ValidateMessage(c) == "");
  c.insecure = false;
  c.auth_token = "s3cret";  // protects a listener beyond loopback: held to the cluster secret's 16
  CHECK_THAT(ValidateMessage(c), Catch::StartsWith("--auth-token-file holds 6 characters, too few to protect a daemon "
                                                   "reachable beyond this host (--host 0.0.0.0); use at least 16"));
  c.auth_token = "sixteen-chars-ok";
  CHECK(ValidateMessage(c) == "");
  // Where mutual TLS protects the data port the token does not: a short one is the operator's
  // choice there (the metrics port, beyond loopback, still holds it to 16).
  ServerConfig tls;
  tls.host = "0.0.0.0";
  tls.tls_cert_file = "cert.pem";
  tls.tls_key_file = "key.pem";
  tls.tls_ca_file = "ca.pem";
  tls.tls_require_client_cert = true;
  tls.auth_token = "s3cret";
  CHECK(ValidateMessage(tls) == "");
  tls.metrics_host = "0.0.0.0";
  tls.metrics_port = 0;
  CHECK_THAT(ValidateMessage(tls), Catch::Contains("too few to protect a daemon reachable beyond this host "
                                                   "(--metrics-host 0.0.0.0)"));
  for (const char* loopback : {"127.0.0.1", "127.8.9.10", "::1"}) {
    ServerConfig l;
    l.host = loopback;
    l.metrics_host = loopback;
    l.metrics_port = 0;
    INFO(loopback);
    CHECK(ValidateMessage(l) == "");
  }
  ServerConfig loopback_short;  // on loopback a short token is the operator's choice
  loopback_short.auth_token = "tok";
  CHECK(ValidateMessage(loopback_short) == "");
  ServerConfig metrics;
  metrics.metrics_host = "0.0.0.0";
  CHECK(ValidateMessage(metrics) == "");  // the metrics port is off
  metrics.metrics_port = 9090;
  CHECK_THAT(ValidateMessage(metrics), Catch::Contains("--metrics-host 0.0.0.0"));
  ServerConfig v6;
  v6.host = "::";
  CHECK_THAT(ValidateMessage(v6), Catch::Contains("--host ::"));
  // A shard listens on its cluster entry's address.
  ServerConfig shard;
  shard.cluster = {"10.0.0.1:7071", "10.0.0.2:7072"};
  shard.shard_index = 1;
  REQUIRE(shard.ResolveListenAddress(false, false).ok());
  CHECK(shard.host == "10.0.0.2");
  CHECK(shard.port == 7072);
  CHECK_THAT(ValidateMessage(shard), Catch::Contains("--host 10.0.0.2 (this shard's --cluster entry)"));
}

TEST_CASE("the cluster list: one parser, validated, a one-entry list is a single daemon on its port", "[config]") {
  CHECK(*psd::ParseClusterList("a:1, b:2,,c:65535") == std::vector<std::string>{"a:1", "b:2", "c:65535"});
  CHECK_THAT(
      psd::ParseClusterList("127.0.0.1:x").status().message(),
      Catch::Contains("--cluster entry 0 '127.0.0.1:x' is not host:port (the port must be a number in 1..65535)"));
  CHECK_FALSE(psd::ParseClusterList("h:0").ok());
  CHECK_FALSE(psd::ParseClusterList("h:65536").ok());
  CHECK_FALSE(psd::ParseClusterList("h").ok());
  CHECK_FALSE(psd::ParseClusterList(":7070").ok());
  CHECK_FALSE(psd::ParseClusterList("").ok());
  CHECK_THAT(psd::ParseClusterList("h:1,g:2,h:1").status().message(), Catch::Contains("lists 'h:1' twice"));
  auto v6 = psd::ParseHostPort("[::1]:7070");
  REQUIRE(v6.ok());
  CHECK(v6->host == "::1");
  CHECK(v6->port == 7070);
  CHECK_FALSE(psd::ParseHostPort("::1:7070").ok());

  ServerConfig one;
  one.cluster = {"127.0.0.1:7171"};
  REQUIRE(one.ResolveListenAddress(false, false).ok());
  CHECK(one.port == 7171);
  CHECK(one.host == "127.0.0.1");
  CHECK_FALSE(one.clustered());
  CHECK(ValidateMessage(one) == "");
  ServerConfig named;  // a host name: listen on every interface
  named.cluster = {"psd-0.psd:7070", "psd-1.psd:7070"};
  REQUIRE(named.ResolveListenAddress(false, true).ok());
  CHECK(named.host == "0.0.0.0");
  CHECK(named.port == 7070);  // --port given: kept (the default here)
  ServerConfig out;
  out.cluster = {"a:1", "b:2"};
  out.shard_index = 2;
  CHECK_THAT(out.ResolveListenAddress(false, false).message(), Catch::Contains("--shard-index 2 is outside"));
  CHECK_THAT(ValidateMessage(out), Catch::Contains("use 0..1"));
  ServerConfig dup;
  dup.cluster = {"127.0.0.1:1", "127.0.0.1:1"};
  CHECK_THAT(ValidateMessage(dup), Catch::Contains("twice"));
}

TEST_CASE("the checkpoint directory is created and probed for writing at start", "[config]") {
  TempDir dir;
  std::string nested = dir.path + "/a/b/ckpt";
  REQUIRE(psd::server::PrepareCheckpointDir(nested).ok());
  CHECK(std::filesystem::is_directory(nested));
  CHECK(std::filesystem::is_empty(nested));  // the probe is gone
  std::string file = dir.Write("file", "x");
  Status s = psd::server::PrepareCheckpointDir(file + "/ckpt");
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::StartsWith("--checkpoint-dir " + file + "/ckpt cannot be created"));
  CHECK_THAT(psd::server::PrepareCheckpointDir(file).message(), Catch::Contains("Not a directory"));
}
