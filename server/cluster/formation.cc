// ClusterCoordinator (cluster/coordinator.h), its checkpoint side: which step the chief forms
// the cluster at (the checkpoints every shard can restore, seals a shard missed, an operator's
// decision), the formation's restore order and how each shard carries it out (HandleRestore,
// RestoreDone) and the chief counts the shards restored (HandleRestored), and the parts, seals and
// checkpoint requests of a running cluster. The rest of the protocol is in coordinator.cc.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <iterator>

#include "cluster/coordinator.h"

namespace psd::server {

void ClusterCoordinator::ArrivalCheckpointLocked(int64_t applied, std::vector<Action>* actions) {
  if (options_.checkpoint_dir.empty() || epoch_ != term_ || applied <= arrival_checkpoint_) return;
  const int64_t every = options_.checkpoint_every_steps;
  bool due = checkpoint_next_ || (every > 0 && applied / every > std::max<int64_t>(arrival_checkpoint_, 0) / every);
  if (!due || writer_busy_) return;  // a part still being written: the next tick orders it
  checkpoint_next_ = false;
  arrival_checkpoint_ = applied;
  peer::Message msg = MessageLocked(peer::Control{epoch_, false, applied, -1});
  actions->push_back([this, msg] { SendToAll(msg, /*include_self=*/true); });
}

std::set<int64_t> ClusterCoordinator::CommonStepsLocked() const {
  std::set<int64_t> common(sealed_.begin(), sealed_.end());
  for (int i = 0; i < shards_; ++i) {
    if (i == me_) continue;
    const auto& s = peers_[static_cast<size_t>(i)].sealed;
    std::set<int64_t> theirs, both;
    for (int64_t t : s) {
      if (SealAgreesLocked(i, t)) theirs.insert(t);
    }
    std::set_intersection(common.begin(), common.end(), theirs.begin(), theirs.end(),
                          std::inserter(both, both.begin()));
    common.swap(both);
  }
  return common;
}

bool ClusterCoordinator::SealAgreesLocked(int shard, int64_t step) const {
  if (shard == me_) return true;
  const Peer& p = peers_[static_cast<size_t>(shard)];
  auto mine = seal_parts_.find(step);
  auto at = std::find(p.sealed.begin(), p.sealed.end(), step);
  if (mine == seal_parts_.end() || at == p.sealed.end() || p.seal_digests.size() != p.sealed.size()) return true;
  const uint64_t theirs = p.seal_digests[static_cast<size_t>(at - p.sealed.begin())];
  return theirs == 0 || theirs == peer::SealDigest(mine->second);
}

namespace {

// "150, 140 and 2 more" (newest first).
std::string StepList(const std::vector<int64_t>& steps) {
  if (steps.empty()) return "none";
  std::string out;
  for (size_t i = 0; i < steps.size() && i < 4; ++i) out += (i == 0 ? "" : ", ") + std::to_string(steps[i]);
  if (steps.size() > 4) out += " and " + std::to_string(steps.size() - 4) + " more";
  return out;
}

// The manifest `seal` names `part` as shard `shard`'s part (same size and checksum).
bool NamesPart(const std::vector<peer::PartInfo>& seal, int shard, const peer::PartInfo& part) {
  auto named = std::find_if(seal.begin(), seal.end(), [shard](const peer::PartInfo& x) { return x.shard == shard; });
  return named != seal.end() && named->bytes == part.bytes && named->checksum == part.checksum;
}

}  // namespace

std::string ClusterCoordinator::DescribeCheckpointsLocked() const {
  std::string out;
  for (int i = 0; i < shards_; ++i) {
    const auto& sealed = i == me_ ? sealed_ : peers_[static_cast<size_t>(i)].sealed;
    const auto& unusable = i == me_ ? unusable_ : peers_[static_cast<size_t>(i)].unusable;
    out +=
        (i == 0 ? "" : "; ") + fmt::format("shard {} ({}) can restore step(s) {}", i, AddressOf(i), StepList(sealed));
    if (!unusable.empty()) out += " (unusable there: " + StepList(unusable) + ")";
  }
  return out;
}

bool ClusterCoordinator::ResealableLocked(int64_t step) const {
  auto has = [](const std::vector<int64_t>& v, int64_t t) { return std::find(v.begin(), v.end(), t) != v.end(); };
  if (seal_parts_.count(step) == 0 || reseal_failed_.count(step) > 0) return false;
  const std::vector<peer::PartInfo>& seal = seal_parts_.at(step);
  for (int i = 0; i < shards_; ++i) {
    const bool self = i == me_;
    const auto& sealed = self ? sealed_ : peers_[static_cast<size_t>(i)].sealed;
    const auto& unusable = self ? unusable_ : peers_[static_cast<size_t>(i)].unusable;
    const auto& unsealed_parts = self ? unsealed_parts_ : peers_[static_cast<size_t>(i)].unsealed_parts;
    if (has(sealed, step)) {
      if (!self && !SealAgreesLocked(i, step)) return false;  // its manifest is another timeline's
      continue;
    }
    if (!has(unusable, step)) return false;
    // Its part on disk, if it says: another timeline's part of this step (written after a
    // formation at an older step left the sealed one) would refuse the seal, and only after the
    // shards that obeyed the order first had replaced their live copies with the checkpoint.
    // This chief too may hold the step unsealed: it sealed it (the seal is kept), then a formation
    // at an older step, whose order the next chief's formation at this step never reached, left it.
    auto part = unsealed_parts.find(step);
    if (part == unsealed_parts.end()) {
      if (self) return false;
      continue;  // not said (an older version): the order checks
    }
    if (!NamesPart(seal, i, part->second)) return false;
  }
  return true;
}

std::optional<int64_t> ClusterCoordinator::FormationStepLocked(std::vector<Action>* actions) {
  std::set<int64_t> common = CommonStepsLocked();
  int64_t step = common.empty() ? -1 : *common.rbegin();
  // A newer checkpoint that every shard holds, some without its manifest (they missed the seal):
  // formed at, its seal sent along with the restore order, rather than rolled back further.
  reseal_.reset();
  for (auto it = seal_parts_.rbegin(); it != seal_parts_.rend() && it->first > step; ++it) {
    if (!ResealableLocked(it->first)) continue;
    spdlog::info(
        "cluster: checkpoint step {} is sealed here and held unsealed by shards that missed its seal; "
        "the restore order carries the seal",
        it->first);
    step = it->first;
    reseal_.emplace(it->first, it->second);
    break;
  }
  // Newer steps that a shard can restore and another shard has lost: no trace of them there (a
  // directory it cannot restore — a corrupt part, a seal it missed — makes the step unusable for
  // good, skipped as before).
  auto has = [](const std::vector<int64_t>& v, int64_t t) { return std::find(v.begin(), v.end(), t) != v.end(); };
  std::set<int64_t> lost;
  std::set<int> losers;
  bool allowed = options_.allow_state_loss || !options_.restore;
  for (int i = 0; i < shards_; ++i) {
    if (i != me_ && peers_[static_cast<size_t>(i)].allow_state_loss) allowed = true;
    for (int64_t t : i == me_ ? sealed_ : peers_[static_cast<size_t>(i)].sealed) {
      if (t <= step) continue;
      for (int j = 0; j < shards_; ++j) {
        const auto& sealed = j == me_ ? sealed_ : peers_[static_cast<size_t>(j)].sealed;
        const auto& unusable = j == me_ ? unusable_ : peers_[static_cast<size_t>(j)].unusable;
        if (!has(sealed, t) && !has(unusable, t)) {
          lost.insert(t);
          losers.insert(j);
        }
      }
    }
  }
  if (lost.empty()) return step;
  std::string at = step < 0 ? std::string("empty at step 0") : "at checkpoint step " + std::to_string(step);
  std::string newest = "step " + std::to_string(*lost.rbegin());
  if (decision_) {
    if (*decision_ < 0 || common.count(*decision_) > 0) {
      spdlog::error(
          "cluster: forming {} by an operator's decision (psd_admin recover), losing checkpoint {}: {}",
          *decision_ < 0 ? std::string("empty at step 0") : "at checkpoint step " + std::to_string(*decision_), newest,
          DescribeCheckpointsLocked());
      return *decision_;
    }
    spdlog::error(
        "cluster: the operator's decision (checkpoint step {}) no longer holds: not every shard can restore it",
        *decision_);
    decision_.reset();
  }
  if (allowed) {
    spdlog::error("cluster: forming {} with --allow-state-loss, losing checkpoint {}: {}", at, newest,
                  DescribeCheckpointsLocked());
    return step;
  }
  std::string who;
  for (int j : losers) who += (who.empty() ? "" : ", ") + std::to_string(j) + " (" + AddressOf(j) + ")";
  std::string why = "refusing to form the cluster " + at + ": shard(s) " + who + " lack checkpoint " + newest +
                    " that other shards hold (" + DescribeCheckpointsLocked() +
                    "). Bring back the lost --checkpoint-dir and restart that shard to keep it, or decide to lose it: "
                    "`psd_admin --cluster ... recover` (" +
                    (step < 0 ? std::string("with --empty") : "the newest common step, " + std::to_string(step)) +
                    "), `recover --empty`, or a shard restarted with --allow-state-loss (README \"Losing a shard's "
                    "checkpoints\")";
  if (why != refusal_) spdlog::error("cluster: {}", why);
  refusal_ = why;
  DegradeLocked(why, actions);
  return std::nullopt;
}

Status ClusterCoordinator::Recover(int64_t step, bool empty) {
  {
    MutexLock lock(&mu_);
    if (chief_ != me_) return NotChiefLocked();
    if (running_ || forming_ || refusal_.empty() || missing_reason_ != refusal_) {
      std::string state = running_ ? std::string("running") : (missing_reason_.empty() ? "forming" : missing_reason_);
      return FailedPrecondition("the cluster is not waiting for an operator's decision (it is " + state +
                                "); nothing to recover");
    }
    std::set<int64_t> common = CommonStepsLocked();
    std::vector<int64_t> list(common.rbegin(), common.rend());
    if (empty) {
      decision_ = -1;
    } else if (step < 0) {
      if (common.empty()) {
        return InvalidArgument(
            "no checkpoint can be restored by every shard: `psd_admin recover --empty` starts at "
            "step 0");
      }
      decision_ = *common.rbegin();
    } else if (common.count(step) == 0) {
      return InvalidArgument("checkpoint step " + std::to_string(step) +
                             " cannot be restored by every shard; those that can: " + StepList(list) +
                             (common.empty() ? " (use --empty)" : ""));
    } else {
      decision_ = step;
    }
    spdlog::error("cluster: an operator decided (psd_admin recover) to form {}",
                  *decision_ < 0 ? std::string("empty at step 0") : "at checkpoint step " + std::to_string(*decision_));
  }
  if (wake_) wake_();
  return Status::Ok();
}

bool ClusterCoordinator::SealsSettledLocked(Clock::time_point now) {
  // A checkpoint that one shard lists as restorable and another does not (yet) may be news that
  // has not reached this chief: a heartbeat sent before the manifest was written, a slow link,
  // its own seal not handled yet. Forming now would skip a checkpoint that every shard holds, as
  // if unusable, or ask an operator to give it up. So such a step (and one this chief sealed
  // lately) is waited for, from when this chief first sees it, until every shard lists it as
  // restorable or for three election timeouts (then a shard that still lacks it missed the seal
  // or lost it: skipped, or the operator is asked, as before).
  // Only steps newer than the newest one every shard lists matter: an older one would never be
  // chosen (a shard that pruned it, or that was restarted after it, is not waited for).
  std::set<int64_t> common = CommonStepsLocked(), listed;
  const int64_t newest_common = common.empty() ? -1 : *common.rbegin();
  for (int i = 0; i < shards_; ++i) {
    for (int64_t t : i == me_ ? sealed_ : peers_[static_cast<size_t>(i)].sealed) {
      listed.insert(t);
      if (common.count(t) == 0 && t > newest_common) seals_pending_.emplace(t, now);
    }
  }
  const auto window = 3 * std::chrono::milliseconds(options_.election_timeout_ms);
  bool settled = true;
  for (auto it = seals_pending_.begin(); it != seals_pending_.end();) {
    // Confirmed everywhere, older than a step every shard lists, or listed nowhere any more (its
    // seal failed, or its timeline was left): forgotten, so that a new checkpoint of that step is
    // waited for afresh.
    if (common.count(it->first) > 0 || it->first < newest_common ||
        (listed.count(it->first) == 0 && now - it->second >= window)) {
      it = seals_pending_.erase(it);
      continue;
    }
    // News that a restore order can carry (the seal a shard missed) need not be waited for.
    if (now - it->second < window && !ResealableLocked(it->first)) settled = false;
    ++it;
  }
  if (!settled && missing_reason_.find("waiting for every shard") == std::string::npos) {
    missing_reason_ = "waiting for every shard to confirm its newest checkpoint";
    missing_since_ = now;
  }
  return settled;
}

void ClusterCoordinator::StartFormationLocked(std::vector<Action>* actions) {
  // Replication: the newest state of which every part is kept live, when there is one; no
  // checkpoint is then restored and no committed step is lost.
  live_formation_.reset();
  live_newest_ = false;
  if (options_.replicate) {
    // Async/ssp: each part's newest copy (copies are taken at each shard's own count), unless that
    // failed three times in a row (a copy that does not restore): then the checkpoints.
    if (options_.applies_on_arrival) {
      live_newest_ = newest_failures_ < 3 && EveryPartCopiedLocked();
      if (live_newest_) live_formation_ = peer::LiveCopy{0, -1};
    } else {
      live_formation_ = LiveChoiceLocked();
    }
    // Old news: a shard's heartbeat from before the cluster stopped may not list the copies of the
    // last steps (a slow link), and this chief may have released a step newer than the choice.
    // Waited for, up to three election timeouts; then the choice stands (logged).
    auto now = now_();
    // Async/ssp: a part a stand-in served last has its newest copies on that stand-in's host; a
    // formation without that host's own process would restore older ones (no released step bounds
    // a part here, and pushes acknowledged after the others last heard of that host are in no copy
    // they heard of). Waited for, however long: forming without it loses those pushes.
    if (live_newest_) {
      const int part = CopiesHostMissingLocked(now);
      if (part >= 0) {
        const int host = (part + 1) % shards_;
        if (copies_host_wait_logged_ != part) {
          copies_host_wait_logged_ = part;
          spdlog::error(
              "cluster: shard {}'s part was served by a stand-in on shard {}'s host in epoch {}, the newest that "
              "served it: its newest copies are there, and shard {}'s own process ({}) is not heard. Waiting for it "
              "before forming (without it, the pushes acknowledged there would be lost); if that machine is gone "
              "for good, start psd again at {}: the cluster then forms from the copies left",
              part, host, served_[static_cast<size_t>(part)].epoch, host, options_.addresses[static_cast<size_t>(host)],
              options_.addresses[static_cast<size_t>(host)]);
        }
        // What workers and psd_admin status are told meanwhile.
        std::string why = "waiting for shard " + std::to_string(host) + " (" +
                          options_.addresses[static_cast<size_t>(host)] + "): it keeps the newest copies of shard " +
                          std::to_string(part) + "'s part, which a stand-in served there";
        if (missing_reason_ != why) {
          missing_reason_ = std::move(why);
          missing_since_ = now;
        }
        return;
      }
      copies_host_wait_logged_ = -1;
    }
    bool stale = false;
    for (int i = 0; i < shards_; ++i) {
      if (i != me_ && peers_[static_cast<size_t>(i)].last_heartbeat <= missing_since_) stale = true;
    }
    // A new chief (another chief formed this shard's epoch) whose choice is below a state this
    // shard published, or took the commit of, in that epoch: the last chief may have released it
    // since a shard not yet in this term last spoke (a commit it took later, its link from this
    // chief slow, from the last one back). What a shard says of its copies is final once it follows
    // this term, where the last chief's orders are refused. (Sync seed 983275: a new chief formed
    // at step 4 while a shard that had not heard its claim committed step 5 for the last chief,
    // which released it.) No step past every state of this shard's is released without its
    // commit, and a chief that formed its epoch knows what it released (released_).
    const bool formed_here = restore_leader_ == incarnation_ && restore_epoch_ == epoch_;
    if (!formed_here && live_formation_ && !live_newest_ && *live_formation_ < NewestOwnStateLocked() &&
        !CopiesOfThisTermLocked()) {
      stale = true;
    }
    // Released past the choice: by this chief, or (known_released_) in an epoch at least as new
    // as the copies', by whichever chief.
    int64_t past = released_;
    if (live_formation_ && known_released_.lineage >= live_formation_->lineage) {
      past = std::max(past, known_released_.step);
    }
    // Async/ssp: a part whose newest copy reachable now is older than one heard of.
    const bool newest_behind = live_newest_ && NewestBehindLocked();
    const bool behind = (!live_newest_ && live_formation_ && live_formation_->step < past) || newest_behind;
    if (behind) stale = true;
    if (!(behind && StandInServesLocked()) && stale &&
        now - missing_since_ < 3 * std::chrono::milliseconds(options_.election_timeout_ms)) {
      return;
    }
    if (behind && !StandInServesLocked()) {
      if (newest_behind) {
        spdlog::error(
            "cluster: some part's newest live copy is older than one its shards kept before (that copy was lost): "
            "pushes acknowledged since are lost");
      } else {
        spdlog::error(
            "cluster: the newest live copy of every part is of step {}, before step {} whose tokens were "
            "released: {} step(s) are lost",
            live_formation_->step, past, past - live_formation_->step);
      }
    }
    if ((!live_formation_ || behind) && StandInServesLocked()) {
      // A stand-in restores only from live copies: a part's newest copy may be on a shard cut off
      // now (a stand-in's host), and a checkpoint restored through stand-ins (their own
      // directories) would go back before steps released. Today's rollback needs every shard's own
      // process: the chief moves each part back to it when it is heard again.
      if (!stand_in_wait_logged_) {
        stand_in_wait_logged_ = true;
        spdlog::error(
            "cluster: the live copies of the shards served now do not hold every part {}: waiting for "
            "every shard's own process (a stand-in restores only from live copies); if a part's copies are lost "
            "for good, the cluster then restores the newest checkpoint every shard holds",
            newest_behind ? std::string("as new as the newest copy of it heard of")
            : behind      ? fmt::format("at one step as new as step {}, whose tokens went out", past)
                          : std::string("at one step"));
      }
      return;
    }
    stand_in_wait_logged_ = false;
    if (live_formation_) {
      live_lost_logged_ = false;
    } else if (AnyCopyHeardLocked()) {
      // Copies somewhere but not of every part, as far as this chief heard. A heartbeat sent before
      // its shard heard of this chief's term may be old news (a slow link): sent before the shard
      // restored the last epoch, it lists none of the copies that shard and the next one kept since
      // and acknowledged pushes with. A fallback would lose them: waited for, up to three election
      // timeouts after this shard became chief, until every shard has spoken in this term.
      if (!CopiesOfThisTermLocked() &&
          now - chief_since_ < 3 * std::chrono::milliseconds(options_.election_timeout_ms)) {
        const std::string why = "waiting for every shard's news of its live copies in term " + std::to_string(term_);
        if (missing_reason_ != why) {
          missing_reason_ = why;
          missing_since_ = now;
        }
        return;
      }
      // Then lost. (None anywhere: a cluster that never ran.)
      if (!live_lost_logged_) {
        live_lost_logged_ = true;
        spdlog::error(
            "cluster: no live copy of some shard's state is left (that shard and the next one both lost theirs): "
            "falling back to the newest checkpoint every shard can restore");
      }
    }
  }
  if (!live_formation_ && !SealsSettledLocked(now_())) return;
  std::optional<int64_t> chosen =
      live_formation_ ? std::optional<int64_t>(live_formation_->step) : FormationStepLocked(actions);
  if (!chosen) return;  // an operator must decide
  // Async/ssp from live copies: each shard's count comes with its copy; the chief's stands for the step.
  int64_t step = live_newest_ ? -1 : *chosen;  // newest: the highest count restored (HandleRestored)
  refusal_.clear();
  // Above every copy's lineage too (NewestLineageLocked): a copy of an epoch formed on the other side
  // of a partition, which never ran, must not order above this epoch's copies.
  term_ = std::max({term_, max_term_seen_, NewestLineageLocked()}) + 1;
  max_term_seen_ = term_;
  leader_ = incarnation_;
  SaveTermLocked(actions);  // before the restore order goes out: this epoch is never formed again
  forming_ = true;
  formation_start_ = now_();
  formation_step_ = step;
  restored_.clear();
  moved_since_formation_ = false;
  placement_.Clear();
  // Parts written in an older epoch belong to its timeline: a seal must never mix them with this
  // epoch's parts of the same step (the manifest would not match those shards' new parts).
  parts_.clear();
  votes_.clear();
  committed_.clear();
  commit_in_flight_ = -1;
  open_step_ = step < 0 ? 0 : step;
  missing_reason_ = step < 0 ? "starting empty at step 0" : "restoring checkpoint step " + std::to_string(step);
  if (live_formation_) missing_reason_ = "restoring the live copies of step " + std::to_string(step);
  if (live_newest_) missing_reason_ = "restoring the newest live copy of each part";
  spdlog::info("cluster: forming epoch {} on {} shard(s): {}", term_, shards_, missing_reason_);
  released_ = step;
  // The manifest goes with a checkpoint's restore order: a shard that missed the seal writes it
  // (if its part matches), one that holds another manifest of that step refuses (HandleRestore).
  std::vector<peer::PartInfo> seal;
  if (!live_formation_ && reseal_ && reseal_->first == step) {
    seal = reseal_->second;
  } else if (!live_formation_ && step >= 0) {
    if (auto it = seal_parts_.find(step); it != seal_parts_.end()) seal = it->second;
  }
  peer::Message msg =
      MessageLocked(peer::Restore{term_, step, std::move(seal), live_formation_.has_value(),
                                  live_formation_ ? live_formation_->lineage : 0, live_newest_, MovedLocked()});
  actions->push_back([this, msg] { SendToAll(msg, /*include_self=*/true); });
}

// --- checkpoints ------------------------------------------------------------------------------

bool ClusterCoordinator::SameParts(std::vector<peer::PartInfo> a, std::vector<peer::PartInfo> b) {
  auto by_shard = [](const peer::PartInfo& x, const peer::PartInfo& y) { return x.shard < y.shard; };
  std::sort(a.begin(), a.end(), by_shard);
  std::sort(b.begin(), b.end(), by_shard);
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](const auto& x, const auto& y) {
           return x.shard == y.shard && x.checksum == y.checksum && x.bytes == y.bytes;
         });
}

