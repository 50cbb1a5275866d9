#include "service/peer_codec.h"

#include <capnp/orphan.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <variant>

#include "core/training_engine.h"
#include "psd/cluster_list.h"
#include "wire/frame.h"

namespace psd::server {

namespace {

// A checkpoint part's file lives in the receiver's --checkpoint-dir: a name, never a path, and
// it goes into the step's MANIFEST line by line ("shard-N-of-M.psdckpt" from psd itself), so
// letters, digits, '.', '-' and '_' only, not starting with '.'.
Status CheckPartFile(const std::string& file) {
  const bool plain =
      !file.empty() && file.size() <= 255 && file[0] != '.' && std::all_of(file.begin(), file.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
               c == '_';
      });
  if (!plain) {
    return InvalidArgument("a checkpoint part's file must be a plain file name (letters, digits, '.', '-', '_')");
  }
  return Status::Ok();
}

Result<peer::PartInfo> PartFromWire(proto::PeerPart::Reader r, int shards) {
  peer::PartInfo p{static_cast<int>(r.getShard()), r.getFile(), r.getBytes(), r.getChecksum()};
  if (r.getShard() >= static_cast<uint32_t>(shards)) return InvalidArgument("a checkpoint part names an unknown shard");
  PSD_RETURN_IF_ERROR(CheckPartFile(p.file));
  return p;
}

void PartToWire(proto::PeerPart::Builder b, uint64_t epoch, int64_t step, const peer::PartInfo& p) {
  b.setEpoch(epoch);
  b.setStep(step);
  b.setShard(static_cast<uint32_t>(p.shard));
  b.setFile(p.file);
  b.setBytes(p.bytes);
  b.setChecksum(p.checksum);
}

std::vector<int64_t> Steps(capnp::List<int64_t>::Reader list) {
  std::vector<int64_t> steps;
  steps.reserve(list.size());
  for (int64_t s : list) steps.push_back(s);
  return steps;
}

void SetSteps(capnp::List<int64_t>::Builder b, const std::vector<int64_t>& steps) {
  for (size_t i = 0; i < steps.size(); ++i) b.set(static_cast<unsigned>(i), steps[i]);
}

peer::LiveCopy CopyFromWire(proto::PeerCopy::Reader r) { return {r.getLineage(), r.getStep()}; }

void CopyToWire(proto::PeerCopy::Builder b, const peer::LiveCopy& c) {
  b.setLineage(c.lineage);
  b.setStep(c.step);
}

// A heartbeat lists a handful of copies (two per kind); more is a malformed message.
constexpr unsigned kMaxCopies = 16;

Result<std::vector<peer::LiveCopy>> CopiesFromWire(capnp::List<proto::PeerCopy>::Reader list) {
  if (list.size() > kMaxCopies) return InvalidArgument("a heartbeat lists too many live copies");
  std::vector<peer::LiveCopy> out;
  for (auto c : list) out.push_back(CopyFromWire(c));
  return out;
}

void CopiesToWire(capnp::List<proto::PeerCopy>::Builder b, const std::vector<peer::LiveCopy>& copies) {
  for (size_t i = 0; i < copies.size(); ++i) CopyToWire(b[static_cast<unsigned>(i)], copies[i]);
}

// A peer's address: host:port with a port in 1..65535, of a sane length.
Result<std::string> AddressFromWire(capnp::Text::Reader text) {
  std::string address = text;
  if (address.empty()) return address;  // a sender of an older version: its --cluster entry
  if (address.size() > 300) return InvalidArgument("a heartbeat's address is too long");
  auto hp = ParseHostPort(address, "a heartbeat's address");
  if (!hp.ok()) return hp.status();
  if (hp->port == 0) return InvalidArgument("a heartbeat's address has port 0");
  return address;
}

// A heartbeat lists the parts of its newest unusable steps (kMaxUnsealedParts, coordinator.h).
constexpr unsigned kMaxUnsealedWire = 64;

Result<std::map<int64_t, peer::PartInfo>> UnsealedFromWire(capnp::List<proto::PeerPart>::Reader list, int shards) {
  if (list.size() > kMaxUnsealedWire) return InvalidArgument("a heartbeat lists too many unsealed parts");
  std::map<int64_t, peer::PartInfo> parts;
  for (auto p : list) {
    auto part = PartFromWire(p, shards);
    if (!part.ok()) return part.status();
    parts[p.getStep()] = std::move(*part);
  }
  return parts;
}

Result<peer::Seal> SealFromWire(proto::PeerSeal::Reader s, int shards) {
  peer::Seal seal{0, s.getStep(), {}};
  if (s.getParts().size() > static_cast<unsigned>(shards)) return InvalidArgument("a seal names too many parts");
  for (auto p : s.getParts()) {
    auto part = PartFromWire(p, shards);
    if (!part.ok()) return part.status();
    seal.epoch = p.getEpoch();
    seal.parts.push_back(std::move(*part));
  }
  return seal;
}

void SealToWire(proto::PeerSeal::Builder b, const peer::Seal& seal) {
  b.setStep(seal.step);
  auto list = b.initParts(static_cast<unsigned>(seal.parts.size()));
  for (size_t i = 0; i < seal.parts.size(); ++i) {
    PartToWire(list[static_cast<unsigned>(i)], seal.epoch, seal.step, seal.parts[i]);
  }
}

void MovedToWire(capnp::List<proto::PeerMoved>::Builder b, const std::map<int, std::string>& moved) {
  unsigned i = 0;
  for (const auto& [shard, address] : moved) {
    b[i].setShard(static_cast<uint32_t>(shard));
    b[i].setAddress(address);
    ++i;
  }
}

Result<std::map<int, std::string>> MovedFromWire(capnp::List<proto::PeerMoved>::Reader list, int shards) {
  if (list.size() > static_cast<unsigned>(shards)) return InvalidArgument("a heartbeat lists too many moved shards");
  std::map<int, std::string> moved;
  for (auto m : list) {
    if (m.getShard() >= static_cast<uint32_t>(shards)) return InvalidArgument("a moved shard is out of range");
    auto address = AddressFromWire(m.getAddress());
    if (!address.ok()) return address.status();
    if (address->empty()) return InvalidArgument("a moved shard has no address");
    moved[static_cast<int>(m.getShard())] = std::move(*address);
  }
  return moved;
}

}  // namespace

