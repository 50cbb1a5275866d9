// The peer codec (service/peer_codec.h): a heartbeat goes out and comes back as it was, and what
// a peer may not send is refused at decoding.
#include "service/peer_codec.h"

#include <capnp/message.h>

#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <string_view>

#include "wire/frame.h"

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
  hb.served_parts = {{7, false}, {6, true}, {0, false}};
  hb.seal_digests = {0x0123456789abcdefull, 0};  // per sealed step (0: not known)
  // The manifest of its newest sealed step (the parts' epoch is the sealing chief's term).
  hb.newest_seal = peer::Seal{7, 40, {{0, "p0", 100, 1}, {1, "p1", 100, 2}, {2, "p2", 100, 3}}};
  return hb;
}

}  // namespace

TEST_CASE("peer codec: a heartbeat round-trips, the parts of its unusable steps included", "[cluster][codec]") {
  peer::Message m{1, 9, FullHeartbeat(), /*sender=*/0x5eed0001, /*to=*/0x5eed0002};
  auto back = RoundTrip(m, 3);
  REQUIRE(back.ok());
  CHECK(back->from == 1);
  CHECK(back->term == 9);
  CHECK(back->sender == 0x5eed0001);  // which process of shard 1 sent it
  CHECK(back->to == 0x5eed0002);
  REQUIRE(std::holds_alternative<peer::Heartbeat>(back->body));
  CHECK(std::get<peer::Heartbeat>(back->body) == FullHeartbeat());
  // An older sender says no parts: an empty map, not an error.
  peer::Heartbeat old = FullHeartbeat();
  old.unsealed_parts.clear();
  old.kept_copies.clear();
  old.served_parts.clear();
  old.seal_digests.clear();
  old.newest_seal = {};
  auto plain = RoundTrip(peer::Message{1, 9, old}, 3);
  REQUIRE(plain.ok());
  CHECK(std::get<peer::Heartbeat>(plain->body).unsealed_parts.empty());
  CHECK(std::get<peer::Heartbeat>(plain->body).kept_copies.empty());
  CHECK(std::get<peer::Heartbeat>(plain->body).served_parts.empty());
  CHECK(std::get<peer::Heartbeat>(plain->body).seal_digests.empty());
  CHECK(std::get<peer::Heartbeat>(plain->body).newest_seal.parts.empty());
}

TEST_CASE("peer codec: a heartbeat's unusable parts and kept copies are checked", "[cluster][codec]") {
  peer::Heartbeat hb = FullHeartbeat();
  hb.unsealed_parts[50].shard = 3;  // of 3 shards
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("unknown shard"));
  hb = FullHeartbeat();
  hb.unsealed_parts[50].file = "../elsewhere";
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("plain file name"));
  // Nor anything that would add a line to a MANIFEST, or name the directory or its parent.
  for (const char* bad : {"p\npart 0 q 1 00", "p q", "..", ".hidden", "p\t"}) {
    hb = FullHeartbeat();
    hb.unsealed_parts[50].file = bad;
    CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("plain file name"));
  }
  hb = FullHeartbeat();
  hb.unsealed_parts[50].file = "shard-2-of-3.psdckpt";
  CHECK(RoundTrip(peer::Message{1, 9, hb}, 3).ok());
  hb = FullHeartbeat();
  for (int64_t s = 0; s < 65; ++s) hb.unsealed_parts[s] = {1, "p", 1, 1};
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("too many unsealed parts"));
  hb = FullHeartbeat();
  hb.kept_copies.push_back({1, 1});  // a fourth shard of 3
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("kept copies for more shards"));
  hb = FullHeartbeat();
  hb.served_parts.push_back({1, true});  // a fourth shard of 3
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("served parts for more shards"));
  hb = FullHeartbeat();
  hb.seal_digests.push_back(5);  // three digests for two sealed steps
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(),
             Catch::Contains("manifest digests do not match its sealed steps"));
  hb = FullHeartbeat();
  hb.newest_seal.parts.push_back({0, "p0", 100, 1});  // four parts of 3 shards
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("a seal names too many parts"));
  hb = FullHeartbeat();
  hb.newest_seal.parts[1].file = "../p1";
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("plain file name"));
}

