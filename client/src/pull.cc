// Pulls: planning them (one request per shard, ranges for values bigger than a reply, shared
// memory and shared buffers where the connection has them, device views through host twins),
// reading the replies into the caller's views, PullRows and GetSlot.
#include <kj/exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "client_impl.h"
#include "frame_plan.h"
#include "psd/half.h"
#include "wire/shm.h"

namespace psclient {

using internal::CheckView;
using internal::SetWantedDTypes;
using internal::SliceOf;

void Client::Impl::LetGoOfValues(proto::PullReply::Reader p, Conn* from) {
  try {
    for (auto v : p.getValues()) {
      if (v.getInShm() && v.getShmSegment() == psd::wire::kValuesSegment) return from->ValuesRead();
    }
  } catch (const kj::Exception&) {
    // Malformed: the caller says so; nothing named can be told apart.
  }
}

Result<int64_t> Client::Impl::ReadValues(proto::PullReply::Reader p,
                                         const std::vector<std::pair<std::string, TensorView>>& outs, Conn* from) {
  // However the reading ends, psd may let go of what the reply named in its values segment.
  struct LetGo {
    Impl* im;
    proto::PullReply::Reader p;
    Conn* from;
    ~LetGo() { im->LetGoOfValues(p, from); }
  } let_go{this, p, from};
  try {
    auto values = p.getValues();
    if (values.size() != outs.size()) return psd::Internal("pull reply has the wrong number of values");
    for (size_t i = 0; i < outs.size(); ++i) {
      auto t = from->ReplyTensor(values[static_cast<unsigned>(i)]);
      if (!t.ok()) return t.status();
      const TensorView& out = outs[i].second;
      PSD_RETURN_IF_ERROR(CheckView("'" + outs[i].first + "'", t->dtype, t->shape, out));
      if (t->bytes != out.bytes()) return psd::Internal("pull reply for '" + outs[i].first + "' has a wrong size");
      if (out.memory == MemoryKind::kHost) {
        // Landed: the bytes were read straight into the view. Else copied: out of shared memory
        // with the copy helpers, out of a reply with memmove (a reply that did not land as planned
        // may still have been read over the view).
        if (t->data == out.data) continue;
        if (values[static_cast<unsigned>(i)].getInShm()) {
          copy_pool_.ParallelCopy(out.data, t->data, t->bytes);
        } else {
          std::memmove(out.data, t->data, t->bytes);
        }
        continue;
      }
      PSD_RETURN_IF_ERROR(staging_.FromHost(out.data, t->data, t->bytes, out.memory, out.stream));
    }
    return p.getStep();
  } catch (const kj::Exception& e) {
    return Malformed(e);
  }
}

Status Client::Impl::SplitOuts(const Outs& outs, std::vector<Outs>* per_shard) {
  per_shard->assign(conns_.size(), {});
  for (const auto& [name, view] : outs) {
    auto loc = Locate(name);
    if (!loc.ok()) return loc.status();
    if (loc->sliced && (view.shape != loc->shape || !psd::ConvertibleDTypes(view.dtype, loc->dtype))) {
      return CheckView("'" + name + "'", loc->dtype, loc->shape, view);
    }
    for (size_t i = 0; i < loc->parts.size(); ++i) {
      (*per_shard)[static_cast<size_t>(loc->parts[i].shard)].emplace_back(name, SliceOf(view, *loc, i));
    }
  }
  return Status::Ok();
}

std::vector<uint64_t> Client::Impl::BufferOffsets(int k, const Outs& outs) {
  std::vector<uint64_t> at;
  for (const auto& o : outs) {
    const int64_t off =
        o.second.memory == MemoryKind::kHost ? conn(k).BufferOffset(o.second.data, o.second.bytes()) : -1;
    if (off < 0) return {};
    at.push_back(static_cast<uint64_t>(off));
  }
  return at;
}

void Client::Impl::SetBufferTarget(const std::vector<uint64_t>& offsets, proto::ShmTarget::Builder target) {
  target.setSegment(1);
  auto list = target.initOffsets(static_cast<unsigned>(offsets.size()));
  for (size_t i = 0; i < offsets.size(); ++i) list.set(static_cast<unsigned>(i), offsets[i]);
}

uint64_t Client::Impl::ShmTargetBytes(const Outs& outs) {
  uint64_t need = 0;
  for (const auto& o : outs) need += psd::wire::ShmAlign(o.second.bytes());
  return need;
}

void Client::Impl::PlanPull(int k, const Outs& outs, std::vector<PullFrame>* frames) {
  std::vector<uint64_t> bytes, elem;
  for (const auto& o : outs) {
    bytes.push_back(o.second.bytes());
    elem.push_back(psd::DTypeSize(o.second.dtype));
  }
  if (auto at = BufferOffsets(k, outs); !at.empty()) {
    frames->push_back({k, outs, {}, false, true, std::move(at)});
    return;
  }
  // Element ranges of whole parts, at most `limit` bytes a frame (none when one frame takes all).
  auto ranged = [&](uint64_t limit, bool to_shm) {
    std::vector<PullFrame> out;
    if (internal::FitsOneFrame(bytes, {}, {}, limit, conn(k).chunk_elements)) return out;  // no plan to make
    auto plan = internal::PlanFrames(bytes, elem, {}, {}, limit, conn(k).chunk_elements);
    bool whole = plan.size() == 1;
    for (const auto& piece : plan[0].dense) whole = whole && piece.offset == 0 && piece.bytes == bytes[piece.entry];
    if (whole) return out;
    for (const internal::FramePlan& f : plan) {
      PullFrame frame{k, {}, {}, true, to_shm, {}};
      for (const internal::FramePiece& piece : f.dense) {
        const auto& [name, view] = outs[piece.entry];
        const size_t es = elem[piece.entry];
        TensorView part = view;
        part.data = view.data ? static_cast<uint8_t*>(view.data) + piece.offset : nullptr;
        part.shape = {static_cast<int64_t>(piece.bytes / es)};
        frame.outs.emplace_back(name, part);
        frame.offsets.push_back(static_cast<int64_t>(piece.offset / es));
        frame.whole_shapes.push_back(view.shape);
      }
      out.push_back(std::move(frame));
    }
    return out;
  };
  if (conn(k).ShmFits(ShmTargetBytes(outs))) {
    // Values bigger than a piece come in ranges, each written by psd into a room of its own and
    // copied out by the client while psd writes the next (Conn::ShmPieceBytes); with the daemon's
    // values segment mapped psd writes none of them (it names them in place), so one request.
    const uint64_t piece = conn(k).values ? 0 : conn(k).ShmPieceBytes();
    if (piece > 0 && ShmTargetBytes(outs) > piece) {
      auto pieces = ranged(piece, /*to_shm=*/true);
      uint64_t room = 0;
      for (const PullFrame& f : pieces) room += ShmTargetBytes(f.outs);  // each a multiple of 64 bytes
      if (!pieces.empty() && conn(k).ShmFits(room)) {
        for (PullFrame& f : pieces) frames->push_back(std::move(f));
        return;
      }
    }
    frames->push_back({k, outs, {}, false, true, {}});
    return;
  }
  auto pieces = ranged(conn(k).PullFrameLimit(), /*to_shm=*/false);
  if (pieces.empty()) {
    frames->push_back({k, outs, {}, false, false, {}});
    return;
  }
  for (PullFrame& f : pieces) frames->push_back(std::move(f));
}

psd::wire::Landing Client::Impl::LandingFor(const Outs& outs) {
  if (outs.size() != 1) return {};
  const TensorView& only = outs[0].second;
  if (only.memory != MemoryKind::kHost || only.bytes() % 8 != 0) return {};
  return {only.data, only.bytes()};
}

Result<int64_t> Client::Impl::PullLocked(const Outs& outs, bool averages) {
  // Device views: the values land in their host twins (in place, where psd is on this host),
  // then go to the GPU in one DMA each.
  Twins twins(*this);
  Outs host;
  if (!twins.Substitute(outs, &host)) return PullViewsLocked(outs, averages);
  auto step = PullViewsLocked(host, averages);
  if (step.ok()) PSD_RETURN_IF_ERROR(twins.CopyBack());
  return step;
}

Result<int64_t> Client::Impl::PullViewsLocked(const Outs& outs, bool averages) {
  if (outs.empty()) return psd::InvalidArgument("Pull needs at least one variable");
  for (int attempt = 0;; ++attempt) {
    for (auto& c : conns_) c->ShmReset();  // every earlier reply is in
    std::vector<Outs> per_shard;
    PSD_RETURN_IF_ERROR(SplitOuts(outs, &per_shard));
    std::vector<PullFrame> frames;
    for (size_t k = 0; k < per_shard.size(); ++k) {
      if (!per_shard[k].empty()) PlanPull(static_cast<int>(k), per_shard[k], &frames);
    }
    Calls calls;
    for (const PullFrame& f : frames) {
      proto::Request::Builder req(nullptr);
      Call& call = Add(calls, f.shard, &req);
      if (!f.to_shm && f.in_buffers.empty()) {
        for (const auto& out : f.outs) call.reply_bytes += out.second.bytes() + Conn::kReplyValueOverhead;
      }
      auto pull = req.initPull();
      pull.setAverages(averages);
      auto names = pull.initNames(static_cast<unsigned>(f.outs.size()));
      for (size_t i = 0; i < f.outs.size(); ++i) names.set(static_cast<unsigned>(i), f.outs[i].first);
      SetWantedDTypes(f.outs, pull.initDtypes(static_cast<unsigned>(f.outs.size())));
      if (!f.in_buffers.empty()) {
        SetBufferTarget(f.in_buffers, pull.initToShm());
      } else if (f.to_shm && !SetShmTarget(f.shard, f.outs, pull.initToShm())) {
        return psd::Internal("the shared-memory room planned for a pull is gone");  // PlanPull checked it
      }
      if (!f.ranged) continue;
      if (!f.to_shm) call.landing = LandingFor(f.outs);
      auto ranges = pull.initRanges(static_cast<unsigned>(f.outs.size()));
      for (size_t i = 0; i < f.outs.size(); ++i) {
        ranges[static_cast<unsigned>(i)].setOffset(f.offsets[i]);
        const Shape& whole = f.whole_shapes[i];
        auto dims = ranges[static_cast<unsigned>(i)].initWholeShape(static_cast<unsigned>(whole.size()));
        for (size_t d = 0; d < whole.size(); ++d) dims.set(static_cast<unsigned>(d), whole[d]);
        ranges[static_cast<unsigned>(i)].setCount(f.outs[i].second.shape[0]);
      }
    }
    // Each reply is read into the caller's views as it arrives (its reader lasts until the next
    // reply on its connection); replies at different steps are read again. Async/ssp shards
    // count their own steps: the pull is at the lowest.
    const bool any_step = AppliesOnArrival();
    int64_t step = -1;
    uint64_t epoch = 0;
    bool agree = true;
    bool first = true;  // replies come in each shard's order, not the calls' (Run)
    Status read;
    Status s = Run(calls, [&](size_t i) {
      if (!calls[i]->status.ok()) return;
      try {
        auto p = calls[i]->resp.getPull();
        if (!read.ok() || !agree) return LetGoOfValues(p, &conn(frames[i].shard));  // not read: read again
        if (first) {
          first = false;
          step = p.getStep();
          epoch = p.getClusterEpoch();
        } else if (p.getClusterEpoch() != epoch || (p.getStep() != step && !any_step)) {
          agree = false;
          return LetGoOfValues(p, &conn(frames[i].shard));
        }
        step = std::min(step, p.getStep());
        read = ReadValues(p, frames[i].outs, &conn(frames[i].shard)).status();
      } catch (const kj::Exception& e) {
        read = Malformed(e);
      }
    });
    if (s.code() == Code::kAborted) placements_.clear();
    PSD_RETURN_IF_ERROR(s);
    PSD_RETURN_IF_ERROR(read);
    if (!agree) {
      // A commit came between the replies (a cluster's is on its way to every shard): read again.
      if (attempt >= 200) return psd::Unavailable("the shards keep answering at different global steps; retry");
      std::this_thread::sleep_for(std::chrono::milliseconds(attempt < 20 ? 1 : 10));
      continue;
    }
    if (cluster()) NoteEpoch(epoch);
    return step;
  }
}

Result<int64_t> Client::Pull(const std::string& name, TensorView out) { return Pull({{name, out}}); }

Result<int64_t> Client::Pull(const std::vector<std::pair<std::string, TensorView>>& outs) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  return impl_->PullLocked(outs, /*averages=*/false);
}