Result<VarPlacement> PlacementFromWire(proto::VariablePlacement::Reader r, int shards) {
  VarPlacement p;
  p.name = r.getName();
  PSD_RETURN_IF_ERROR(ValidateName(p.name));
  auto dtype = wire::FromWire(r.getDtype());
  if (!dtype.ok()) return dtype.status();
  p.dtype = *dtype;
  if (r.getShape().size() > 32) return InvalidArgument("placement shape rank exceeds 32");
  for (int64_t d : r.getShape()) {
    if (d < 0) return InvalidArgument("placement shape has a negative dimension");
    p.shape.push_back(d);
  }
  // Its bytes are counted (PlacementMap): no element count that overflows, whatever a peer says.
  Status sized = ValidateShape(p.shape, p.dtype, std::numeric_limits<int64_t>::max());
  if (!sized.ok()) return InvalidArgument("placement of '" + p.name + "': " + sized.message());
  p.sliced = r.getSliced();
  p.trainable = r.getTrainable();
  if (r.getParts().size() == 0 || static_cast<int>(r.getParts().size()) > shards) {
    return InvalidArgument("placement of '" + p.name + "' needs 1 to " + std::to_string(shards) + " parts");
  }
  int64_t rows = p.shape.empty() ? 1 : p.shape[0];
  int64_t next = 0;
  for (auto part : r.getParts()) {
    if (part.getShard() >= static_cast<uint32_t>(shards)) return InvalidArgument("placement names an unknown shard");
    SlicePart s{static_cast<int>(part.getShard()), part.getRowBegin(), part.getRowEnd()};
    if (p.sliced && (s.row_begin != next || s.row_end <= s.row_begin || s.row_end > rows)) {
      return InvalidArgument("placement slices of '" + p.name + "' do not tile its rows");
    }
    next = s.row_end;
    p.parts.push_back(s);
  }
  if (p.sliced && (p.shape.empty() || next != rows)) {
    return InvalidArgument("placement slices of '" + p.name + "' do not tile its rows");
  }
  return p;
}

