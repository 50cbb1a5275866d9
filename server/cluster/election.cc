#include "cluster/election.h"

namespace psd::server::election {

int Candidate(const std::vector<bool>& alive, int me) {
  for (int i = 0; i < static_cast<int>(alive.size()); ++i) {
    if (i == me || alive[static_cast<size_t>(i)]) return i;
  }
  return me;
}

bool MayLead(const View& mine, uint64_t sender) { return mine.leader == 0 || sender == 0 || sender == mine.leader; }

View OnClaim(View mine, uint64_t term, int claimed, int shards, int from, uint64_t sender) {
  bool valid = claimed >= 0 && claimed < shards;
  // The chief's own heartbeat names its process; another shard's names only its index.
  const uint64_t leader = valid && claimed == from ? sender : 0;
  if (term > mine.term) return {term, valid ? claimed : -1, leader};
  if (term != mine.term || !valid) return mine;
  if (claimed == mine.chief) {
    if (mine.leader == 0) mine.leader = leader;
    return mine;
  }
  if (mine.chief >= 0 && claimed > mine.chief) return mine;
  // No chief known (none heard yet, or the one heard was counted gone), or a lower index that
  // claimed at once: it leads, unless it is another process than the one that led this term here.
  if (mine.chief < 0) {
    if (claimed == from && !MayLead(mine, sender)) return mine;
    return {term, claimed, mine.leader != 0 ? mine.leader : leader};
  }
  return {term, claimed, leader};
}

bool AcceptChiefMessage(View mine, int from, uint64_t sender, uint64_t term, View* adopted) {
  *adopted = mine;
  if (term > mine.term) {
    *adopted = {term, from, sender};
    return true;
  }
  if (term != mine.term || !MayLead(mine, sender)) return false;
  // No chief known in this term (none heard yet, or the one heard was counted gone): a chief
  // message proves its sender claims the term, as its heartbeat would (OnClaim).
  if (mine.chief < 0) {
    *adopted = {term, from, mine.leader != 0 ? mine.leader : sender};
    return true;
  }
  if (from != mine.chief) return false;
  if (mine.leader == 0) adopted->leader = sender;
  return true;
}

}  // namespace psd::server::election