void ClusterCoordinator::UnsealLocked(const std::function<bool(int64_t)>& which) {
  for (int64_t t : sealed_) {
    if (!which(t)) continue;
    if (std::find(unusable_.begin(), unusable_.end(), t) == unusable_.end()) unusable_.push_back(t);
    KeepUnsealedPartLocked(t, std::nullopt);
  }
  std::sort(unusable_.rbegin(), unusable_.rend());
  sealed_.erase(std::remove_if(sealed_.begin(), sealed_.end(), which), sealed_.end());
}

void ClusterCoordinator::KeepUnsealedPartLocked(int64_t step, std::optional<peer::PartInfo> written) {
  if (!written) {
    // A sealed step: the part on disk is the one its manifest names.
    auto seal = seal_parts_.find(step);
    if (seal == seal_parts_.end()) return;
    for (const peer::PartInfo& p : seal->second) {
      if (p.shard == me_) written = p;
    }
    if (!written) return;
  }
  unsealed_parts_[step] = std::move(*written);
  // Only the steps listed as unusable (newest first) are said; the rest is forgotten.
  for (auto it = unsealed_parts_.begin(); it != unsealed_parts_.end();) {
    const bool listed = std::find(unusable_.begin(), unusable_.end(), it->first) != unusable_.end();
    it = listed ? std::next(it) : unsealed_parts_.erase(it);
  }
}

