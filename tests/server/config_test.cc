#include "config.h"

#include <catch2/catch.hpp>

using namespace psd;
using psd::server::ServerConfig;

TEST_CASE("total replicas defaults to R plus backups; tokens per step is max(N, R)", "[config]") {
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
