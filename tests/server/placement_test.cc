#include "cluster/placement.h"

#include <catch2/catch.hpp>

#include "cluster/election.h"

using namespace psd;
using namespace psd::server;

namespace {

uint64_t Max(const std::vector<uint64_t>& v) { return *std::max_element(v.begin(), v.end()); }
uint64_t Min(const std::vector<uint64_t>& v) { return *std::min_element(v.begin(), v.end()); }

}  // namespace

TEST_CASE("variables go to the least-loaded shard, not round-robin", "[placement]") {
  PlacementMap map(3, 1 << 20);
  // 400 KB, then three 100 KB ones: round-robin would put 500 KB on shard 0.
  REQUIRE(map.Place("big", DType::kFloat32, {100000}).ok());
  auto a = map.Place("a", DType::kFloat32, {25000});
  auto b = map.Place("b", DType::kFloat32, {25000});
  auto c = map.Place("c", DType::kFloat32, {25000});
  REQUIRE((a.ok() && b.ok() && c.ok()));
  CHECK(map.Find("big")->parts[0].shard == 0);
  CHECK(a->parts[0].shard == 1);
  CHECK(b->parts[0].shard == 2);
  CHECK(c->parts[0].shard == 1);  // 100 KB on 1 and 2, 400 KB on 0: the lowest of the least loaded
  CHECK(map.shard_bytes() == std::vector<uint64_t>{400000, 200000, 100000});
}

TEST_CASE("placement is deterministic and balanced within the largest variable", "[placement]") {
  auto place_all = [] {
    PlacementMap map(4, 1 << 30);
    for (int i = 0; i < 200; ++i) {
      int64_t n = 1000 + (i * 7919) % 50000;
      REQUIRE(map.Place("v" + std::to_string(i), DType::kFloat32, {n}).ok());
    }
    return map;
  };
  PlacementMap one = place_all(), two = place_all();
  CHECK(one.shard_bytes() == two.shard_bytes());
  for (const auto& p : one.All()) CHECK(*two.Find(p.name) == p);
  CHECK(Max(one.shard_bytes()) - Min(one.shard_bytes()) <= 51000ull * 4);
}

TEST_CASE("a variable over the slice size is split by rows over the least-loaded shards", "[placement]") {
  PlacementMap map(3, 4096);
  REQUIRE(map.Place("small", DType::kFloat32, {10}).ok());  // 40 bytes on shard 0
  auto w = map.Place("w", DType::kFloat32, {10, 300});      // 12000 bytes: 3 slices
  REQUIRE(w.ok());
  CHECK(w->sliced);
  REQUIRE(w->parts.size() == 3);
  // Rows 4 + 3 + 3 on shards 1, 2, then 0 (the least loaded first).
  CHECK(w->parts[0].shard == 1);
  CHECK(w->parts[1].shard == 2);
  CHECK(w->parts[2].shard == 0);
  CHECK(w->parts[0].row_begin == 0);
  CHECK(w->parts[0].row_end == 4);
  CHECK(w->parts[1].row_end == 7);
  CHECK(w->parts[2].row_end == 10);
  CHECK(w->PartShape(1) == Shape{3, 300});
  CHECK(w->PartOn(0) == 2);
  // Never more slices than shards or rows.
  auto tall = map.Place("tall", DType::kFloat64, {2, 10000});
  REQUIRE(tall.ok());
  CHECK(tall->parts.size() == 2);
  auto scalar = map.Place("s", DType::kFloat64, {});
  REQUIRE(scalar.ok());
  CHECK_FALSE(scalar->sliced);
}

TEST_CASE("placing again is create-or-get, another definition is refused", "[placement]") {
  PlacementMap map(2, 4096);
  auto first = map.Place("w", DType::kFloat32, {4});
  auto again = map.Place("w", DType::kFloat32, {4});
  REQUIRE((first.ok() && again.ok()));
  CHECK(*first == *again);
  CHECK(map.shard_bytes()[0] + map.shard_bytes()[1] == 16);
  CHECK(map.Place("w", DType::kFloat64, {4}).status().code() == Code::kAlreadyExists);
  CHECK(map.Place("w", DType::kFloat32, {5}).status().code() == Code::kAlreadyExists);
}

TEST_CASE("colocate_with puts a variable on its target's shards", "[placement]") {
  PlacementMap map(3, 4096);
  REQUIRE(map.Place("x", DType::kFloat32, {100}).ok());
  REQUIRE(map.Place("y", DType::kFloat32, {100}).ok());
  auto emb = map.Place("emb", DType::kFloat32, {30, 100});  // sliced
  REQUIRE(emb.ok());
  auto slot = map.Place("emb_acc", DType::kFloat32, {30, 100}, "emb");
  REQUIRE(slot.ok());
  CHECK(slot->parts == emb->parts);  // same rows on the same shards
  auto bias = map.Place("y_bias", DType::kFloat32, {1}, "y");
  REQUIRE(bias.ok());
  CHECK(bias->parts[0].shard == map.Find("y")->parts[0].shard);
  auto odd = map.Place("odd", DType::kFloat32, {7}, "emb");  // another row count: whole, on emb's first shard
  REQUIRE(odd.ok());
  CHECK_FALSE(odd->sliced);
  CHECK(odd->parts[0].shard == emb->parts[0].shard);
  CHECK(map.Place("z", DType::kFloat32, {1}, "nope").status().code() == Code::kNotFound);
}