bool ClusterCoordinator::ManifestDiffersLocked(const peer::Restore& r) {
  const int64_t step = r.step;
  if (step < 0 || r.live || r.seal.empty() || std::find(sealed_.begin(), sealed_.end(), step) == sealed_.end()) {
    return false;
  }
  auto mine = seal_parts_.find(step);
  if (mine == seal_parts_.end() || SameParts(mine->second, r.seal)) return false;
  // Two timelines' checkpoints of one step (a stand-in wrote this shard's part of it in its own
  // directory, this shard's own process another): neither is whole anywhere. Unusable here from
  // now on; the chief forms at an older step.
  spdlog::warn(
      "cluster: refusing to restore checkpoint step {} (epoch {}): this shard's manifest of it lists other parts than "
      "the chief's (two timelines); the step is unusable here",
      step, r.epoch);
  UnsealLocked([step](int64_t t) { return t == step; });
  return true;
}

void ClusterCoordinator::OnPartWritten(uint64_t epoch, int64_t step, const peer::PartInfo& part) {
  peer::Message msg;
  int chief = -1;
  {
    MutexLock lock(&mu_);
    // A part written over a checkpoint sealed here before: another timeline's snapshot of the step
    // (async: the cluster re-formed from live copies at counts below it and counted up to it
    // again). The manifest on disk names the part replaced, so the step no longer restores here;
    // said as sealed, a chief would form at it (the restore fails) or ask an operator to give up
    // a checkpoint that no shard can restore.
    if (std::find(sealed_.begin(), sealed_.end(), step) != sealed_.end()) {
      auto seal = seal_parts_.find(step);
      const bool same = seal != seal_parts_.end() &&
                        std::any_of(seal->second.begin(), seal->second.end(), [&](const peer::PartInfo& p) {
                          return p.shard == me_ && p.bytes == part.bytes && p.checksum == part.checksum;
                        });
      if (!same) {
        spdlog::warn(
            "cluster: checkpoint step {} was sealed here; this shard's part of it was written again in epoch {} "
            "(another timeline): the step is unusable here until a seal of the new part",
            step, epoch);
        UnsealLocked([step](int64_t t) { return t == step; });
      }
    }
    // A trace of `step` on this shard until its seal arrives: if the seal never does (the cluster
    // re-formed first), the step is unusable here, not lost — a chief that did seal it must not
    // ask an operator to give it up (FormationStepLocked).
    if (std::find(unusable_.begin(), unusable_.end(), step) == unusable_.end()) unusable_.push_back(step);
    peer::PartInfo mine = part;
    mine.shard = me_;
    KeepUnsealedPartLocked(step, mine);
    // The snapshot's epoch, not the current one: a part written after the cluster re-formed
    // belongs to the timeline it was taken in (the chief drops it).
    msg = ReplyLocked(peer::PartWritten{epoch, step, std::move(mine)});
    chief = chief_;
  }
  SendTo(chief, msg);
}