void PlacementToWire(proto::VariablePlacement::Builder b, const VarPlacement& p) {
  b.setName(p.name);
  b.setDtype(wire::ToWire(p.dtype));
  auto shape = b.initShape(static_cast<unsigned>(p.shape.size()));
  for (size_t i = 0; i < p.shape.size(); ++i) shape.set(static_cast<unsigned>(i), p.shape[i]);
  b.setSliced(p.sliced);
  b.setTrainable(p.trainable);
  auto parts = b.initParts(static_cast<unsigned>(p.parts.size()));
  for (size_t i = 0; i < p.parts.size(); ++i) {
    parts[static_cast<unsigned>(i)].setShard(static_cast<uint32_t>(p.parts[i].shard));
    parts[static_cast<unsigned>(i)].setRowBegin(p.parts[i].row_begin);
    parts[static_cast<unsigned>(i)].setRowEnd(p.parts[i].row_end);
  }
}

namespace {

bool StepOk(int64_t step) { return step >= -1 && step < peer::kMaxStep; }

bool StepsOk(const std::vector<int64_t>& steps) { return std::all_of(steps.begin(), steps.end(), StepOk); }

bool TermsInRange(const peer::Message& m) {
  if (m.term >= peer::kMaxTerm) return false;
  auto copies_ok = [](const std::vector<peer::LiveCopy>& copies) {
    return std::all_of(copies.begin(), copies.end(),
                       [](const peer::LiveCopy& c) { return c.lineage < peer::kMaxTerm && StepOk(c.step); });
  };
  return std::visit(
      [&](const auto& b) {
        using B = std::decay_t<decltype(b)>;
        bool ok = true;
        if constexpr (requires { b.epoch; }) ok = ok && b.epoch < peer::kMaxTerm;
        if constexpr (requires { b.lineage; }) ok = ok && b.lineage < peer::kMaxTerm;
        if constexpr (requires { b.copy; }) ok = ok && b.copy.lineage < peer::kMaxTerm && StepOk(b.copy.step);
        if constexpr (requires { b.step; }) ok = ok && StepOk(b.step);
        if constexpr (std::is_same_v<B, peer::Control>) ok = ok && StepOk(b.snapshot_step) && StepOk(b.force_step);
        if constexpr (std::is_same_v<B, peer::Heartbeat>) {
          ok = ok && copies_ok(b.own_copies) && copies_ok(b.held_copies) && copies_ok(b.kept_copies) &&
               b.released.lineage < peer::kMaxTerm && StepOk(b.released.step) && b.newest_seal.epoch < peer::kMaxTerm &&
               StepOk(b.newest_seal.step) && StepsOk(b.sealed_steps) && StepsOk(b.unusable_steps) &&
               std::all_of(b.unsealed_parts.begin(), b.unsealed_parts.end(),
                           [](const auto& p) { return StepOk(p.first); }) &&
               std::all_of(b.served_parts.begin(), b.served_parts.end(),
                           [](const peer::PartServed& p) { return p.epoch < peer::kMaxTerm; });
        }
        return ok;
      },
      m.body);
}

Result<peer::Message> DecodePeerMessage(proto::PeerMessage::Reader r, int shards);

}  // namespace

Result<peer::Message> PeerMessageFromWire(proto::PeerMessage::Reader r, int shards) {
  auto m = DecodePeerMessage(r, shards);
  if (m.ok() && !TermsInRange(*m)) {
    return InvalidArgument(
        "a peer message names a term, epoch or lineage of 2^62 or more (no cluster elects that often), or a step "
        "outside -1 .. 2^62");
  }
  return m;
}

