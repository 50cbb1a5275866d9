// The peer codec (service/peer_codec.h): a heartbeat goes out and comes back as it was, and what
// a peer may not send is refused at decoding.
#include "service/peer_codec.h"

#include <capnp/message.h>

#include <catch2/catch.hpp>

using namespace psd;
using namespace psd::server;

namespace {

Result<peer::Message> RoundTrip(const peer::Message& m, int shards) {
  capnp::MallocMessageBuilder builder;
  auto b = builder.initRoot<proto::PeerMessage>();
  PeerMessageToWire(b, m);
  return PeerMessageFromWire(b.asReader(), shards);
}

peer::Heartbeat FullHeartbeat() {
  peer::Heartbeat hb;
  hb.chief = 1;
  hb.epoch = 7;
  hb.running = true;
  hb.sealed_steps = {40, 30};
  hb.ready = true;
  hb.required = 2;
  hb.waiting = "an operator must decide";
  hb.unusable_steps = {50, 45};
  hb.own_copies = {{7, 49}, {7, 50}};
  hb.held_copies = {{7, 50}};
  hb.address = "127.0.0.1:4000";
  hb.stand_in = true;
  hb.moved = {{2, "127.0.0.1:4100"}};
  hb.released = {7, 49};
  hb.unsealed_parts = {{50, {1, "shard-1-of-3.psdckpt", 1234, 0xabcdef}}, {45, {1, "shard-1-of-3.psdckpt", 99, 7}}};
  hb.kept_copies = {{7, 48}, {6, 30}, {0, -1}};
  return hb;
}

}  // namespace

TEST_CASE("peer codec: a heartbeat round-trips, the parts of its unusable steps included", "[cluster][codec]") {
  peer::Message m{1, 9, FullHeartbeat()};
  auto back = RoundTrip(m, 3);
  REQUIRE(back.ok());
  CHECK(back->from == 1);
  CHECK(back->term == 9);
  REQUIRE(std::holds_alternative<peer::Heartbeat>(back->body));
  CHECK(std::get<peer::Heartbeat>(back->body) == FullHeartbeat());
  // An older sender says no parts: an empty map, not an error.
  peer::Heartbeat old = FullHeartbeat();
  old.unsealed_parts.clear();
  old.kept_copies.clear();
  auto plain = RoundTrip(peer::Message{1, 9, old}, 3);
  REQUIRE(plain.ok());
  CHECK(std::get<peer::Heartbeat>(plain->body).unsealed_parts.empty());
  CHECK(std::get<peer::Heartbeat>(plain->body).kept_copies.empty());
}

TEST_CASE("peer codec: a heartbeat's unusable parts and kept copies are checked", "[cluster][codec]") {
  peer::Heartbeat hb = FullHeartbeat();
  hb.unsealed_parts[50].shard = 3;  // of 3 shards
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("unknown shard"));
  hb = FullHeartbeat();
  hb.unsealed_parts[50].file = "../elsewhere";
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("plain file name"));
  hb = FullHeartbeat();
  for (int64_t s = 0; s < 65; ++s) hb.unsealed_parts[s] = {1, "p", 1, 1};
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("too many unsealed parts"));
  hb = FullHeartbeat();
  hb.kept_copies.push_back({1, 1});  // a fourth shard of 3
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("kept copies for more shards"));
}