void ClusterCoordinator::HearSealLocked(int from, const peer::Seal& seal) {
  // Only a step this shard lists unusable for want of its manifest, whose part here is the one the
  // manifest names (else it is another timeline's part of that step: the seal is not for it).
  if (static_cast<int>(seal.parts.size()) != shards_ || seal_parts_.count(seal.step) > 0) return;
  if (std::find(unusable_.begin(), unusable_.end(), seal.step) == unusable_.end()) return;
  auto mine = unsealed_parts_.find(seal.step);
  if (mine == unsealed_parts_.end() || !NamesPart(seal.parts, me_, mine->second)) return;
  spdlog::info(
      "cluster: shard {} holds its part of checkpoint step {} but missed the seal; keeps the manifest shard {} "
      "sealed, for a formation to seal it here",
      me_, seal.step, from);
  seal_parts_[seal.step] = seal.parts;
}

void ClusterCoordinator::AddSealedLocked(int64_t step) {
  unusable_.erase(std::remove(unusable_.begin(), unusable_.end(), step), unusable_.end());
  unsealed_parts_.erase(step);
  if (std::find(sealed_.begin(), sealed_.end(), step) == sealed_.end()) sealed_.push_back(step);
  std::sort(sealed_.rbegin(), sealed_.rend());
  if (options_.keep_checkpoints > 0 && sealed_.size() > static_cast<size_t>(options_.keep_checkpoints)) {
    sealed_.resize(static_cast<size_t>(options_.keep_checkpoints));
  }
  // Seals of pruned checkpoints are not needed any more.
  while (!seal_parts_.empty() && (sealed_.empty() || seal_parts_.begin()->first < sealed_.back())) {
    seal_parts_.erase(seal_parts_.begin());
  }
}