TEST_CASE("a placement map is rebuilt from the shards' parts", "[placement]") {
  PlacementMap map(3, 4096);
  auto w = map.Place("w", DType::kFloat32, {10, 300});
  REQUIRE(w.ok());
  PlacementMap rebuilt(3, 4096);
  REQUIRE(rebuilt.Add(*w).ok());
  REQUIRE(rebuilt.Add(*w).ok());  // every shard holding a part reports it
  CHECK(rebuilt.shard_bytes() == map.shard_bytes());
  VarPlacement other = *w;
  other.parts[0].shard = 2;
  CHECK(rebuilt.Add(other).code() == Code::kAlreadyExists);
  VarPlacement bad = *w;
  bad.parts[0].shard = 7;
  CHECK(rebuilt.Add(bad).code() == Code::kInvalidArgument);
  CHECK(rebuilt.TrainingShards() == std::vector<bool>{true, true, true});
}

TEST_CASE("election: the lowest live shard claims, higher terms win, same term, lower index", "[election]") {
  using namespace psd::server::election;
  CHECK(Candidate({false, true, true}, 2) == 1);
  CHECK(Candidate({false, false, true}, 2) == 2);
  CHECK(Candidate({true, true, true}, 2) == 0);
  CHECK(Candidate({false, false, false}, 1) == 1);  // alone: itself

  View v{3, 0};
  CHECK(OnClaim(v, 2, 1, 3, 1, 0).chief == 0);  // an older term changes nothing
  View newer = OnClaim(v, 4, 2, 3, 2, 0);
  CHECK(newer.term == 4);
  CHECK(newer.chief == 2);
  CHECK(OnClaim({4, 2}, 4, 1, 3, 1, 0).chief == 1);  // two claims in one term: the lower index wins
  CHECK(OnClaim({4, 1}, 4, 2, 3, 2, 0).chief == 1);
  CHECK(OnClaim({4, -1}, 4, 2, 3, 2, 0).chief == 2);  // no chief known yet
  CHECK(OnClaim({4, 1}, 5, 9, 3, 9, 0).chief == -1);  // a newer term naming no valid shard
}

TEST_CASE("election: a deposed chief is fenced off", "[election]") {
  using namespace psd::server::election;
  View after;
  // Shard 1 is chief at term 5; the old chief 0 (term 4) sends a commit: ignored.
  CHECK_FALSE(AcceptChiefMessage({5, 1}, 0, 0, 4, &after));
  CHECK(after.chief == 1);
  CHECK(after.term == 5);
  // The current chief at the current term: accepted.
  CHECK(AcceptChiefMessage({5, 1}, 1, 0, 5, &after));
  // Another shard at the same term is not the chief: ignored.
  CHECK_FALSE(AcceptChiefMessage({5, 1}, 2, 0, 5, &after));
  // A newer term: adopted, and its sender is the chief.
  CHECK(AcceptChiefMessage({5, 1}, 2, 0, 6, &after));
  CHECK(after.term == 6);
  CHECK(after.chief == 2);
  // No chief known at this term (the one heard of was counted gone before its link came): the
  // sender claims it, as its heartbeat would say. Its restore order is not lost.
  CHECK(AcceptChiefMessage({6, -1}, 0, 0, 6, &after));
  CHECK(after.term == 6);
  CHECK(after.chief == 0);
}

// A stand-in and its shard's own process both speak as one index, and each may claim a term the
// other never heard of (cluster simulation seed 732927: both formed epoch 6, and the other shard
// took the stand-in's restore order, then answered its shard's own process with it).
TEST_CASE("election: within a term, one process of the chief's index leads", "[election]") {
  using namespace psd::server::election;
  const uint64_t stand_in = 0xa, own = 0xb;
  View after;
  // The stand-in's order at a newer term: adopted, with its process.
  REQUIRE(AcceptChiefMessage({4, 0, 0x1}, 1, stand_in, 6, &after));
  CHECK(after.term == 6);
  CHECK(after.chief == 1);
  CHECK(after.leader == stand_in);
  // The shard's own process at the same term: refused, and the view stays.
  View pinned = after;
  CHECK_FALSE(AcceptChiefMessage(pinned, 1, own, 6, &after));
  CHECK(after.leader == stand_in);
  CHECK(AcceptChiefMessage(pinned, 1, stand_in, 6, &after));
  // Counted gone (no chief known), the term still belongs to the stand-in: its orders come back,
  // the other process's do not (it forms again in a higher term, which is adopted).
  View gone{6, -1, stand_in};
  CHECK_FALSE(AcceptChiefMessage(gone, 1, own, 6, &after));
  CHECK(AcceptChiefMessage(gone, 1, stand_in, 6, &after));
  CHECK(after.chief == 1);
  CHECK(AcceptChiefMessage(pinned, 1, own, 7, &after));
  CHECK(after.leader == own);
  // Heartbeats: the chief's own names its process when none is known; another shard's only the
  // index; the other process's own claim of a term it holds pinned changes nothing.
  CHECK(OnClaim({6, 1, 0}, 6, 1, 3, 1, own).leader == own);
  CHECK(OnClaim({5, 0, 0x1}, 6, 1, 3, 2, 0x2).leader == 0);
  CHECK(OnClaim({6, -1, stand_in}, 6, 1, 3, 1, own).chief == -1);
  CHECK(OnClaim({6, -1, stand_in}, 6, 1, 3, 1, stand_in).chief == 1);
  CHECK(OnClaim(pinned, 6, 1, 3, 1, own).leader == stand_in);
  // Sender not said (0): the index alone counts, as before.
  CHECK(AcceptChiefMessage(pinned, 1, 0, 6, &after));
}