TEST_CASE("peer codec: step lists are bounded, and terms beyond any election count refused", "[cluster][codec]") {
  // A list the chief matches against every shard's each tick (quadratic work under its lock).
  peer::Heartbeat hb = FullHeartbeat();
  hb.sealed_steps.assign(peer::kMaxListedSteps, 1);
  hb.seal_digests.clear();
  CHECK(RoundTrip(peer::Message{1, 9, hb}, 3).ok());
  hb.sealed_steps.push_back(0);
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("sealed or unusable steps"));
  hb = FullHeartbeat();
  hb.unusable_steps.assign(peer::kMaxListedSteps + 1, 1);
  CHECK_THAT(RoundTrip(peer::Message{1, 9, hb}, 3).status().message(), Catch::Contains("sealed or unusable steps"));
  // A term adopted and saved at 2^64 - 1 overflowed the next one to 0: no formation ever after.
  CHECK(RoundTrip(peer::Message{1, peer::kMaxTerm - 1, FullHeartbeat()}, 3).ok());
  CHECK_THAT(RoundTrip(peer::Message{1, peer::kMaxTerm, FullHeartbeat()}, 3).status().message(),
             Catch::Contains("2^62 or more"));
  hb = FullHeartbeat();
  hb.epoch = ~uint64_t{0};
  CHECK_FALSE(RoundTrip(peer::Message{1, 9, hb}, 3).ok());
  hb = FullHeartbeat();
  hb.own_copies[0].lineage = peer::kMaxTerm;  // a lineage is a term: the next formation's is above it
  CHECK_FALSE(RoundTrip(peer::Message{1, 9, hb}, 3).ok());
  CHECK_FALSE(RoundTrip(peer::Message{1, 9, peer::Commit{peer::kMaxTerm, 5, false, 0.1}}, 3).ok());
  CHECK(RoundTrip(peer::Message{1, 9, peer::Commit{9, 5, false, 0.1}}, 3).ok());
  // Steps: a commit of step 2^63 - 1 overflowed `step + 1` on the shard that took it (UBSan
  // stopped the daemon; a release build wrapped around).
  CHECK_THAT(RoundTrip(peer::Message{1, 9, peer::Commit{9, INT64_MAX, false, 0.1}}, 3).status().message(),
             Catch::Contains("a step"));
  CHECK_FALSE(RoundTrip(peer::Message{1, 9, peer::Commit{9, -2, false, 0.1}}, 3).ok());
  CHECK(RoundTrip(peer::Message{1, 9, peer::Commit{9, peer::kMaxStep - 1, false, 0.1}}, 3).ok());
  CHECK_FALSE(RoundTrip(peer::Message{1, 9, peer::Committed{9, peer::kMaxStep}}, 3).ok());
  peer::Control force;
  force.epoch = 9;
  force.force_step = INT64_MAX;
  CHECK_FALSE(RoundTrip(peer::Message{1, 9, force}, 3).ok());
  hb = FullHeartbeat();
  hb.released.step = INT64_MAX;
  CHECK_FALSE(RoundTrip(peer::Message{1, 9, hb}, 3).ok());
  hb = FullHeartbeat();
  hb.sealed_steps[0] = INT64_MIN;
  CHECK_FALSE(RoundTrip(peer::Message{1, 9, hb}, 3).ok());
}

TEST_CASE("peer codec: a manifest's digest depends on its parts, not their order", "[cluster][codec]") {
  const peer::PartInfo a{0, "shard-0-of-2.psdckpt", 100, 7}, b{1, "shard-1-of-2.psdckpt", 200, 9};
  CHECK(peer::SealDigest({a, b}) == peer::SealDigest({b, a}));
  CHECK(peer::SealDigest({a, b}) != 0);
  peer::PartInfo other = b;
  other.checksum = 10;  // another timeline's part
  CHECK(peer::SealDigest({a, other}) != peer::SealDigest({a, b}));
  other = b;
  other.bytes = 201;
  CHECK(peer::SealDigest({a, other}) != peer::SealDigest({a, b}));
  CHECK(peer::SealDigest({a}) != peer::SealDigest({a, b}));
}

