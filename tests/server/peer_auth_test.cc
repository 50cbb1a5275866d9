#include "net/peer_auth.h"

#include <catch2/catch.hpp>
#include <set>

#include "config/server_config.h"

using namespace psd;
using namespace psd::server::peer_auth;
using psd::server::ServerConfig;

namespace {

const std::string kSecret = "0123456789abcdef0123456789abcdef";

std::string ValidateMessage(ServerConfig c) {
  Status s = c.Validate();
  return s.ok() ? "" : s.message();
}

}  // namespace

TEST_CASE("peer proofs bind the secret, the direction, both shards, the cluster size and both nonces", "[peer_auth]") {
  auto n1 = NewNonce(), n2 = NewNonce();
  REQUIRE(n1.ok());
  REQUIRE(n2.ok());
  CHECK(n1->size() == kNonceBytes);
  CHECK(*n1 != *n2);
  Transcript t{3, 1, 2, *n1, *n2};
  std::string dialer = Proof(kSecret, Role::kDialer, t);
  std::string acceptor = Proof(kSecret, Role::kAcceptor, t);
  REQUIRE(dialer.size() == kProofBytes);
  CHECK(Verify(kSecret, Role::kDialer, t, dialer));
  CHECK(Verify(kSecret, Role::kAcceptor, t, acceptor));
  // A reflected proof (the acceptor's answer sent back as the dialer's) does not pass.
  CHECK(dialer != acceptor);
  CHECK_FALSE(Verify(kSecret, Role::kDialer, t, acceptor));
  CHECK_FALSE(Verify(kSecret, Role::kAcceptor, t, dialer));
  // Another secret, shard, size or nonce: another proof.
  CHECK_FALSE(Verify("another secret of enough length", Role::kDialer, t, dialer));
  for (Transcript other :
       {Transcript{4, 1, 2, *n1, *n2}, Transcript{3, 0, 2, *n1, *n2}, Transcript{3, 1, 0, *n1, *n2},
        Transcript{3, 2, 1, *n1, *n2}, Transcript{3, 1, 2, *n2, *n1}, Transcript{3, 1, 2, *n1, *n1}}) {
    CHECK_FALSE(Verify(kSecret, Role::kDialer, other, dialer));
  }
  // Truncated or padded proofs, wrong-length nonces.
  CHECK_FALSE(Verify(kSecret, Role::kDialer, t, dialer.substr(0, 31)));
  CHECK_FALSE(Verify(kSecret, Role::kDialer, t, dialer + "x"));
  CHECK_FALSE(Verify(kSecret, Role::kDialer, t, ""));
  std::string short_nonce = n1->substr(1);
  CHECK(Proof(kSecret, Role::kDialer, Transcript{3, 1, 2, short_nonce, *n2}).empty());
  CHECK_FALSE(Verify(kSecret, Role::kDialer, Transcript{3, 1, 2, short_nonce, *n2}, dialer));
}

TEST_CASE("the cluster secret is long enough and not the workers' token", "[peer_auth][config]") {
  CHECK(server::ValidateClusterSecret(kSecret, "").ok());
  CHECK(server::ValidateClusterSecret(kSecret, "worker-token").ok());
  CHECK_THAT(server::ValidateClusterSecret("short", "").message(), Catch::Contains("use at least 32"));
  // 16 characters were enough before: a proof any stranger can get checks guesses offline.
  CHECK_THAT(server::ValidateClusterSecret("0123456789abcdef", "").message(), Catch::Contains("offline"));
  CHECK_THAT(server::ValidateClusterSecret(kSecret, kSecret).message(),
             Catch::Contains("same secret as --auth-token-file"));
  ServerConfig c;
  c.cluster = {"127.0.0.1:7001", "127.0.0.1:7002"};
  c.cluster_secret = "short";
  CHECK_THAT(ValidateMessage(c), Catch::Contains("--cluster-secret-file holds 5 characters"));
}

TEST_CASE("protected mode: a cluster beyond loopback needs a cluster secret or --insecure", "[peer_auth][config]") {
  ServerConfig c;
  c.cluster = {"10.0.0.1:7070", "10.0.0.2:7070"};
  c.shard_index = 1;
  c.host = "10.0.0.2";
  c.auth_token = "the-workers-token-1234";  // the workers' token does not protect the shards' links
  std::string m = ValidateMessage(c);
  CHECK_THAT(m, Catch::StartsWith("protected mode: the --cluster list has 10.0.0.1:7070, beyond loopback, and no "
                                  "cluster secret") &&
                    Catch::Contains("--cluster-secret-file FILE") && Catch::Contains("--insecure"));
  c.cluster_secret = kSecret;
  CHECK(ValidateMessage(c) == "");
  c.cluster_secret.clear();
  c.insecure = true;
  CHECK(ValidateMessage(c) == "");
  // A host name counts as beyond loopback; so does one remote entry among loopback ones.
  ServerConfig named;
  named.cluster = {"127.0.0.1:7001", "psd-1.psd.default.svc:7070"};
  CHECK_THAT(ValidateMessage(named), Catch::Contains("has psd-1.psd.default.svc:7070, beyond loopback"));
  // Loopback-only clusters and single daemons keep working without one.
  ServerConfig local;
  local.cluster = {"127.0.0.1:7001", "127.0.0.2:7002", "[::1]:7003"};
  CHECK(ValidateMessage(local) == "");
  ServerConfig one;
  one.cluster = {"10.0.0.1:7070"};
  one.host = "127.0.0.1";
  CHECK(ValidateMessage(one) == "");
  // A loopback list does not protect a shard that listens beyond loopback: workers' token or
  // mutual TLS there, but the shards' links need the secret all the same.
  ServerConfig wide = local;
  wide.shard_index = 0;
  wide.host = "0.0.0.0";
  wide.auth_token = "the-workers-token-1234";
  CHECK_THAT(ValidateMessage(wide), Catch::StartsWith("protected mode: this shard listens on --host 0.0.0.0, beyond "
                                                      "loopback, and there is no cluster secret") &&
                                        Catch::Contains("--cluster-secret-file FILE"));
  wide.cluster_secret = kSecret;
  CHECK(ValidateMessage(wide) == "");
  wide.cluster_secret.clear();
  wide.insecure = true;
  CHECK(ValidateMessage(wide) == "");
}

TEST_CASE("security logs fed by the network are rate-limited", "[peer_auth]") {
  LogLimiter limiter(3, std::chrono::hours(1));
  CHECK(limiter.Allow() == 0);
  CHECK(limiter.Allow() == 0);
  CHECK(limiter.Allow() == 0);
  for (int i = 0; i < 100; ++i) CHECK(limiter.Allow() == -1);
  LogLimiter fresh(1, std::chrono::milliseconds(0));  // every call opens a new window
  CHECK(fresh.Allow() == 0);
  CHECK(fresh.Allow() == 0);
}
