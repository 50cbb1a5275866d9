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
};

// A shard with no live chief claims the role iff it is the lowest-index live shard it sees
// (`alive[me]` is taken as true). Returns the shard that should claim.
int Candidate(const std::vector<bool>& alive, int me);

// A heartbeat says shard `claimed` is chief at `term`. A higher term always wins; within the
// same term the lower index wins (two shards that claimed at once settle on one). Returns the
// view after it.
View OnClaim(View mine, uint64_t term, int claimed, int shards);

// Fencing: a chief-only message (commit, restore, seal, control) from `from` at `term` is acted
// on iff it is at least as new as this shard's term and comes from that term's chief; a higher
// term is adopted first (its sender is the chief), and so is the sender when this shard knows no
// chief in that term. *adopted receives the view after it.
bool AcceptChiefMessage(View mine, int from, uint64_t term, View* adopted);

}  // namespace psd::server::election

#endif  // PSD_SERVER_CLUSTER_ELECTION_H_