TEST_CASE("peer codec: a replica chunk's whole words go out from the copy, uncopied, and come back borrowed",
          "[cluster][codec]") {
  auto copy = std::make_shared<std::string>(3 * 8192 + 5, '\0');
  for (size_t i = 0; i < copy->size(); ++i) (*copy)[i] = static_cast<char>(i * 131 + 7);
  auto sent = [&](uint64_t offset, size_t size, bool owned) {
    peer::Blob data =
        owned ? peer::Blob(copy, copy->data() + offset, size) : peer::Blob::Borrow(copy->data() + offset, size);
    // (Handed back, every other piece: the flag round-trips too.)
    return peer::Message{2, 4, peer::ReplicaChunk{7, 2, {7, 30}, false, offset, copy->size(), data, offset % 16 == 8}};
  };
  // Where the encoded message's segments lie: the chunk's data is one of them when referenced.
  auto segment_at = [](capnp::MallocMessageBuilder& b, const char* where) {
    for (auto s : b.getSegmentsForOutput()) {
      if (reinterpret_cast<const char*>(s.begin()) == where) return true;
    }
    return false;
  };
  struct Case {
    uint64_t offset;
    size_t size;
    bool owned;
    bool referenced;
  };
  constexpr size_t kMin = wire::kZeroCopyMinBytes;
  static_assert(8 + kMin <= 3 * 8192, "the cases lie in the copy");
  for (const Case& c : {Case{0, kMin, true, true}, Case{8192, 2 * 8192, true, true},
                        Case{3 * 8192, 5, true, false},  // the tail: not whole words
                        Case{8, kMin, true, true},       // the smallest referenced piece
                        Case{8, kMin - 8, true, false},  // smaller: copied
                        Case{4, kMin, true, false},      // not word-aligned: copied
                        Case{0, kMin, false, false}}) {  // borrowed: nothing keeps it, copied
    CAPTURE(c.offset, c.size, c.owned);
    peer::Message m = sent(c.offset, c.size, c.owned);
    capnp::MallocMessageBuilder builder;
    auto b = builder.initRoot<proto::PeerMessage>();
    PeerMessageToWire(b, m);
    CHECK(segment_at(builder, copy->data() + c.offset) == c.referenced);
    auto back = PeerMessageFromWire(b.asReader(), 3);
    REQUIRE(back.ok());
    CHECK(*back == m);  // the bytes, compared
    const auto& chunk = std::get<peer::ReplicaChunk>(back->body);
    CHECK(chunk.data.keep() == nullptr);  // borrowed from the frame
    CHECK(chunk.data.view() == std::string_view(copy->data() + c.offset, c.size));
  }
}

TEST_CASE("peer codec: a replica ack round-trips, with its ask for the copy whole or of a copy handed back",
          "[cluster][codec]") {
  for (bool whole : {false, true}) {
    for (bool hand_back : {false, true}) {
      peer::ReplicaAck ack{7, {7, 31}, whole, hand_back};
      auto back = RoundTrip(peer::Message{2, 4, ack}, 3);
      REQUIRE(back.ok());
      REQUIRE(std::holds_alternative<peer::ReplicaAck>(back->body));
      CHECK(std::get<peer::ReplicaAck>(back->body) == ack);
    }
  }
}

TEST_CASE("peer codec: a restore order round-trips with the chief's map, which is checked", "[cluster][codec]") {
  peer::Restore r{9, 40, {}, /*live=*/true, /*lineage=*/7, /*newest=*/false, {{2, "10.0.0.5:7001"}}};
  auto back = RoundTrip(peer::Message{0, 9, r}, 3);
  REQUIRE(back.ok());
  REQUIRE(std::holds_alternative<peer::Restore>(back->body));
  CHECK(std::get<peer::Restore>(back->body) == r);
  r.moved = {{3, "10.0.0.5:7001"}};  // no such shard
  CHECK_THAT(RoundTrip(peer::Message{0, 9, r}, 3).status().message(), Catch::Contains("out of range"));
  r.moved = {{1, ""}};
  CHECK_THAT(RoundTrip(peer::Message{0, 9, r}, 3).status().message(), Catch::Contains("no address"));
}

TEST_CASE("peer codec: a placement whose element count would overflow is refused", "[cluster][codec]") {
  capnp::MallocMessageBuilder m;
  auto b = m.initRoot<proto::VariablePlacement>();
  b.setName("v");
  b.setDtype(proto::DType::FLOAT32);
  auto shape = b.initShape(2);
  shape.set(0, int64_t{1} << 40);
  shape.set(1, int64_t{1} << 40);  // 2^80 elements: NumElements would overflow
  auto parts = b.initParts(1);
  parts[0].setShard(0);
  parts[0].setRowBegin(0);
  parts[0].setRowEnd(int64_t{1} << 40);
  auto placed = PlacementFromWire(b.asReader(), 2);
  REQUIRE_FALSE(placed.ok());
  CHECK_THAT(placed.status().message(), Catch::Contains("placement of 'v'") && Catch::Contains("too large"));
  shape.set(1, 4);  // a big but countable one is fine
  CHECK(PlacementFromWire(b.asReader(), 2).ok());
}