namespace {

Result<peer::Message> DecodePeerMessage(proto::PeerMessage::Reader r, int shards) {
  peer::Message m;
  m.from = static_cast<int>(r.getFrom());
  m.term = r.getTerm();
  m.sender = r.getSender();
  m.to = r.getTo();
  switch (r.which()) {
    case proto::PeerMessage::HEARTBEAT: {
      auto hb = r.getHeartbeat();
      // `step` (@3) is not read: no shard of this version acts on it.
      auto own = CopiesFromWire(hb.getOwnCopies());
      if (!own.ok()) return own.status();
      auto held = CopiesFromWire(hb.getHeldCopies());
      if (!held.ok()) return held.status();
      auto address = AddressFromWire(hb.getAddress());
      if (!address.ok()) return address.status();
      auto moved = MovedFromWire(hb.getMoved(), shards);
      if (!moved.ok()) return moved.status();
      auto unsealed = UnsealedFromWire(hb.getUnsealedParts(), shards);
      if (!unsealed.ok()) return unsealed.status();
      if (hb.getKeptCopies().size() > static_cast<unsigned>(shards)) {
        return InvalidArgument("a heartbeat lists kept copies for more shards than the cluster has");
      }
      std::vector<peer::LiveCopy> kept;
      for (auto k : hb.getKeptCopies()) kept.push_back(CopyFromWire(k));
      if (hb.getServedParts().size() > static_cast<unsigned>(shards)) {
        return InvalidArgument("a heartbeat lists served parts for more shards than the cluster has");
      }
      std::vector<peer::PartServed> served;
      for (auto p : hb.getServedParts()) served.push_back({p.getEpoch(), p.getStandIn()});
      if (hb.getSealedSteps().size() > peer::kMaxListedSteps || hb.getUnusableSteps().size() > peer::kMaxListedSteps) {
        return InvalidArgument("a heartbeat lists more than " + std::to_string(peer::kMaxListedSteps) +
                               " sealed or unusable steps");
      }
      if (hb.getSealDigests().size() != 0 && hb.getSealDigests().size() != hb.getSealedSteps().size()) {
        return InvalidArgument("a heartbeat's manifest digests do not match its sealed steps");
      }
      std::vector<uint64_t> digests;
      for (uint64_t d : hb.getSealDigests()) digests.push_back(d);
      auto newest_seal = SealFromWire(hb.getNewestSeal(), shards);
      if (!newest_seal.ok()) return newest_seal.status();
      m.body = peer::Heartbeat{hb.getChief(),
                               hb.getEpoch(),
                               hb.getRunning(),
                               Steps(hb.getSealedSteps()),
                               hb.getReady(),
                               hb.getRequired(),
                               hb.getAllowStateLoss(),
                               hb.getWaiting(),
                               Steps(hb.getUnusableSteps()),
                               std::move(*own),
                               std::move(*held),
                               hb.getListening(),
                               std::move(*address),
                               hb.getStandIn(),
                               std::move(*moved),
                               CopyFromWire(hb.getReleased()),
                               std::move(*unsealed),
                               std::move(kept),
                               std::move(served),
                               std::move(digests),
                               std::move(*newest_seal)};
      return m;
    }
    case proto::PeerMessage::PREPARED: {
      auto p = r.getPrepared();
      m.body = peer::Prepared{p.getEpoch(),        p.getStep(),  p.getMinGradients(),
                              p.getMaxGradients(), p.getTakes(), p.getForced()};
      return m;
    }
    case proto::PeerMessage::COMMIT: {
      auto c = r.getCommit();
      m.body = peer::Commit{c.getEpoch(), c.getStep(), c.getCheckpoint(), c.getLearningRate()};
      return m;
    }
    case proto::PeerMessage::COMMITTED: {
      auto c = r.getCommitted();
      m.body = peer::Committed{c.getEpoch(), c.getStep()};
      return m;
    }
    case proto::PeerMessage::RESTORE: {
      auto c = r.getRestore();
      peer::Restore restore{c.getEpoch(), c.getStep(), {}, c.getLive(), c.getLineage(), c.getNewest(), {}};
      if (c.getSeal().size() > static_cast<unsigned>(shards)) return InvalidArgument("a seal names too many parts");
      for (auto p : c.getSeal()) {
        auto part = PartFromWire(p, shards);
        if (!part.ok()) return part.status();
        restore.seal.push_back(std::move(*part));
      }
      auto moved = MovedFromWire(c.getMoved(), shards);
      if (!moved.ok()) return moved.status();
      restore.moved = std::move(*moved);
      m.body = std::move(restore);
      return m;
    }
    case proto::PeerMessage::RESTORED: {
      auto c = r.getRestored();
      peer::Restored restored{c.getEpoch(), c.getStep(), c.getOk(), c.getMessage(), {}};
      for (auto p : c.getPlacements()) {
        auto placed = PlacementFromWire(p, shards);
        if (!placed.ok()) return placed.status();
        restored.placements.push_back(std::move(*placed));
      }
      m.body = std::move(restored);
      return m;
    }
    case proto::PeerMessage::PART_WRITTEN: {
      auto p = r.getPartWritten();
      auto part = PartFromWire(p, shards);
      if (!part.ok()) return part.status();
      m.body = peer::PartWritten{p.getEpoch(), p.getStep(), std::move(*part)};
      return m;
    }
    case proto::PeerMessage::SEAL: {
      auto seal = SealFromWire(r.getSeal(), shards);
      if (!seal.ok()) return seal.status();
      m.body = std::move(*seal);
      return m;
    }
    case proto::PeerMessage::CONTROL: {
      auto c = r.getControl();
      m.body = peer::Control{c.getEpoch(), c.getJobDone(), c.getSnapshotStep(), c.getForceStep()};
      return m;
    }
    case proto::PeerMessage::CHECKPOINT_REQUEST:
      m.body = peer::CheckpointRequest{};
      return m;
    case proto::PeerMessage::REPLICA_CHUNK: {
      auto c = r.getReplicaChunk();
      if (c.getOwner() >= static_cast<uint32_t>(shards))
        return InvalidArgument("a replica chunk names an unknown shard");
      auto data = c.getData();
      if (c.getOffset() > c.getTotal() || data.size() > c.getTotal() - c.getOffset()) {
        return InvalidArgument("a replica chunk lies outside its copy");
      }
      m.body = peer::ReplicaChunk{c.getEpoch(),
                                  static_cast<int>(c.getOwner()),
                                  CopyFromWire(c.getCopy()),
                                  c.getRestore(),
                                  c.getOffset(),
                                  c.getTotal(),
                                  peer::Blob::Borrow(reinterpret_cast<const char*>(data.begin()), data.size()),
                                  c.getHandBack()};
      return m;
    }
    case proto::PeerMessage::REPLICA_ACK: {
      auto a = r.getReplicaAck();
      m.body = peer::ReplicaAck{a.getEpoch(), CopyFromWire(a.getCopy()), a.getSendWhole(), a.getHandBack()};
      return m;
    }
    case proto::PeerMessage::REPLICA_FETCH: {
      auto a = r.getReplicaFetch();
      m.body = peer::ReplicaFetch{a.getEpoch(), CopyFromWire(a.getCopy()), a.getNewest()};
      return m;
    }
  }
  return InvalidArgument("a peer message of an unknown kind (a newer psd?)");
}

}  // namespace