void ClusterCoordinator::HandlePartWritten(int from, uint64_t term, const peer::PartWritten& p,
                                           std::vector<Action>* actions) {
  if (chief_ != me_ || term != term_ || p.epoch != term_ || p.part.shard != from) return;
  // A shard moved since this epoch formed (takeover): the process that wrote its part is not the
  // one a seal would reach now. The next formation starts over.
  if (moved_since_formation_) return;
  int64_t step = p.step;
  // Steps whose parts are still coming in are few (a checkpoint each): beyond kMaxPartSteps the
  // oldest goes, so a shard naming ever new steps cannot grow the map.
  if (!parts_.contains(step) && parts_.size() >= kMaxPartSteps) parts_.erase(parts_.begin());
  auto& parts = parts_[step];
  parts[from] = p.part;
  if (static_cast<int>(parts.size()) < shards_) return;
  peer::Seal seal{term_, step, {}};
  for (auto& [shard, part] : parts) seal.parts.push_back(part);
  parts_.erase(parts_.begin(), parts_.upper_bound(step));
  seals_pending_[step] = now_();  // a new checkpoint of this step: waited for afresh
  peer::Message msg = MessageLocked(std::move(seal));
  actions->push_back([this, msg] { SendToAll(msg, /*include_self=*/true); });
}

