#include "cluster/election.h"

namespace psd::server::election {

int Candidate(const std::vector<bool>& alive, int me) {
  for (int i = 0; i < static_cast<int>(alive.size()); ++i) {
    if (i == me || alive[static_cast<size_t>(i)]) return i;
  }
  return me;
}

View OnClaim(View mine, uint64_t term, int claimed, int shards) {
  bool valid = claimed >= 0 && claimed < shards;
  if (term > mine.term) return {term, valid ? claimed : -1};
  if (term == mine.term && valid && claimed != mine.chief && (mine.chief < 0 || claimed < mine.chief)) {
    return {term, claimed};
  }
  return mine;
}

bool AcceptChiefMessage(View mine, int from, uint64_t term, View* adopted) {
  if (term > mine.term) {
    *adopted = {term, from};
    return true;
  }
  // No chief known in this term (none heard yet, or the one heard was counted gone): a chief
  // message proves its sender claims the term, as its heartbeat would (OnClaim).
  if (term == mine.term && mine.chief < 0) {
    *adopted = {term, from};
    return true;
  }
  *adopted = mine;
  return term == mine.term && from == mine.chief;
}

}  // namespace psd::server::election