void PeerMessageToWire(proto::PeerMessage::Builder b, const peer::Message& m) {
  b.setFrom(static_cast<uint32_t>(m.from));
  b.setTerm(m.term);
  b.setSender(m.sender);
  b.setTo(m.to);
  std::visit(
      [&](const auto& body) {
        using T = std::decay_t<decltype(body)>;
        if constexpr (std::is_same_v<T, peer::Heartbeat>) {
          auto hb = b.initHeartbeat();
          hb.setChief(body.chief);
          hb.setEpoch(body.epoch);
          hb.setRunning(body.running);
          SetSteps(hb.initSealedSteps(static_cast<unsigned>(body.sealed_steps.size())), body.sealed_steps);
          hb.setReady(body.ready);
          hb.setRequired(body.required);
          hb.setAllowStateLoss(body.allow_state_loss);
          hb.setWaiting(body.waiting);
          SetSteps(hb.initUnusableSteps(static_cast<unsigned>(body.unusable_steps.size())), body.unusable_steps);
          CopiesToWire(hb.initOwnCopies(static_cast<unsigned>(body.own_copies.size())), body.own_copies);
          CopiesToWire(hb.initHeldCopies(static_cast<unsigned>(body.held_copies.size())), body.held_copies);
          hb.setListening(body.listening);
          hb.setAddress(body.address);
          hb.setStandIn(body.stand_in);
          if (!body.newest_seal.parts.empty()) SealToWire(hb.initNewestSeal(), body.newest_seal);
          MovedToWire(hb.initMoved(static_cast<unsigned>(body.moved.size())), body.moved);
          CopyToWire(hb.initReleased(), body.released);
          auto unsealed = hb.initUnsealedParts(static_cast<unsigned>(body.unsealed_parts.size()));
          unsigned i = 0;
          for (const auto& [step, part] : body.unsealed_parts) PartToWire(unsealed[i++], 0, step, part);
          CopiesToWire(hb.initKeptCopies(static_cast<unsigned>(body.kept_copies.size())), body.kept_copies);
          auto served = hb.initServedParts(static_cast<unsigned>(body.served_parts.size()));
          for (size_t k = 0; k < body.served_parts.size(); ++k) {
            served[static_cast<unsigned>(k)].setEpoch(body.served_parts[k].epoch);
            served[static_cast<unsigned>(k)].setStandIn(body.served_parts[k].stand_in);
          }
          auto digests = hb.initSealDigests(static_cast<unsigned>(body.seal_digests.size()));
          for (size_t k = 0; k < body.seal_digests.size(); ++k)
            digests.set(static_cast<unsigned>(k), body.seal_digests[k]);
        } else if constexpr (std::is_same_v<T, peer::Prepared>) {
          auto p = b.initPrepared();
          p.setEpoch(body.epoch);
          p.setStep(body.step);
          p.setMinGradients(body.min_gradients);
          p.setMaxGradients(body.max_gradients);
          p.setTakes(body.takes);
          p.setForced(body.forced);
        } else if constexpr (std::is_same_v<T, peer::Commit>) {
          auto c = b.initCommit();
          c.setEpoch(body.epoch);
          c.setStep(body.step);
          c.setCheckpoint(body.checkpoint);
          c.setLearningRate(body.learning_rate);
        } else if constexpr (std::is_same_v<T, peer::Committed>) {
          auto c = b.initCommitted();
          c.setEpoch(body.epoch);
          c.setStep(body.step);
        } else if constexpr (std::is_same_v<T, peer::Restore>) {
          auto r = b.initRestore();
          r.setEpoch(body.epoch);
          r.setStep(body.step);
          auto list = r.initSeal(static_cast<unsigned>(body.seal.size()));
          for (size_t i = 0; i < body.seal.size(); ++i) {
            PartToWire(list[static_cast<unsigned>(i)], body.epoch, body.step, body.seal[i]);
          }
          r.setLive(body.live);
          r.setLineage(body.lineage);
          r.setNewest(body.newest);
          MovedToWire(r.initMoved(static_cast<unsigned>(body.moved.size())), body.moved);
        } else if constexpr (std::is_same_v<T, peer::Restored>) {
          auto r = b.initRestored();
          r.setEpoch(body.epoch);
          r.setStep(body.step);
          r.setOk(body.ok);
          r.setMessage(body.message);
          auto list = r.initPlacements(static_cast<unsigned>(body.placements.size()));
          for (size_t i = 0; i < body.placements.size(); ++i) {
            PlacementToWire(list[static_cast<unsigned>(i)], body.placements[i]);
          }
        } else if constexpr (std::is_same_v<T, peer::PartWritten>) {
          PartToWire(b.initPartWritten(), body.epoch, body.step, body.part);
        } else if constexpr (std::is_same_v<T, peer::Seal>) {
          SealToWire(b.initSeal(), body);
        } else if constexpr (std::is_same_v<T, peer::Control>) {
          auto c = b.initControl();
          c.setEpoch(body.epoch);
          c.setJobDone(body.job_done);
          c.setSnapshotStep(body.snapshot_step);
          c.setForceStep(body.force_step);  // never the default 0 by accident: "force step 0"
        } else if constexpr (std::is_same_v<T, peer::CheckpointRequest>) {
          b.setCheckpointRequest();
        } else if constexpr (std::is_same_v<T, peer::ReplicaChunk>) {
          auto c = b.initReplicaChunk();
          c.setEpoch(body.epoch);
          c.setOwner(static_cast<uint32_t>(body.owner));
          CopyToWire(c.initCopy(), body.copy);
          c.setRestore(body.restore);
          c.setOffset(body.offset);
          c.setTotal(body.total);
          c.setHandBack(body.hand_back);
          const auto* data = reinterpret_cast<const kj::byte*>(body.data.data());
          const size_t size = body.data.size();
          if (body.data.keep() && size >= wire::kZeroCopyMinBytes && size % sizeof(capnp::word) == 0 &&
              reinterpret_cast<uintptr_t>(data) % sizeof(capnp::word) == 0) {
            c.adoptData(capnp::Orphanage::getForMessageContaining(c).referenceExternalData(
                capnp::Data::Reader(data, size)));  // a segment of its own: written from the blob
          } else {
            c.setData(kj::arrayPtr(data, size));
          }
        } else if constexpr (std::is_same_v<T, peer::ReplicaAck>) {
          auto a = b.initReplicaAck();
          a.setEpoch(body.epoch);
          CopyToWire(a.initCopy(), body.copy);
          a.setSendWhole(body.send_whole);
          a.setHandBack(body.hand_back);
        } else {
          static_assert(std::is_same_v<T, peer::ReplicaFetch>);
          auto a = b.initReplicaFetch();
          a.setEpoch(body.epoch);
          CopyToWire(a.initCopy(), body.copy);
          a.setNewest(body.newest);
        }
      },
      m.body);
}

}  // namespace psd::server