void ClusterCoordinator::HandleSeal(int from, uint64_t term, uint64_t sender, const peer::Seal& s,
                                    std::vector<Action>* actions) {
  if (!AcceptChiefLocked(from, sender, term, actions) || options_.checkpoint_dir.empty()) return;
  if (static_cast<int>(s.parts.size()) != shards_) return;
  // Parts of another epoch than this shard's engine: its own part of that step, if any, is not
  // the one listed (a seal meant for the process that served this shard then, a stand-in or its
  // own, reaching the other after a takeover). A missed seal comes again with a restore order.
  if (s.epoch != epoch_) return;
  int64_t step = s.step;
  bool finish = job_done_ && step == final_step_;
  if (finish) awaiting_final_seal_ = false;  // this seal finishes the job, not the timeout
  actions->push_back([this, step, parts = s.parts, finish] {
    auto t0 = now_();
    Status w = host_.SealCheckpoint(step, parts);
    if (!w.ok()) {
      spdlog::error("cluster: cannot seal checkpoint step {}: {}", step, w.message());
    } else {
      {
        MutexLock lock(&mu_);
        seal_parts_[step] = parts;
        AddSealedLocked(step);
      }
      spdlog::info("cluster: checkpoint at step {} sealed in {} ({} shards, {:.0f} ms)", step, options_.checkpoint_dir,
                   shards_, std::chrono::duration<double, std::milli>(now_() - t0).count());
    }
    if (finish) host_.FinishJob();
  });
}

