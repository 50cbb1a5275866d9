// WorkerSession's pulls (worker_session.h): values (Pull, and with a push: AddValues), a slot,
// selected rows; into the reply, into the worker's shared memory, or named in psd's values segment
// (and the buffers such replies name, held until the worker read them).
#include <spdlog/spdlog.h>

#include "service/service_host.h"
#include "service/values_segment.h"
#include "service/worker_session.h"

namespace psd::server {

Status WorkerSession::AddValues(wire::OutFrame& frame, proto::PullReply::Builder p,
                                const std::vector<std::string>& names, bool averages,
                                const std::vector<std::optional<DType>>& want, const std::vector<ElementRange>& ranges,
                                std::optional<ShmTarget> to_shm) {
  std::vector<PulledValue> values;
  int64_t step = 0;
  auto engine = host_.engine();
  PSD_RETURN_IF_ERROR(engine->Pull(names, &values, &step, averages));
  for (size_t i = 0; i < values.size() && i < want.size(); ++i) {
    if (want[i]) PSD_RETURN_IF_ERROR(CheckWanted(names[i], values[i].declared, *want[i]));
  }
  for (size_t i = 0; i < values.size() && i < ranges.size(); ++i) {
    // A value read in ranges is checked against the caller's whole view here: each range is flat.
    const Shape& whole = ranges[i].whole_shape;
    if (!whole.empty() && whole != values[i].shape) {
      const std::string dtype = DTypeName(i < want.size() && want[i] ? *want[i] : values[i].declared);
      return InvalidArgument("'" + names[i] + "' is " + dtype + " " + ShapeString(values[i].shape) +
                             " but the destination view is " + dtype + " " + ShapeString(whole));
    }
    PSD_RETURN_IF_ERROR(CheckRange(ranges[i], NumElements(values[i].shape), "'" + names[i] + "'"));
  }
  p.setStep(step);
  p.setClusterEpoch(engine->epoch());
  auto list = p.initValues(static_cast<unsigned>(values.size()));
  // Values written into the worker's own segment may land where its held gradients are (the client
  // reuses the push's room for the values it pulls with the token): the callers call this once
  // whatever the engine still points at there is copied (WhenSettled).
  if (to_shm && to_shm->segment == 0 && !SettleHeld()) {
    return Internal("values into the worker's segment before psd copied what it reads there");
  }
  if (to_shm) {
    ShmSlot::Lease lease = shm_ ? shm_->Acquire() : ShmSlot::Lease();
    wire::SharedSegment* segment = lease.segment(to_shm->segment);
    if (segment == nullptr) return NoSegment(to_shm->segment);
    const bool placed = !to_shm->offsets.empty();
    if (placed && to_shm->offsets.size() != values.size()) {
      return InvalidArgument("the request gives " + std::to_string(to_shm->offsets.size()) +
                             " shared-memory offsets for " + std::to_string(values.size()) + " values");
    }
    if (!placed && segment->At(to_shm->offset, to_shm->bytes) == nullptr) {
      return InvalidArgument("the shared-memory room of the request is outside this connection's segment");
    }
    // The values segment: a value psd keeps there, asked in its own dtype, is named where it lies.
    const ValuesSegment* in_place = to_shm->values && !placed ? ValuesSegment::Current() : nullptr;
    const uint64_t reply_id = frame.builder.getRoot<proto::Response>().getId();
    uint64_t cursor = to_shm->offset, written = 0, named = 0;
    bool new_reply = true;  // this reply's first named value starts its entry in held_values_
    for (size_t i = 0; i < values.size(); ++i) {
      const PulledValue& v = values[i];
      const DType want_i = i < want.size() && want[i] ? *want[i] : v.declared;
      const int64_t kept =
          in_place != nullptr && want_i == v.dtype ? in_place->OffsetOf(v.value->data(), v.value->bytes()) : -1;
      if (kept >= 0) {
        const ElementRange* range = i < ranges.size() ? &ranges[i] : nullptr;
        const uint64_t es = DTypeSize(v.dtype);
        const Shape shape = range != nullptr ? Shape{range->count} : v.shape;
        wire::NameInShm(
            list[static_cast<unsigned>(i)], v.dtype, shape, wire::kValuesSegment,
            static_cast<uint64_t>(kept) + (range != nullptr ? static_cast<uint64_t>(range->offset) * es : 0));
        named += static_cast<uint64_t>(NumElements(shape)) * es;
        HoldValue(reply_id, v.value, new_reply, engine->value_bytes());
        new_reply = false;
        continue;
      }
      const uint64_t at = placed ? to_shm->offsets[i] : wire::ShmAlign(cursor);
      auto n = SetValueInShm(list[static_cast<unsigned>(i)], *v.value, v.dtype, v.shape, want_i,
                             i < ranges.size() ? &ranges[i] : nullptr, *segment, to_shm->segment, at,
                             placed ? segment->size() : to_shm->offset + to_shm->bytes, &engine->helpers());
      if (!n.ok()) return n.status();
      cursor = at + *n;
      written += *n;
    }
    host_.metrics().OnShmBytes(written);
    if (named > 0) host_.metrics().OnValuesInPlaceBytes(named);
    return Status::Ok();
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const PulledValue& v = values[i];
    // Zero-copy where no conversion is asked for: the reply references the immutable published buffer.
    SetValue(frame, list[static_cast<unsigned>(i)], v.value, v.dtype, v.shape,
             i < want.size() && want[i] ? *want[i] : v.declared, &host_.converted_values(), v.variable,
             i < ranges.size() ? &ranges[i] : nullptr);
  }
  return Status::Ok();
}

Status WorkerSession::NoSegment(unsigned segment) {
  return FailedPrecondition(segment == 0 ? "values asked into shared memory, but this connection has no segment"
                                         : "values asked into shared buffers, but this connection has none attached");
}

std::optional<ShmTarget> WorkerSession::TargetOf(bool has, proto::ShmTarget::Reader r) {
  if (!has) return std::nullopt;
  ShmTarget target{r.getOffset(), r.getBytes(), r.getSegment(), {}, r.getValues()};
  for (uint64_t at : r.getOffsets()) target.offsets.push_back(at);
  return target;
}

void WorkerSession::DropOldestHeldLocked(std::vector<std::vector<std::shared_ptr<const Buffer>>>* out) {
  for (const auto& b : held_values_.front().second) {
    auto it = held_refs_.find(b.get());
    if (it != held_refs_.end() && --it->second == 0) {
      held_bytes_ -= b->bytes();
      held_refs_.erase(it);
    }
  }
  out->push_back(std::move(held_values_.front().second));
  held_values_.pop_front();
}

void WorkerSession::HoldValue(uint64_t id, std::shared_ptr<const Buffer> value, bool new_reply, uint64_t value_bytes) {
  std::vector<std::vector<std::shared_ptr<const Buffer>>> dropped;  // let go outside the lock
  MutexLock lock(&held_mu_);
  // A new entry per reply, not per request id: a worker that gave every request the same id would
  // otherwise pile its holds into one entry that never aged out.
  if (held_values_.empty() || new_reply) {
    held_values_.emplace_back(id, std::vector<std::shared_ptr<const Buffer>>{});
    if (held_values_.size() > kMaxHeldReplies) DropOldestHeldLocked(&dropped);
  }
  if (held_refs_[value.get()]++ == 0) held_bytes_ += value->bytes();
  held_values_.back().second.push_back(std::move(value));
  // More versions than a worker's threads read at once: the oldest replies' buffers go (not this one's).
  const uint64_t cap = kHeldModels * std::max<uint64_t>(value_bytes, held_values_.back().second.back()->bytes());
  while (held_bytes_ > cap && held_values_.size() > 1) DropOldestHeldLocked(&dropped);
}

void WorkerSession::ValuesRead(uint64_t id) {
  std::vector<std::vector<std::shared_ptr<const Buffer>>> dropped;  // let go outside the lock
  MutexLock lock(&held_mu_);
  while (!held_values_.empty() && held_values_.front().first <= id) DropOldestHeldLocked(&dropped);
}

void WorkerSession::HandlePull(uint64_t id, proto::Pull::Reader r) {
  std::vector<std::string> names;
  for (auto n : r.getNames()) names.emplace_back(n);
  auto want = WantedDTypes(r.getDtypes(), names.size());
  if (!want.ok()) return SendError(id, want.status());
  std::vector<ElementRange> ranges;
  if (r.getRanges().size() > 0) {
    if (r.getRanges().size() != names.size()) {
      return SendError(id, InvalidArgument("the pull names " + std::to_string(names.size()) + " variables but " +
                                           std::to_string(r.getRanges().size()) + " element ranges"));
    }
    for (auto e : r.getRanges()) {
      ranges.push_back({e.getOffset(), e.getCount()});
      for (int64_t d : e.getWholeShape()) ranges.back().whole_shape.push_back(d);
    }
  }
  std::optional<ShmTarget> target = TargetOf(r.hasToShm(), r.getToShm());
  const bool into_segment = target && target->segment == 0;
  auto answer = [this, id, names = std::move(names), want = std::move(*want), ranges = std::move(ranges),
                 averages = r.getAverages(), to_shm = std::move(target)] {
    proto::Response::Builder resp(nullptr);
    auto frame = NewReply(id, &resp);
    Status s = AddValues(*frame, resp.initPull(), names, averages, want, ranges, to_shm);
    if (!s.ok()) return SendError(id, s);
    Send(std::move(frame));
  };
  // Values written into the worker's own segment may land where its held gradients are: they
  // are written once whatever psd still reads there is copied (WhenSettled).
  if (into_segment) return WhenSettled(std::move(answer));
  answer();
}

void WorkerSession::HandleGetSlot(uint64_t id, proto::GetSlot::Reader r) {
  // A range is copied alone (the engine checks it is inside the slot): the reply is a flat [count].
  auto slot = r.getHasRange() ? host_.engine()->GetSlot(r.getVariable(), r.getSlot(), r.getRange().getOffset(),
                                                        std::max<int64_t>(0, r.getRange().getCount()))
                              : host_.engine()->GetSlot(r.getVariable(), r.getSlot());
  if (!slot.ok()) return SendError(id, slot.status());
  auto want = WantedDType(r.getHasDtype(), r.getDtype(), r.getVariable(), slot->declared);
  if (!want.ok()) return SendError(id, want.status());
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  SetValue(*frame, resp.initSlot(), slot->value, slot->dtype, slot->shape, *want, nullptr, "", nullptr);
  Send(std::move(frame));
}

void WorkerSession::HandlePullRows(uint64_t id, proto::PullRows::Reader r) {
  std::vector<int64_t> rows;
  auto in = r.getRows();
  rows.reserve(in.size());
  for (int64_t x : in) rows.push_back(x);
  const std::string name = r.getName();
  // Into the worker's shared memory when asked (the reply says where), else in the reply.
  std::optional<ShmTarget> target = TargetOf(r.hasToShm(), r.getToShm());
  const bool has_dtype = r.getHasDtype();
  const proto::DType dtype = r.getDtype();
  // As a pull into the worker's own segment (HandlePull), after what psd reads there is copied.
  if (target && target->segment == 0) {
    return WhenSettled([this, id, rows = std::move(rows), name, target, has_dtype, dtype] {
      AnswerPullRows(id, rows, name, target, has_dtype, dtype);
    });
  }
  AnswerPullRows(id, rows, name, target, has_dtype, dtype);
}

void WorkerSession::AnswerPullRows(uint64_t id, const std::vector<int64_t>& rows, const std::string& name,
                                   const std::optional<ShmTarget>& target, bool has_dtype, proto::DType dtype) {
  ShmSlot::Lease lease = target && shm_ ? shm_->Acquire() : ShmSlot::Lease();
  wire::SharedSegment* segment = target ? lease.segment(target->segment) : nullptr;
  if (target && segment == nullptr) return SendError(id, NoSegment(target->segment));
  RowsOut sink(has_dtype, dtype, name, host_.config().max_frame_bytes, target ? &*target : nullptr, segment);
  auto engine = host_.engine();
  auto step = engine->ReadRows(name, rows, sink);
  if (!step.ok()) return SendError(id, step.status());
  proto::Response::Builder resp(nullptr);
  auto frame = NewReply(id, &resp);
  auto p = resp.initPull();
  p.setStep(*step);
  // A cluster's epoch, as a pull says it: a worker that only looks up rows learns of a re-formation
  // here (its pushes carry the epoch and are refused until it does).
  p.setClusterEpoch(engine->epoch());
  sink.Set(*frame, p.initValues(1)[0]);
  if (sink.shm_bytes() > 0) host_.metrics().OnShmBytes(sink.shm_bytes());
  Send(std::move(frame));
}

}  // namespace psd::server