Result<int64_t> Client::PullAverages(const std::vector<std::pair<std::string, TensorView>>& outs) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  return impl_->PullLocked(outs, /*averages=*/true);
}

Result<int64_t> Client::PullRows(const std::string& name, const std::vector<int64_t>& rows, TensorView out) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  Impl& im = *impl_;
  auto loc = im.Locate(name);
  if (!loc.ok()) return loc.status();
  // The reply's size, in the dtype asked (the variable's own when that one cannot be delivered:
  // the daemon or CheckView says why).
  // A single daemon's client knows no shapes: its rows are as big as the caller's view says (the
  // replies are checked against it).
  const DType dtype = psd::ConvertibleDTypes(out.dtype, loc->dtype) ? out.dtype : loc->dtype;
  size_t row_bytes = 0;
  if (loc->sliced && !loc->shape.empty() && loc->shape[0] > 0) {
    row_bytes =
        static_cast<size_t>(psd::NumElements(loc->shape)) * psd::DTypeSize(dtype) / static_cast<size_t>(loc->shape[0]);
  } else if (!loc->sliced && !rows.empty() && !out.shape.empty() && out.shape[0] == static_cast<int64_t>(rows.size())) {
    row_bytes = out.bytes() / rows.size();
  }
  auto fill = [&](proto::PullRows::Builder p) {
    p.setName(name);
    p.setHasDtype(true);
    p.setDtype(psd::wire::ToWire(out.dtype));
  };
  if (!loc->sliced && row_bytes == 0) {
    // No rows, or a view that is not [rows asked, ...]: one request, whose reply says how the view
    // should be (through the segment's room when it fits, else in the reply).
    const int shard = loc->parts[0].shard;
    Conn& conn = im.conn(shard);
    conn.ShmReset();  // every earlier reply is in
    OutFrame frame;
    auto p = conn.NewRequest(frame).initPullRows();
    fill(p);
    auto list = p.initRows(static_cast<unsigned>(rows.size()));
    for (size_t i = 0; i < rows.size(); ++i) list.set(static_cast<unsigned>(i), rows[i]);
    if (const uint64_t room = conn.ShmRoom(); room > 0) {
      auto target = p.initToShm();
      target.setOffset(static_cast<uint64_t>(conn.ShmReserve(room)));
      target.setBytes(room);
    }
    proto::Response::Reader resp;
    PSD_RETURN_IF_ERROR(im.Single(shard, frame, &resp));
    try {
      auto step = im.ReadValues(resp.getPull(), {{name, out}}, &conn);
      if (step.ok() && im.cluster() && resp.getPull().getClusterEpoch() != 0) {
        im.NoteEpoch(resp.getPull().getClusterEpoch());
      }
      return step;
    } catch (const kj::Exception& e) {
      return Malformed(e);
    }
  }
  // Each part's rows, in requests of whole rows: the caller's positions each fills.
  std::vector<std::vector<size_t>> positions(loc->parts.size());
  if (!loc->sliced) {  // the daemon checks the rows
    for (size_t i = 0; i < rows.size(); ++i) positions[0].push_back(i);
  } else {
    Shape want = loc->shape;
    want[0] = static_cast<int64_t>(rows.size());
    PSD_RETURN_IF_ERROR(CheckView("rows of '" + name + "'", dtype, want, out));
  }
  for (size_t i = 0; loc->sliced && i < rows.size(); ++i) {  // sliced: each row to its part
    if (rows[i] < 0 || rows[i] >= loc->shape[0]) {
      return psd::InvalidArgument("row " + std::to_string(rows[i]) + " (slice " + std::to_string(i) +
                                  ") is outside [0, " + std::to_string(loc->shape[0]) + ")");
    }
    for (size_t k = 0; k < loc->parts.size(); ++k) {
      if (rows[i] >= loc->parts[k].row_begin && rows[i] < loc->parts[k].row_end) positions[k].push_back(i);
    }
  }
  // How a request's rows come back: in place into the caller's view when it lies in the shared
  // buffers; through the connection's segment when it has room for at least a reply's worth; else
  // in replies of whole rows within pull_frame_bytes.
  enum class Via { kReply, kSegment, kBuffers };
  struct Batch {
    Via via;
    std::vector<size_t> positions;
  };
  const bool host_view = out.memory == MemoryKind::kHost && out.data != nullptr;
  const bool any_step = im.AppliesOnArrival();  // each shard at its own count: the lowest
  for (int attempt = 0;; ++attempt) {
    for (auto& c : im.conns_) c->ShmReset();  // every earlier reply is in
    Impl::Calls calls;
    std::vector<Batch> batch;  // per call
    for (size_t k = 0; k < loc->parts.size(); ++k) {
      const int shard = loc->parts[k].shard;
      Conn& conn = im.conn(shard);
      // Rows of no bytes (a sliced [N, 0] variable) move nothing: they come in plain replies of
      // at most a request's rows (and nothing below divides by their size).
      const int64_t base = host_view && row_bytes > 0 ? conn.BufferOffset(out.data, out.bytes()) : -1;
      const uint64_t limit = conn.PullFrameLimit();
      const size_t per_request = conn.RowsPerRequest();
      size_t per_reply = per_request;  // a request's rows are bounded by psd's frame (8 bytes each) too
      if (row_bytes > 0 && limit > 0) {
        per_reply =
            std::min(per_request, std::max<size_t>(1, (limit - std::min(limit, Conn::kFrameSlack)) / row_bytes));
      }
      const std::vector<size_t>& pos = positions[k];
      for (size_t first = 0; first < pos.size();) {
        const size_t left = pos.size() - first;
        Batch b{Via::kReply, {}};
        size_t n = std::min(left, per_reply);
        if (base >= 0) {
          b.via = Via::kBuffers;
          n = std::min(left, per_request);
        } else if (const size_t fit = row_bytes == 0 ? 0 : std::min<uint64_t>(per_request, conn.ShmRoom() / row_bytes);
                   fit >= std::min(left, per_reply)) {
          b.via = Via::kSegment;
          n = std::min(left, fit);
        }
        b.positions.assign(pos.begin() + static_cast<std::ptrdiff_t>(first),
                           pos.begin() + static_cast<std::ptrdiff_t>(first + n));
        first += n;
        proto::Request::Builder req(nullptr);
        Impl::Call& call = im.Add(calls, shard, &req);
        if (b.via == Via::kReply) call.reply_bytes = n * row_bytes;
        auto p = req.initPullRows();
        fill(p);
        auto list = p.initRows(static_cast<unsigned>(n));
        for (size_t j = 0; j < n; ++j)
          list.set(static_cast<unsigned>(j), rows[b.positions[j]] - loc->parts[k].row_begin);
        if (b.via == Via::kBuffers) {  // consecutive positions: from one offset; else one per row
          auto target = p.initToShm();
          target.setSegment(1);
          const bool consecutive = b.positions.back() - b.positions.front() + 1 == n;
          auto at = target.initOffsets(consecutive ? 1u : static_cast<unsigned>(n));
          for (unsigned j = 0; j < at.size(); ++j) {
            at.set(j, static_cast<uint64_t>(base) + b.positions[j] * row_bytes);
          }
          if (consecutive) target.setBytes(n * row_bytes);
        } else if (b.via == Via::kSegment) {
          auto target = p.initToShm();
          target.setOffset(static_cast<uint64_t>(conn.ShmReserve(n * row_bytes)));
          target.setBytes(n * row_bytes);
        }
        batch.push_back(std::move(b));
      }
    }
    // Each reply is scattered as it arrives (a reader lasts until the next reply on its
    // connection); replies at different steps (a commit came between them) are read again.
    int64_t step = -1;
    uint64_t epoch = 0;
    bool agree = true;
    Status read;
    Status run = im.Run(calls, [&](size_t c) {
      if (!calls[c]->status.ok() || !read.ok() || !agree) return;
      try {
        auto p = calls[c]->resp.getPull();
        if (step >= 0 && ((p.getStep() != step && !any_step) || p.getClusterEpoch() != epoch)) {
          agree = false;
          return;
        }
        step = step >= 0 ? std::min(step, p.getStep()) : p.getStep();
        epoch = p.getClusterEpoch();
        if (p.getValues().size() != 1) {
          read = psd::Internal("a rows reply carries " + std::to_string(p.getValues().size()) + " values, not one");
          return;
        }
        auto value = p.getValues()[0];
        auto t = im.conn(calls[c]->shard).ReplyTensor(value);
        if (!t.ok()) {
          read = t.status();
          return;
        }
        const Batch& b = batch[c];
        if (t->bytes != b.positions.size() * row_bytes || t->shape.empty()) {
          // The caller's view does not fit the variable's rows (a single daemon's client
          // learns their shape here): say how.
          Shape whole = t->shape;
          if (!whole.empty()) whole[0] = static_cast<int64_t>(rows.size());
          read = CheckView("rows of '" + name + "'", t->dtype, whole, out);
          if (read.ok()) read = psd::Internal("rows reply has a wrong size");
          return;
        }
        if (b.via == Via::kBuffers && value.getInShm()) return;  // written in place
        read = im.staging_.RowsFromHost(out.data, b.positions, t->data, row_bytes, out.memory, out.stream);
      } catch (const kj::Exception& e) {
        read = Malformed(e);
      }
    });
    PSD_RETURN_IF_ERROR(run);
    PSD_RETURN_IF_ERROR(read);
    if (agree) {
      // A trainer that only looks up rows learns a re-formed cluster's epoch here, as from a pull
      // (its next push says it). 0: a psd that does not say it in rows replies.
      if (im.cluster() && step >= 0 && epoch != 0) im.NoteEpoch(epoch);
      return step;
    }
    if (attempt >= 200) return psd::Unavailable("the shards keep answering at different global steps; retry");
    std::this_thread::sleep_for(std::chrono::milliseconds(attempt < 20 ? 1 : 10));
  }
}