void ClusterCoordinator::RequestCheckpoint(bool timed) {
  peer::Message msg;
  int chief = -1;
  {
    MutexLock lock(&mu_);
    if (chief_ == me_) {
      checkpoint_next_ = true;
      return;
    }
    if (timed) return;  // the chief's own timer counts
    msg = MessageLocked(peer::CheckpointRequest{});
    chief = chief_;
  }
  SendTo(chief, msg);
}

// --- carrying out a restore order, and the chief counting the shards restored ---------------

void ClusterCoordinator::RefuseRestoreLocked(int from, uint64_t sender, const peer::Restore& r, const std::string& why,
                                             std::vector<Action>* actions) {
  peer::Message reply = MessageLocked(peer::Restored{r.epoch, r.step, false, why, {}});
  reply.to = sender;
  actions->push_back([this, from, reply] { SendTo(from, reply); });
}

void ClusterCoordinator::HandleRestore(int from, uint64_t term, uint64_t sender, const peer::Restore& r,
                                       std::vector<Action>* actions) {
  const bool served_past = ServedPastLocked(r);
  if (!AcceptChiefLocked(from, sender, term, actions)) return;
  uint64_t epoch = r.epoch;
  int64_t step = r.step;
  if (ManifestDiffersLocked(r)) {
    return RefuseRestoreLocked(from, sender, r, "its manifest of that step lists other parts", actions);
  }
  if (served_past && epoch > restore_epoch_) {
    // Chosen on old news (the order came late: meanwhile this shard's epoch, served through a
    // stand-in, released steps past it). Refused, with this shard's newer copies kept: its
    // heartbeats list them, and the chief chooses again.
    spdlog::warn(
        "cluster: refusing the restore of the live copies of step {} (epoch {}): this shard's epoch {} released "
        "steps past it; its copies of them are kept for the next formation",
        step, epoch, epoch_);
    return RefuseRestoreLocked(from, sender, r, "the epoch it served released steps past this choice", actions);
  }
  // Once per epoch: the same order again (a duplicate) must not reset a state that has moved on.
  if (epoch <= restore_epoch_) return;
  restore_epoch_ = epoch;
  restore_leader_ = sender;
  // Where the chief serves each shard in this epoch (its heartbeats may say so only later): a copy
  // fetched below comes from the process serving the next shard now.
  if (options_.replicate && chief_ != me_) FollowMapLocked(r.moved, actions);
  TookRestoreOrderLocked();
  serving_ = false;
  vote_.reset();
  FailArrivalWaitersLocked(
      Unavailable("shard " + std::to_string(me_) + " re-forms (epoch " + std::to_string(epoch) + "); pull and go on"),
      actions);
  DropAckLocked();  // a reply for an older epoch
  fetch_.reset();
  missing_reason_ = step < 0 ? "starting empty" : "restoring checkpoint step " + std::to_string(step);
  if (r.live) missing_reason_ = "restoring the live copies of step " + std::to_string(step);
  if (r.live && r.newest) missing_reason_ = "restoring the newest live copy of each part";
  missing_since_ = now_();
  // Async/ssp from live copies: no common step, no checkpoint left behind.
  if (r.live && r.newest) return StartNewestRestoreLocked(epoch, actions);
  // Newer checkpoints belong to a timeline the cluster leaves now (an operator's decision, or a
  // part unusable elsewhere): never offered again (on disk, the next ones overwrite them). They
  // stay a trace here, as unusable: a shard that restarts and offers one again (its disk still
  // has it) must not make the chief ask an operator to give it up a second time.
  UnsealLocked([step](int64_t t) { return t > step; });
  // A step this shard holds but missed the seal of: the order carries the seal, written first
  // (only if this shard's part matches it).
  std::vector<peer::PartInfo> seal;
  if (step >= 0 && !r.seal.empty() && std::find(sealed_.begin(), sealed_.end(), step) == sealed_.end()) {
    seal = r.seal;
  }
  if (r.live) return StartLiveRestoreLocked(epoch, {r.lineage, step}, actions);
  // A new timeline: the live copies of any older one are of no use now.
  if (options_.replicate) {
    timeline_epoch_ = epoch;
    actions->push_back([this, epoch] { host_.DropCopies(std::nullopt, epoch); });
  }
  // The host runs it (after any restore still loading: that one's result is for an older epoch).
  actions->push_back([this, epoch, step, seal = std::move(seal)] {
    host_.RestoreAsync(epoch, step, seal, [this, epoch, step, seal](Status s, std::vector<VarPlacement> placements) {
      if (s.ok() && !seal.empty()) {
        spdlog::info("cluster: shard {} sealed checkpoint step {} from the restore order (it had missed the seal)", me_,
                     step);
        MutexLock lock(&mu_);
        seal_parts_[step] = seal;
        AddSealedLocked(step);
      }
      RestoreDone(epoch, step, s, std::move(placements));
    });
  });
}

