// Election rules of a psd cluster, as pure functions (the ClusterCoordinator applies them; the
// tests check them directly). See coordinator.h for the protocol around them.
#ifndef PSD_SERVER_CLUSTER_ELECTION_H_
#define PSD_SERVER_CLUSTER_ELECTION_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace psd::server::election {

struct View {
  uint64_t term = 0;
  int chief = -1;  // -1: none known
  // Which process of shard `chief` leads `term` (its incarnation, ClusterOptions::incarnation):
  // a stand-in and its shard's own process both speak as that index, and each may claim a term
  // the other never heard of. 0: not known yet (heard of through another shard).
  uint64_t leader = 0;
};

// A shard with no live chief claims the role iff it is the lowest-index live shard it sees
// (`alive[me]` is taken as true). Returns the shard that should claim.
int Candidate(const std::vector<bool>& alive, int me);

// Whether process `sender` (0: not said) may be the one that leads `mine.term` here: the one
// pinned, or any while none is.
bool MayLead(const View& mine, uint64_t sender);

// A heartbeat from shard `from` (process `sender`; 0: not said) says shard `claimed` is chief at
// `term`. A higher term always wins; within the same term the lower index wins (two shards that
// claimed at once settle on one). A chief's own heartbeat names its process as the leader, when
// none is known yet. Returns the view after it.
View OnClaim(View mine, uint64_t term, int claimed, int shards, int from, uint64_t sender);

// Fencing: a chief-only message (commit, restore, seal, control) from process `sender` of shard
// `from` at `term` is acted on iff it is at least as new as this shard's term and comes from that
// term's chief; a higher term is adopted first (its sender is the chief), and so is the sender
// when this shard knows no chief in that term. Within a term, one process leads: a message from
// another one is refused, even of the chief's index (the first to give an order here leads, and
// the other forms again in a higher term). `sender` 0: not said (then the index alone counts).
// *adopted receives the view after it.
bool AcceptChiefMessage(View mine, int from, uint64_t sender, uint64_t term, View* adopted);

}  // namespace psd::server::election

#endif  // PSD_SERVER_CLUSTER_ELECTION_H_