Status Client::GetSlot(const std::string& variable, const std::string& slot, TensorView out) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  Impl& im = *impl_;
  auto loc = im.Locate(variable);
  if (!loc.ok()) return loc.status();
  if (loc->sliced && (out.shape != loc->shape || !psd::ConvertibleDTypes(out.dtype, loc->dtype))) {
    PSD_RETURN_IF_ERROR(CheckView("slot '" + slot + "' of '" + variable + "'", loc->dtype, loc->shape, out));
  }
  // Per part, one request, or element ranges when the part is bigger than a reply (as pulls).
  struct Piece {
    size_t part;
    int64_t offset = 0;  // elements
    int64_t count = -1;  // -1: the whole part
  };
  const std::string what = "slot '" + slot + "' of '" + variable + "'";
  const size_t es = psd::DTypeSize(out.dtype);
  Impl::Calls calls;
  std::vector<Piece> pieces;
  for (size_t k = 0; k < loc->parts.size(); ++k) {
    TensorView part = SliceOf(out, *loc, k);
    const uint64_t limit = im.conn(loc->parts[k].shard).PullFrameLimit();
    const int64_t n = psd::NumElements(part.shape);
    const bool ranged = limit > 0 && part.bytes() > limit;
    const int64_t step = ranged ? std::max<int64_t>(1, static_cast<int64_t>(limit / es)) : n;
    for (int64_t off = 0; off < n || (off == 0 && n == 0); off += std::max<int64_t>(step, 1)) {
      proto::Request::Builder req(nullptr);
      Impl::Call& call = im.Add(calls, loc->parts[k].shard, &req);
      auto g = req.initGetSlot();
      g.setVariable(variable);
      g.setSlot(slot);
      g.setHasDtype(true);
      g.setDtype(psd::wire::ToWire(out.dtype));
      Piece piece{k};
      call.reply_bytes = part.bytes();
      if (ranged) {
        piece.offset = off;
        piece.count = std::min(step, n - off);
        call.reply_bytes = static_cast<uint64_t>(piece.count) * es;
        g.setHasRange(true);
        g.initRange().setOffset(piece.offset);
        g.getRange().setCount(piece.count);
      }
      pieces.push_back(piece);
      if (!ranged) break;
    }
  }
  // Each reply is read as it arrives (its reader lasts until the next one on its connection).
  Status read;
  Status run = im.Run(calls, [&](size_t c) {
    if (!read.ok() || !calls[c]->status.ok()) return;
    try {
      auto t = psd::wire::ReadTensor(calls[c]->resp.getSlot(), im.options_.max_frame_bytes);
      if (!t.ok()) {
        read = t.status();
        return;
      }
      const Piece& piece = pieces[c];
      TensorView part = SliceOf(out, *loc, piece.part);
      if (piece.count >= 0) {
        part.data = static_cast<uint8_t*>(part.data) + static_cast<size_t>(piece.offset) * es;
        part.shape = {piece.count};
      }
      read = CheckView(what, t->dtype, t->shape, part);
      if (!read.ok()) return;
      // The reply's own byte count must be the view's (a hostile or broken reply could carry more
      // data than its shape says): nothing is written unless it is.
      if (t->bytes != part.bytes()) {
        read = psd::Internal("slot reply for '" + variable + "' has a wrong size (slot '" + slot + "')");
        return;
      }
      read = im.staging_.FromHost(part.data, t->data, t->bytes, part.memory, part.stream);
    } catch (const kj::Exception& e) {
      read = Malformed(e);
    }
  });
  PSD_RETURN_IF_ERROR(run);
  return read;
}

}  // namespace psclient