void ClusterCoordinator::RestoreDone(uint64_t epoch, int64_t step, const Status& status,
                                     std::vector<VarPlacement> placements) {
  peer::Message reply;
  int chief = -1;
  std::optional<peer::LiveCopy> live;  // the live copy restored
  bool superseded = false;             // a newer restore was ordered meanwhile
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    if (auto it = live_restores_.find(epoch); it != live_restores_.end()) live = it->second;
    superseded = epoch < restore_epoch_;
    if (status.ok()) {
      epoch_ = epoch;
      NoteRestoredLocked(me_, epoch, live ? *live : peer::LiveCopy{epoch, std::max<int64_t>(step, 0)});
      // The epoch serves once every shard said it restored, and this shard may never hear that it
      // did (cut off right after its reply): it counts the parts as served by the processes its map
      // names now. A part served by a stand-in then has its newest copies on the stand-in's host,
      // and a formation this shard later leads waits for that host (async seed 487769: the other
      // side of a partition served pushes through a stand-in and this shard, which never heard the
      // epoch serve, formed from older copies of that part and lost them).
      NoteServedLocked(/*restored=*/true);
      spdlog::info("cluster: shard {} restored {} at epoch {}", me_,
                   step < 0 ? std::string("an empty state")
                   : !live  ? "checkpoint step " + std::to_string(step)
                            : "the live copy of step " + std::to_string(step),
                   epoch);
    } else if (live) {
      // A live copy that failed (not kept, or unreadable): the checkpoint of that step, if any, is
      // still good; the chief offers another copy or a checkpoint.
      spdlog::error("cluster: shard {} cannot restore the live copy of step {}: {}", me_, step, status.message());
    } else {
      spdlog::error("cluster: shard {} cannot restore checkpoint step {}: {}", me_, step, status.message());
      if (step >= 0) {
        UnsealLocked([step](int64_t t) { return t == step; });
        if (std::find(unusable_.begin(), unusable_.end(), step) == unusable_.end()) unusable_.push_back(step);
      }
    }
    reply = MessageLocked(peer::Restored{epoch, step, status.ok(), status.message(), std::move(placements)});
    if (epoch == restore_epoch_) reply.to = restore_leader_;  // (a superseded one's is of no use: any)
    chief = chief_;
  }
  // Replication: the formation completes once the next shard keeps this shard's restored state. A
  // restore a newer one replaces makes no copy (it would push out copies the newer one needs).
  if (options_.replicate && status.ok() && !superseded) {
    ReplicateThenReply(epoch, live ? live->lineage : epoch, step < 0 ? 0 : step, chief, reply);
    host_.ReportIfIdle();
    return;
  }
  SendTo(chief, reply);
  if (status.ok()) host_.ReportIfIdle();
}

void ClusterCoordinator::HandleRestored(int from, uint64_t term, const peer::Restored& r,
                                        std::vector<Action>* actions) {
  if (chief_ != me_ || term != term_ || !forming_ || r.epoch != term_) return;
  if (!r.ok) {
    spdlog::warn("cluster: shard {} cannot restore step {}: {}; forming again", from, r.step, r.message);
    if (reseal_ && reseal_->first == r.step) reseal_failed_.insert(r.step);  // not offered that way again
    if (live_newest_) {
      ++newest_failures_;  // tried again, up to three times in a row; then the checkpoints
    } else if (live_formation_) {
      live_failed_.insert(*live_formation_);  // nor a live copy
    }
    forming_ = false;
    return;
  }
  for (const VarPlacement& p : r.placements) {
    Status s = placement_.Add(p);
    if (!s.ok()) spdlog::warn("cluster: placement from shard {}: {}", from, s.message());
  }
  restored_.insert(from);
  // Async/ssp from each part's newest copy: each shard's count comes with its copy; the global
  // step (the chief's count) goes on from the highest — the old chief's, whichever shard it was.
  if (live_newest_) formation_step_ = std::max(formation_step_, r.step);
  if (static_cast<int>(restored_.size()) < shards_) return;
  forming_ = false;
  running_ = true;
  NoteServedLocked();
  // A live copy that did not restore in an earlier formation may have failed for a passing reason
  // (a shard's restore of the epoch before still running on its lane): once an epoch runs, every
  // copy may be chosen again (a copy that never restores costs one failed formation per epoch).
  live_failed_.clear();
  if (!options_.applies_on_arrival) KnowReleasedLocked(term_, open_step_);  // the first tokens go out now
  if (live_newest_) newest_failures_ = 0;
  arrival_checkpoint_ = formation_step_;  // async/ssp: no checkpoint of the step just restored
  missing_reason_.clear();
  decision_.reset();
  spdlog::info("cluster: running at epoch {} with {} shard(s) from {} ({} variable(s) placed)", term_, shards_,
               live_newest_      ? fmt::format("each part's newest live copy (step {} on the chief)", formation_step_)
               : live_formation_ ? "the live copies of step " + std::to_string(formation_step_)
               : formation_step_ < 0 ? std::string("an empty state")
                                     : "checkpoint step " + std::to_string(formation_step_),
               placement_.All().size());
  int required = required_ > 0 ? required_ : local_required_;
  required_ = required;
  peer::Message hb = HeartbeatLocked();
  actions->push_back([this, hb, required, raise = live_newest_ ? formation_step_ : -1, epoch = term_] {
    if (raise >= 0) host_.RaiseGlobalStep(epoch, raise);
    host_.StartServing(required);
    SendToAll(hb, /*include_self=*/false);  // followers start serving now, not at the next tick
  });
  MaybeCommitLocked(actions);
}

}  // namespace psd::server
