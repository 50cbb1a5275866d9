#include "psclient/client.h"

#include <capnp/dynamic.h>
#include <kj/exception.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "conn.h"
#include "device_memory.h"
#include "frame_plan.h"
#include "psd/cluster_list.h"
#include "psd/half.h"
#include "shared_arena.h"
#include "sparse_check.h"
#include "wire/frame.h"
#include "wire/shm.h"
#include "wire/tls.h"

namespace psclient {

using psd::wire::InFrame;
using psd::wire::OutFrame;
namespace proto = psd::proto;

int PushOutcome::accepted() const {
  int n = 0;
  for (const auto& r : results) n += r.accepted ? 1 : 0;
  return n;
}

int PushOutcome::stale() const { return static_cast<int>(results.size()) - accepted(); }

using internal::Conn;
using internal::FromShard;
using internal::HumanBytes;
using internal::Malformed;
using internal::ReadConfig;

namespace {

// Asks the daemon to deliver each value in its view's dtype (it converts halves and float32 both ways).
void SetWantedDTypes(const std::vector<std::pair<std::string, TensorView>>& outs,
                     capnp::List<proto::DType>::Builder b) {
  for (size_t i = 0; i < outs.size(); ++i) b.set(static_cast<unsigned>(i), psd::wire::ToWire(outs[i].second.dtype));
}

Status CheckView(const std::string& what, DType want_dtype, const Shape& want_shape, const TensorView& out) {
  if (out.dtype != want_dtype || out.shape != want_shape) {
    return psd::InvalidArgument(what + " is " + psd::DTypeName(want_dtype) + " " + psd::ShapeString(want_shape) +
                                " but the destination view is " + psd::DTypeName(out.dtype) + " " +
                                psd::ShapeString(out.shape));
  }
  if (out.data == nullptr && out.bytes() > 0) return psd::InvalidArgument(what + ": destination view has no data");
  return Status::Ok();
}

Result<VariablePlacement> ReadPlacement(proto::VariablePlacement::Reader r) {
  VariablePlacement p;
  p.name = r.getName();
  auto dtype = psd::wire::FromWire(r.getDtype());
  if (!dtype.ok()) return dtype.status();
  p.dtype = *dtype;
  for (int64_t d : r.getShape()) p.shape.push_back(d);
  p.sliced = r.getSliced();
  for (auto part : r.getParts()) {
    p.parts.push_back({static_cast<int>(part.getShard()), part.getRowBegin(), part.getRowEnd()});
  }
  if (p.parts.empty()) return psd::Internal("placement of '" + p.name + "' has no parts");
  return p;
}

void WritePlacement(proto::VariablePlacement::Builder b, const VariablePlacement& p) {
  b.setName(p.name);
  b.setDtype(psd::wire::ToWire(p.dtype));
  auto shape = b.initShape(static_cast<unsigned>(p.shape.size()));
  for (size_t i = 0; i < p.shape.size(); ++i) shape.set(static_cast<unsigned>(i), p.shape[i]);
  b.setSliced(p.sliced);
  auto parts = b.initParts(static_cast<unsigned>(p.parts.size()));
  for (size_t i = 0; i < p.parts.size(); ++i) {
    parts[static_cast<unsigned>(i)].setShard(static_cast<uint32_t>(p.parts[i].shard));
    parts[static_cast<unsigned>(i)].setRowBegin(p.parts[i].row_begin);
    parts[static_cast<unsigned>(i)].setRowEnd(p.parts[i].row_end);
  }
}

// Part `i` of a tensor sliced like `p` (the whole tensor when not sliced): the rows are a
// contiguous byte range of a row-major tensor.
template <typename View>
View SliceOf(const View& whole, const VariablePlacement& p, size_t i) {
  if (!p.sliced) return whole;
  View part = whole;
  const SlicePart& s = p.parts[i];
  part.shape[0] = s.row_end - s.row_begin;
  size_t row_bytes =
      whole.shape.empty() || whole.shape[0] == 0 ? 0 : whole.bytes() / static_cast<size_t>(whole.shape[0]);
  if (whole.data != nullptr) {
    using Byte =
        std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(whole.data)>>, const uint8_t, uint8_t>;
    part.data = static_cast<Byte*>(whole.data) + static_cast<size_t>(s.row_begin) * row_bytes;
  }
  return part;
}

// One request's share of a value: all of it, or one chunk of a value bigger than a frame (sent
// back to back on one connection; the daemon acts on the last: CreateVariable and Update).
struct ValueChunk {
  bool chunked = false;
  int64_t offset = 0;  // in elements
  bool more = false;   // not the last chunk
  const uint8_t* data = nullptr;
  size_t bytes = 0;
};

// `part` as requests of at most `chunk` bytes of value each (Conn::CreateChunkBytes; 0: one
// request whatever the size). A part without data (a create's zeros) is one request.
std::vector<ValueChunk> ChunksOf(const ConstTensorView& part, uint64_t chunk) {
  const auto* data = static_cast<const uint8_t*>(part.data);
  if (data == nullptr) return {ValueChunk{}};
  const size_t es = psd::DTypeSize(part.dtype), total = part.bytes();
  if (chunk == 0 || total <= chunk) return {ValueChunk{false, 0, false, data, total}};
  const size_t step = std::max<size_t>(es, chunk / es * es);
  std::vector<ValueChunk> out;
  for (size_t offset = 0; offset < total; offset += step) {
    const size_t bytes = std::min(step, total - offset);
    out.push_back({true, static_cast<int64_t>(offset / es), offset + bytes < total, data + offset, bytes});
  }
  return out;
}

// Writes chunk `c` of `part` into request body `b` (a CreateVariable or an Update) and its value
// tensor `t`.
template <typename Body>
void SetChunk(capnp::MessageBuilder& frame, Body b, proto::Tensor::Builder t, const ConstTensorView& part,
              const ValueChunk& c) {
  if (!c.chunked) {
    psd::wire::SetTensor(frame, t, part.dtype, part.shape, c.data, c.bytes);
    return;
  }
  b.setChunked(true);
  b.setChunkOffset(c.offset);
  auto shape = b.initChunkedShape(static_cast<unsigned>(part.shape.size()));
  for (size_t d = 0; d < part.shape.size(); ++d) shape.set(static_cast<unsigned>(d), part.shape[d]);
  b.setMore(c.more);
  psd::wire::SetTensor(frame, t, part.dtype, {static_cast<int64_t>(c.bytes / psd::DTypeSize(part.dtype))}, c.data,
                       c.bytes);
}

}  // namespace

class Client::Impl {
 public:
  explicit Impl(ClientOptions options) : options_(std::move(options)) {
    if (options_.shared_buffer_bytes > 0) {
      auto arena = internal::SharedArena::Create(options_.shared_buffer_bytes);
      if (arena.ok()) {
        arena_ = std::move(*arena);
      } else {
        arena_status_ = arena.status();
      }
    }
    if (options_.cluster.empty()) {
      conns_.push_back(std::make_unique<Conn>(options_, options_.host, options_.port, 0, arena_));
    } else {
      for (size_t i = 0; i < options_.cluster.size(); ++i) {
        // Connect() validated the list.
        psd::HostPort hp = *psd::ParseHostPort(options_.cluster[i]);
        conns_.push_back(std::make_unique<Conn>(options_, hp.host, hp.port, static_cast<int>(i), arena_));
        conns_.back()->quick_reconnect = options_.cluster.size() > 1;
      }
    }
  }

  Status ConnectAll() {
    int reached = 0;
    Status first;
    for (auto& c : conns_) {
      Status s = c->Connect();
      if (!s.ok() && options_.observer && cluster()) {
        // An operator's tool looks at whatever answers (the shards left when one is down).
        if (first.ok()) first = FromShard(s, *c, cluster());
        continue;
      }
      if (!s.ok()) return FromShard(s, *c, cluster());
      ++reached;
      if (c->shards_reported != static_cast<int>(conns_.size()) && !options_.observer) {
        return psd::InvalidArgument("psd at " + c->Where() + " is part of a cluster of " +
                                    std::to_string(c->shards_reported) + " shard(s), the client was given " +
                                    std::to_string(conns_.size()) + ": list every shard in ClientOptions::cluster");
      }
    }
    if (reached == 0) return first;
    // The chief as the shards see it; its handshake has the worker's identity and role.
    int chief = -1;
    for (auto& c : conns_) {
      if (c->connects > 0 && c->chief_shard >= 0) {
        chief = c->chief_shard;
        break;
      }
    }
    chief_ = chief >= 0 && chief < static_cast<int>(conns_.size()) ? chief : 0;
    if (cluster() && !options_.observer) PSD_RETURN_IF_ERROR(WaitUntilServing());
    Conn& c = *conns_[static_cast<size_t>(chief_.load())];
    is_chief_ = c.is_chief;
    cluster_epoch_ = c.cluster_epoch;
    return Status::Ok();
  }

  // A cluster that is electing its chief or restoring a checkpoint does not serve yet: a trainer
  // that just connected waits for it (up to connect_timeout_ms) rather than failing its set-up.
  Status WaitUntilServing() {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.connect_timeout_ms);
    std::string state = "no answer";
    for (;;) {
      RefreshChief();
      OutFrame frame;
      chief().NewRequest(frame).setStatus();
      proto::Response::Reader resp;
      if (chief().RoundTrip(frame, &resp).ok()) {
        auto s = resp.getStatus();
        state = s.getClusterState();
        if (state == "running" && s.getChiefShard() == chief_.load()) {
          chief().is_chief = s.getIsChief();
          chief().cluster_epoch = s.getClusterEpoch();
          return Status::Ok();
        }
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        return psd::Unavailable("the psd cluster does not serve yet (" + state + "); retry");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  bool cluster() const { return conns_.size() > 1; }
  // Async/ssp on a cluster: shards apply pushes as they come, each at its own count; the chief's
  // is the global step, and every push reaches it (coordinator.h on the daemon).
  bool AppliesOnArrival() const {
    if (!cluster()) return false;
    const Conn& c = chief();
    std::lock_guard<std::mutex> lock(c.hello_mu);
    return c.config.mode == "async" || c.config.mode == "ssp";
  }
  int shards() const { return static_cast<int>(conns_.size()); }
  Conn& conn(int i) { return *conns_[static_cast<size_t>(i)]; }
  Conn& chief() { return conn(chief_.load()); }
  const Conn& chief() const { return *conns_[static_cast<size_t>(chief_.load())]; }

  // One request to one shard in a batch.
  struct Call {
    int shard = 0;
    OutFrame frame;
    int64_t wait_ms = 0;
    bool sent = false;
    Status status;
    proto::Response::Reader resp;
    psd::wire::Landing landing;  // a ranged pull's one tensor: read straight into the caller's view
  };
  using Calls = std::vector<std::unique_ptr<Call>>;

  Call& Add(Calls& calls, int shard, proto::Request::Builder* req, int64_t wait_ms = 0) {
    calls.push_back(std::make_unique<Call>());
    Call& c = *calls.back();
    c.shard = shard;
    c.wait_ms = wait_ms;
    *req = conn(shard).NewRequest(c.frame);
    return c;
  }

  // Sends every request, then reads every reply (in order: put the token wait last). Returns the
  // first error, naming its shard. A reply's reader lasts until the next reply on its connection:
  // with several calls to one shard, `each` (called with each call's index once its reply, or its
  // failure, is in) reads it; with one call per shard the replies can be read after Run.
  Status Run(Calls& calls, const std::function<void(size_t)>& each = {}) {
    // A shard whose earlier frame of this batch failed gets no more (its stream is reset).
    std::vector<bool> failed(conns_.size(), false);
    for (auto& c : calls) {
      const size_t k = static_cast<size_t>(c->shard);
      c->status = failed[k] ? psd::Unavailable("an earlier frame to this shard failed")
                            : FromShard(conn(c->shard).Send(c->frame, c->wait_ms), conn(c->shard), cluster());
      c->sent = c->status.ok();
      failed[k] = failed[k] || !c->sent;
    }
    for (size_t i = 0; i < calls.size(); ++i) {
      auto& c = calls[i];
      if (c->sent) {
        c->status = FromShard(conn(c->shard).Receive(c->frame, &c->resp, c->landing.dst ? &c->landing : nullptr),
                              conn(c->shard), cluster());
      }
      if (each) each(i);
    }
    // The most telling error first: a shard's own answer (it says what the cluster waits for)
    // before a transport failure (a shard that is gone).
    Status first;
    for (int pass = 0; pass < 2 && first.ok(); ++pass) {
      for (auto& c : calls) {
        if (pass == 0 && c->status.code() == Code::kAborted) NoteRestored();
        bool answered = c->sent && conn(c->shard).last_answered();
        if (first.ok() && !c->status.ok() && (pass == 1 || answered)) first = c->status;
      }
    }
    // Not now: the replies' readers must stay valid until the caller has read them.
    if (!first.ok() && cluster() && (first.code() == Code::kUnavailable || first.code() == Code::kFailedPrecondition)) {
      refresh_chief_ = true;
    }
    return first;
  }

  Status Single(int shard, OutFrame& frame, proto::Response::Reader* resp, int64_t wait_ms = 0) {
    return FromShard(conn(shard).RoundTrip(frame, resp, wait_ms), conn(shard), cluster());
  }

  // Called first by every public call (mu_ held): learns a new chief if the last call suggested one.
  // One call's host twins of its device views (the caller holds mu_): a block of the shared
  // buffers, pinned, that a same-host psd reads gradients from or writes values into in place,
  // and that the GPU copies to or from in one DMA (no staging copies). Where there is none (no
  // shared buffers, no room, a CPU-only build) the views take the staging path.
  // A block of the shared buffers (AllocateShared, and device views' twins).
  Result<SharedBuffer> NewShared(size_t bytes) {
    if (!arena_) {
      if (!arena_status_.ok()) return arena_status_;
      return psd::FailedPrecondition("no shared buffers: ClientOptions::shared_buffer_bytes is 0");
    }
    auto at = arena_->Allocate(bytes);
    if (!at.ok()) return at.status();
    SharedBuffer b;
    b.arena_ = arena_;
    b.offset_ = *at;
    b.bytes_ = bytes;
    return b;
  }

  void Begin() {
    for (auto& c : conns_) c->ShmReset();  // the last call's replies are all in
    if (!refresh_chief_) return;
    refresh_chief_ = false;
    RefreshChief();
  }

  // The cluster restored a checkpoint: placements may have changed and the trainer must re-read
  // the global step.
  void NoteRestored() {
    placements_.clear();
    ++epoch_bumps_;
  }

  void NoteEpoch(uint64_t epoch) {
    uint64_t old = cluster_epoch_.exchange(epoch);
    if (old != epoch && old != 0) NoteRestored();
  }

  // Asks the shards who the chief is (the answer of the highest term wins).
  void RefreshChief() {
    uint64_t best_term = 0;
    int best = -1;
    for (int i = 0; i < shards(); ++i) {
      OutFrame frame;
      conn(i).NewRequest(frame).setStatus();
      proto::Response::Reader resp;
      if (!conn(i).RoundTrip(frame, &resp).ok()) continue;
      auto s = resp.getStatus();
      if (s.getChiefShard() >= 0 && (best < 0 || s.getTerm() > best_term)) {
        best = s.getChiefShard();
        best_term = s.getTerm();
      }
    }
    if (best >= 0 && best < shards()) chief_ = best;
  }

  // Where `name` lives (mu_ held). A single daemon holds everything whole.
  Result<VariablePlacement> Locate(const std::string& name) {
    if (!cluster()) return VariablePlacement{name, DType::kFloat32, {}, false, {{0, 0, 0}}};
    auto it = placements_.find(name);
    if (it != placements_.end()) return it->second;
    auto map = FetchMap();
    if (!map.ok()) return map.status();
    for (auto& p : map->variables) placements_[p.name] = p;
    it = placements_.find(name);
    if (it == placements_.end()) return psd::NotFound("no variable named '" + name + "'");
    return it->second;
  }

  Result<PlacementMap> FetchMap() {
    for (int attempt = 0; attempt < 2; ++attempt) {
      OutFrame frame;
      chief().NewRequest(frame).setGetPlacement();
      proto::Response::Reader resp;
      Status s = Single(chief_.load(), frame, &resp);
      if (s.ok()) {
        try {
          PlacementMap m;
          auto pm = resp.getPlacementMap();
          for (auto v : pm.getVariables()) {
            auto p = ReadPlacement(v);
            if (!p.ok()) return p.status();
            m.variables.push_back(std::move(*p));
          }
          for (uint64_t b : pm.getShardBytes()) m.shard_bytes.push_back(b);
          return m;
        } catch (const kj::Exception& e) {
          return Malformed(e);
        }
      }
      if (!cluster() || attempt == 1) return s;
      RefreshChief();
    }
    return psd::Internal("unreachable");
  }

  // Copies a pull reply's values into the caller's views; returns the step they reflect.
  // `from`: the connection it came on (its shared memory holds values sent that way).
  Result<int64_t> ReadValues(proto::PullReply::Reader p, const std::vector<std::pair<std::string, TensorView>>& outs,
                             const Conn* from) {
    try {
      auto values = p.getValues();
      if (values.size() != outs.size()) return psd::Internal("pull reply has the wrong number of values");
      for (size_t i = 0; i < outs.size(); ++i) {
        auto tensor = values[static_cast<unsigned>(i)];
        // In shared memory, ShmAt bounds it by the segment.
        auto t = psd::wire::ReadTensor(
            tensor, tensor.getInShm() ? std::numeric_limits<int64_t>::max() : options_.max_frame_bytes,
            /*in_shm_ok=*/true);
        if (!t.ok()) return t.status();
        if (tensor.getInShm()) {
          const uint64_t bytes = static_cast<uint64_t>(psd::NumElements(t->shape)) * psd::DTypeSize(t->dtype);
          t->data = from->ShmAt(tensor.getShmSegment(), tensor.getShmOffset(), bytes);
          if (t->data == nullptr) return psd::Internal("a value in shared memory outside this connection's segments");
          t->bytes = bytes;
        }
        const TensorView& out = outs[i].second;
        PSD_RETURN_IF_ERROR(CheckView("'" + outs[i].first + "'", t->dtype, t->shape, out));
        if (t->bytes != out.bytes()) return psd::Internal("pull reply for '" + outs[i].first + "' has a wrong size");
        if (out.memory == MemoryKind::kHost) {
          // Landed: the bytes were read straight into the view. Else copied (memmove: a reply that
          // did not land as planned may still have been read over the view).
          if (t->data != out.data) std::memmove(out.data, t->data, t->bytes);
          continue;
        }
        PSD_RETURN_IF_ERROR(staging_.FromHost(out.data, t->data, t->bytes, out.memory, out.stream));
      }
      return p.getStep();
    } catch (const kj::Exception& e) {
      return Malformed(e);
    }
  }

  // The caller's views split by shard: per shard, (name, view of that shard's part).
  using Outs = std::vector<std::pair<std::string, TensorView>>;

  class Twins {
   public:
    explicit Twins(Impl& im) : im_(im) {}
    ~Twins() {
      for (auto& b : taken_) im_.twin_pool_.emplace(b.bytes(), std::move(b));
    }
    Twins(const Twins&) = delete;
    Twins& operator=(const Twins&) = delete;

    // A pinned host block of `bytes`, or nullptr.
    void* Take(size_t bytes) {
      if (bytes == 0 || im_.twins_unavailable_) return nullptr;
      auto it = im_.twin_pool_.find(bytes);
      if (it != im_.twin_pool_.end()) {
        taken_.push_back(std::move(it->second));
        im_.twin_pool_.erase(it);
        return taken_.back().data();
      }
      auto b = im_.NewShared(bytes);
      if (!b.ok()) return nullptr;  // no shared buffers, or no room: this view is staged
      if (!im_.staging_.PinHost(b->data(), bytes).ok()) {
        // A CPU-only build, or CUDA refuses to pin: no twins for this client (b goes back).
        im_.twins_unavailable_ = true;
        return nullptr;
      }
      taken_.push_back(std::move(*b));
      return taken_.back().data();
    }

    // `outs` with each device view replaced by a host twin (false: none was).
    bool Substitute(const std::vector<std::pair<std::string, TensorView>>& outs,
                    std::vector<std::pair<std::string, TensorView>>* host) {
      bool any = false;
      *host = outs;
      for (size_t i = 0; i < outs.size(); ++i) {
        const TensorView& v = outs[i].second;
        if (v.memory == MemoryKind::kHost || v.data == nullptr) continue;
        void* twin = Take(v.bytes());
        if (twin == nullptr) continue;
        (*host)[i].second.data = twin;
        (*host)[i].second.memory = MemoryKind::kHost;
        (*host)[i].second.stream = nullptr;
        back_.push_back({v, twin});
        any = true;
      }
      return any;
    }

    // After the pull: each twin's values into its device view.
    Status CopyBack() {
      for (const auto& [view, twin] : back_) {
        PSD_RETURN_IF_ERROR(im_.staging_.FromHost(view.data, twin, view.bytes(), view.memory, view.stream));
      }
      return Status::Ok();
    }

   private:
    Impl& im_;
    std::vector<SharedBuffer> taken_;
    std::vector<std::pair<TensorView, void*>> back_;  // device view, its twin
  };

  Status SplitOuts(const Outs& outs, std::vector<Outs>* per_shard) {
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

  // One frame of a pull: its shard, and the (name, view) pairs it fills (with `ranged`, flat
  // views of element ranges of the caller's views).
  struct PullFrame {
    int shard;
    Outs outs;
    std::vector<int64_t> offsets;  // ranged: the first element of each
    bool ranged = false;
    bool to_shm = false;  // the values come through the connection's shared memory (ShmTargetBytes)
    // ... written in place: every view is in the shared buffers (BufferOffsets)
    std::vector<uint64_t> in_buffers;
  };

  // Where each of `outs` is in shard k's shared buffers, when all are (host memory the connection
  // has attached), else empty: the daemon then writes the values in place.
  std::vector<uint64_t> BufferOffsets(int k, const Outs& outs) {
    std::vector<uint64_t> at;
    for (const auto& o : outs) {
      const int64_t off =
          o.second.memory == MemoryKind::kHost ? conn(k).BufferOffset(o.second.data, o.second.bytes()) : -1;
      if (off < 0) return {};
      at.push_back(static_cast<uint64_t>(off));
    }
    return at;
  }
  // Asks for the values written at `offsets` of the shared buffers (segment 1).
  static void SetBufferTarget(const std::vector<uint64_t>& offsets, proto::ShmTarget::Builder target) {
    target.setSegment(1);
    auto list = target.initOffsets(static_cast<unsigned>(offsets.size()));
    for (size_t i = 0; i < offsets.size(); ++i) list.set(static_cast<unsigned>(i), offsets[i]);
  }

  // The room a pull of `outs` takes in shared memory: each value at a multiple of 64 bytes.
  static uint64_t ShmTargetBytes(const Outs& outs) {
    uint64_t need = 0;
    for (const auto& o : outs) need += psd::wire::ShmAlign(o.second.bytes());
    return need;
  }
  // Asks for `outs` in shard k's shared memory (room reserved now), when it has room.
  template <typename B>
  bool SetShmTarget(int k, const Outs& outs, B target) {
    const uint64_t need = ShmTargetBytes(outs);
    int64_t at = conn(k).ShmReserve(need);
    if (at < 0) return false;
    target.setOffset(static_cast<uint64_t>(at));
    target.setBytes(need);
    return true;
  }

  // The frames that read `outs` from shard k: one, or (the values bigger than a reply frame)
  // several that ask for element ranges of whole parts.
  void PlanPull(int k, const Outs& outs, std::vector<PullFrame>* frames) {
    std::vector<uint64_t> bytes, elem;
    for (const auto& o : outs) {
      bytes.push_back(o.second.bytes());
      elem.push_back(psd::DTypeSize(o.second.dtype));
    }
    if (auto at = BufferOffsets(k, outs); !at.empty()) {
      frames->push_back({k, outs, {}, false, true, std::move(at)});
      return;
    }
    if (conn(k).ShmFits(ShmTargetBytes(outs))) {
      frames->push_back({k, outs, {}, false, true, {}});
      return;
    }
    auto plan = internal::PlanFrames(bytes, elem, {}, {}, conn(k).PullFrameLimit(), conn(k).chunk_elements);
    bool whole = plan.size() == 1;
    for (const auto& piece : plan[0].dense) whole = whole && piece.offset == 0 && piece.bytes == bytes[piece.entry];
    if (whole) {
      frames->push_back({k, outs, {}, false, false, {}});
      return;
    }
    for (const internal::FramePlan& f : plan) {
      PullFrame frame{k, {}, {}, true, false, {}};
      for (const internal::FramePiece& piece : f.dense) {
        const auto& [name, view] = outs[piece.entry];
        const size_t es = elem[piece.entry];
        TensorView part = view;
        part.data = view.data ? static_cast<uint8_t*>(view.data) + piece.offset : nullptr;
        part.shape = {static_cast<int64_t>(piece.bytes / es)};
        frame.outs.emplace_back(name, part);
        frame.offsets.push_back(static_cast<int64_t>(piece.offset / es));
      }
      frames->push_back(std::move(frame));
    }
  }

  // Where a reply that carries `outs` may land: the one value's host memory (a multiple of 8
  // bytes; ReadFrameWith checks the alignment), else nowhere.
  static psd::wire::Landing LandingFor(const Outs& outs) {
    if (outs.size() != 1) return {};
    const TensorView& only = outs[0].second;
    if (only.memory != MemoryKind::kHost || only.bytes() % 8 != 0) return {};
    return {only.data, only.bytes()};
  }

  // Pulls (mu_ held): one request per shard holding a part, or several for values bigger than a
  // reply; every reply must be at the same step (a pull racing a commit is read again).
  Result<int64_t> PullLocked(const Outs& outs, bool averages) {
    // Device views: the values land in their host twins (in place, where psd is on this host),
    // then go to the GPU in one DMA each.
    Twins twins(*this);
    Outs host;
    if (!twins.Substitute(outs, &host)) return PullViewsLocked(outs, averages);
    auto step = PullViewsLocked(host, averages);
    if (step.ok()) PSD_RETURN_IF_ERROR(twins.CopyBack());
    return step;
  }
  Result<int64_t> PullViewsLocked(const Outs& outs, bool averages) {
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
        Add(calls, f.shard, &req);
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
        calls.back()->landing = LandingFor(f.outs);
        auto ranges = pull.initRanges(static_cast<unsigned>(f.outs.size()));
        for (size_t i = 0; i < f.outs.size(); ++i) {
          ranges[static_cast<unsigned>(i)].setOffset(f.offsets[i]);
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
      Status read;
      Status s = Run(calls, [&](size_t i) {
        if (!calls[i]->status.ok() || !read.ok() || !agree) return;
        try {
          auto p = calls[i]->resp.getPull();
          if (i == 0) {
            step = p.getStep();
            epoch = p.getClusterEpoch();
          } else if (p.getClusterEpoch() != epoch || (p.getStep() != step && !any_step)) {
            agree = false;
            return;
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

  // A request for the chief shard (asked again after a refresh if it is not the chief any more).
  // *resp stays valid until the next call.
  template <typename Fill>
  Status CallChief(Fill fill, proto::Response::Reader* resp, int64_t wait_ms = 0) {
    for (int attempt = 0;; ++attempt) {
      OutFrame frame;
      fill(chief().NewRequest(frame));
      Status s = Single(chief_.load(), frame, resp, wait_ms);
      if (s.ok() || !cluster() || attempt == 1 ||
          (s.code() != Code::kUnavailable && s.code() != Code::kFailedPrecondition)) {
        return s;
      }
      RefreshChief();
    }
  }

  ClientOptions options_;
  std::shared_ptr<internal::SharedArena> arena_;  // the shared buffers (null: none)
  Status arena_status_;                           // why there is no arena, when it failed
  std::vector<std::unique_ptr<Conn>> conns_;
  std::mutex mu_;  // serializes calls
  // Device views' host twins (Twins): blocks of the shared buffers pinned for DMA, kept for the
  // client's life and reused by size. Guarded by mu_. Before staging_: it unpins them (its
  // destructor) before they are freed.
  std::multimap<size_t, SharedBuffer> twin_pool_;
  bool twins_unavailable_ = false;                       // guarded by mu_: pinning failed once (Twins::Take)
  internal::DeviceStaging staging_;                      // guarded by mu_: device views' pinned buffers
  std::map<std::string, VariablePlacement> placements_;  // guarded by mu_
  std::atomic<int> chief_{0};
  std::atomic<uint64_t> cluster_epoch_{0};
  std::atomic<uint64_t> epoch_bumps_{0};
  std::atomic<bool> is_chief_{false};
  bool refresh_chief_ = false;    // guarded by mu_: a call failed in a way that may mean a new chief
  std::string colocate_default_;  // guarded by mu_: the innermost ColocateVarsWith scope's variable
};

std::vector<std::string> ParseClusterList(const std::string& list) { return psd::SplitClusterList(list); }

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  ClientOptions o = options;
  if (o.worker_name.empty()) o.worker_name = "worker-" + std::to_string(::getpid());
  if (o.incarnation == 0) {
    o.incarnation = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  }
  PSD_RETURN_IF_ERROR(psd::ValidateClusterList(o.cluster, "the cluster list"));
  auto impl = std::make_unique<Impl>(std::move(o));
  Status s = impl->ConnectAll();
  if (!s.ok()) return s;
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

JobConfig Client::config() const {
  const Conn& c = impl_->chief();
  std::lock_guard<std::mutex> lock(c.hello_mu);
  return c.config;
}
uint32_t Client::worker_id() const {
  const Conn& c = impl_->chief();
  std::lock_guard<std::mutex> lock(c.hello_mu);
  return c.worker_id;
}
bool Client::is_chief() const { return impl_->is_chief_.load(); }
int64_t Client::initial_global_step() const {
  const Conn& c = impl_->chief();
  std::lock_guard<std::mutex> lock(c.hello_mu);
  return c.initial_step;
}
uint64_t Client::connection_epoch() const {
  uint64_t n = impl_->epoch_bumps_.load();
  for (const auto& c : impl_->conns_) n += c->connects;
  return n;
}
std::vector<std::string> Client::SlotNames() const { return config().slot_names; }
int Client::shards() const { return impl_->shards(); }
int Client::shared_memory_shards() const {
  int n = 0;
  for (int k = 0; k < impl_->shards(); ++k) {
    std::lock_guard<std::mutex> lock(impl_->conn(k).shm_mu);
    n += impl_->conn(k).shm ? 1 : 0;
  }
  return n;
}
std::string Client::shared_memory_status() const {
  std::string out;
  for (int k = 0; k < impl_->shards(); ++k) {
    const auto& c = impl_->conn(k);
    std::lock_guard<std::mutex> lock(c.shm_mu);
    const std::string& why = c.shm ? c.buffers_status : c.shm_status;
    if (why.empty()) continue;
    if (!out.empty()) out += "; ";
    out += (impl_->shards() > 1 ? "shard " + std::to_string(k) + ": " : std::string()) + why;
  }
  return out;
}
Result<SharedBuffer> Client::AllocateShared(size_t bytes) { return impl_->NewShared(bytes); }

SharedBuffer::~SharedBuffer() {
  if (arena_) arena_->Free(offset_);
}
SharedBuffer::SharedBuffer(SharedBuffer&& other) noexcept
    : arena_(std::move(other.arena_)), offset_(other.offset_), bytes_(other.bytes_) {
  other.bytes_ = 0;
}
SharedBuffer& SharedBuffer::operator=(SharedBuffer&& other) noexcept {
  if (this == &other) return *this;
  if (arena_) arena_->Free(offset_);
  arena_ = std::move(other.arena_);
  offset_ = other.offset_;
  bytes_ = other.bytes_;
  other.bytes_ = 0;
  return *this;
}
void* SharedBuffer::data() const { return arena_ ? arena_->data() + offset_ : nullptr; }

int Client::chief_shard() const { return impl_->chief_.load(); }
uint64_t Client::cluster_epoch() const { return impl_->cluster_epoch_.load(); }

Result<VariablePlacement> Client::Placement(const std::string& name) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  auto p = impl_->Locate(name);
  if (!p.ok() || impl_->cluster()) return p;
  // A single daemon: everything is whole on shard 0; the map knows dtype and shape.
  auto map = impl_->FetchMap();
  if (!map.ok()) return map.status();
  for (auto& v : map->variables) {
    if (v.name == name) return v;
  }
  return psd::NotFound("no variable named '" + name + "'");
}

Result<PlacementMap> Client::GetPlacementMap() {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  return impl_->FetchMap();
}

Result<VariableInfo> Client::CreateVariable(const std::string& name, ConstTensorView initial, bool trainable) {
  VariableOptions options;
  options.trainable = trainable;
  return CreateVariable(name, initial, options);
}

Result<VariableInfo> Client::CreateVariable(const std::string& name, ConstTensorView initial,
                                            const VariableOptions& options) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  Impl& im = *impl_;
  std::vector<uint8_t> staged;
  const void* data = initial.data;
  size_t bytes = initial.data ? initial.bytes() : 0;
  if (initial.data && initial.memory != MemoryKind::kHost) {
    staged.resize(bytes);
    PSD_RETURN_IF_ERROR(im.staging_.ToHost(staged.data(), initial.data, bytes, initial.memory, initial.stream));
    data = staged.data();
  }
  ConstTensorView host = initial;
  host.data = data;
  host.memory = MemoryKind::kHost;
  // Where it goes: a cluster's chief places it (create-or-get); a single daemon holds it whole.
  VariablePlacement placed{name, initial.dtype, initial.shape, false, {{0, 0, 0}}};
  if (im.cluster()) {
    proto::Response::Reader resp;
    Status s = im.CallChief(
        [&](proto::Request::Builder req) {
          auto p = req.initPlace();
          p.setName(name);
          p.setDtype(psd::wire::ToWire(initial.dtype));
          auto shape = p.initShape(static_cast<unsigned>(initial.shape.size()));
          for (size_t i = 0; i < initial.shape.size(); ++i) shape.set(static_cast<unsigned>(i), initial.shape[i]);
          p.setColocateWith(options.colocate_with.empty() ? im.colocate_default_ : options.colocate_with);
          p.setTrainable(options.trainable);
        },
        &resp);
    if (!s.ok()) return s;
    try {
      auto loc = ReadPlacement(resp.getPlacement());
      if (!loc.ok()) return loc.status();
      placed = *loc;
    } catch (const kj::Exception& e) {
      return Malformed(e);
    }
    im.placements_[name] = placed;
  }
  Impl::Calls calls;
  std::vector<bool> last_of_part;  // per call: the create itself (not a chunk answered `none`)
  for (size_t i = 0; i < placed.parts.size(); ++i) {
    ConstTensorView part = SliceOf(host, placed, i);
    part.data = host.data ? part.data : nullptr;
    // An initial value bigger than a frame goes in chunks (the daemon creates the variable with
    // the last one).
    for (const ValueChunk& chunk : ChunksOf(part, im.conn(placed.parts[i].shard).CreateChunkBytes())) {
      proto::Request::Builder req(nullptr);
      Impl::Call& call = im.Add(calls, placed.parts[i].shard, &req);
      auto c = req.initCreateVariable();
      c.setName(name);
      c.setTrainable(options.trainable);
      c.setAverage(options.average);
      c.setOptimizer(options.optimizer);
      c.setAggregation(static_cast<proto::Aggregation>(static_cast<int>(options.aggregation)));
      c.setSyncOnRead(options.sync_on_read);
      SetChunk(call.frame.builder, c, c.initInitial(), part, chunk);
      if (im.cluster()) {
        WritePlacement(c.initPlacement(), placed);
        c.setPart(static_cast<uint32_t>(i));
      }
      last_of_part.push_back(!chunk.more);
    }
  }
  VariableInfo info{name, initial.dtype, initial.shape, false, options.trainable};
  // Each reply is read as it arrives (a reply's reader lasts until the next on its connection).
  Status read;
  Status run = im.Run(calls, [&](size_t k) {
    if (!read.ok() || !calls[k]->status.ok() || !last_of_part[k]) return;
    try {
      auto v = calls[k]->resp.getVariable();
      info.created = info.created || v.getCreated();
      info.trainable = v.getTrainable();
      if (!im.cluster()) {
        auto dtype = psd::wire::FromWire(v.getDtype());
        if (!dtype.ok()) {
          read = dtype.status();
          return;
        }
        info.dtype = *dtype;
        info.shape.clear();
        for (int64_t d : v.getShape()) info.shape.push_back(d);
        info.name = v.getName();
      }
    } catch (const kj::Exception& e) {
      read = Malformed(e);
    }
  });
  PSD_RETURN_IF_ERROR(run);
  PSD_RETURN_IF_ERROR(read);
  return info;
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
  // Rows per reply: whole rows within pull_frame_bytes (0: all in one).
  auto rows_per_reply = [&](int shard) -> size_t {
    const uint64_t limit = im.conn(shard).PullFrameLimit();
    if (limit == 0 || row_bytes == 0) return SIZE_MAX;
    return std::max<size_t>(1, (limit - std::min(limit, Conn::kFrameSlack)) / row_bytes);
  };
  if (!loc->sliced && (row_bytes == 0 || rows.size() <= rows_per_reply(loc->parts[0].shard))) {
    // One reply, read straight into the caller's view; the daemon checks the rows.
    OutFrame frame;
    auto p = im.conn(loc->parts[0].shard).NewRequest(frame).initPullRows();
    p.setName(name);
    p.setHasDtype(true);
    p.setDtype(psd::wire::ToWire(out.dtype));
    auto list = p.initRows(static_cast<unsigned>(rows.size()));
    for (size_t i = 0; i < rows.size(); ++i) list.set(static_cast<unsigned>(i), rows[i]);
    proto::Response::Reader resp;
    PSD_RETURN_IF_ERROR(im.Single(loc->parts[0].shard, frame, &resp));
    try {
      return im.ReadValues(resp.getPull(), {{name, out}}, &im.conn(loc->parts[0].shard));
    } catch (const kj::Exception& e) {
      return Malformed(e);
    }
  }
  // Sliced, or more rows than a reply holds: each shard reads its rows, in replies of whole rows
  // within pull_frame_bytes, and they are scattered back into the caller's order.
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
  const bool any_step = im.AppliesOnArrival();  // each shard at its own count: the lowest
  for (int attempt = 0;; ++attempt) {
    Impl::Calls calls;
    std::vector<std::vector<size_t>> batch;  // per call: the caller's positions it fills
    for (size_t k = 0; k < loc->parts.size(); ++k) {
      const int shard = loc->parts[k].shard;
      const size_t per = rows_per_reply(shard);
      for (size_t first = 0; first < positions[k].size(); first += per) {
        const size_t last = first + std::min(per, positions[k].size() - first);
        batch.emplace_back(positions[k].begin() + static_cast<std::ptrdiff_t>(first),
                           positions[k].begin() + static_cast<std::ptrdiff_t>(last));
        proto::Request::Builder req(nullptr);
        im.Add(calls, shard, &req);
        auto p = req.initPullRows();
        p.setName(name);
        p.setHasDtype(true);
        p.setDtype(psd::wire::ToWire(out.dtype));
        auto list = p.initRows(static_cast<unsigned>(batch.back().size()));
        for (size_t j = 0; j < batch.back().size(); ++j) {
          list.set(static_cast<unsigned>(j), rows[batch.back()[j]] - loc->parts[k].row_begin);
        }
      }
    }
    // Each reply is scattered as it arrives (a reader lasts until the next reply on its
    // connection); replies at different steps (a commit came between them) are read again.
    int64_t step = -1;
    bool agree = true;
    Status read;
    Status run = im.Run(calls, [&](size_t c) {
      if (!calls[c]->status.ok() || !read.ok() || !agree) return;
      try {
        auto p = calls[c]->resp.getPull();
        if (step >= 0 && p.getStep() != step && !any_step) {
          agree = false;
          return;
        }
        step = step >= 0 ? std::min(step, p.getStep()) : p.getStep();
        auto t = psd::wire::ReadTensor(p.getValues()[0], im.options_.max_frame_bytes);
        if (!t.ok()) {
          read = t.status();
          return;
        }
        if (t->bytes != batch[c].size() * row_bytes || t->shape.empty()) {
          // The caller's view does not fit the variable's rows (a single daemon's client
          // learns their shape here): say how.
          Shape whole = t->shape;
          if (!whole.empty()) whole[0] = static_cast<int64_t>(rows.size());
          read = CheckView("rows of '" + name + "'", t->dtype, whole, out);
          if (read.ok()) read = psd::Internal("rows reply has a wrong size");
          return;
        }
        read = im.staging_.RowsFromHost(out.data, batch[c], t->data, row_bytes, out.memory, out.stream);
      } catch (const kj::Exception& e) {
        read = Malformed(e);
      }
    });
    PSD_RETURN_IF_ERROR(run);
    PSD_RETURN_IF_ERROR(read);
    if (agree) return step;
    if (attempt >= 200) return psd::Unavailable("the shards keep answering at different global steps; retry");
    std::this_thread::sleep_for(std::chrono::milliseconds(attempt < 20 ? 1 : 10));
  }
}

Result<PushOutcome> Client::Push(int64_t local_step, const std::vector<Gradient>& grads, bool wait_token,
                                 int64_t timeout_ms) {
  return Push(local_step, grads, {}, wait_token, timeout_ms);
}

namespace {

// Sorts the rows of a sparse gradient by index and sums repeated rows (the daemon takes strictly
// increasing indices). `values` is host memory. Returns the dtype of the rows in `out`: the
// values' own, except that half-precision rows with repeated indices are summed and sent in
// float32 (the daemon accumulates halves in float32 too, so no sum is rounded on the way).
DType Coalesce(const SparseGradient& g, const void* values, std::vector<int64_t>* indices, std::vector<uint64_t>* out) {
  size_t n = g.indices.size();
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return g.indices[a] < g.indices[b]; });
  if (psd::IsHalf(g.values.dtype) && std::adjacent_find(order.begin(), order.end(), [&](size_t a, size_t b) {
                                       return g.indices[a] == g.indices[b];
                                     }) != order.end()) {
    size_t count = static_cast<size_t>(psd::NumElements(g.values.shape));
    std::vector<uint64_t> widened((count * sizeof(float) + 7) / 8);
    psd::ConvertElements(values, g.values.dtype, widened.data(), DType::kFloat32, count);
    SparseGradient as_float{g.name, g.indices, g.values, g.dense_shape};
    as_float.values.dtype = DType::kFloat32;
    as_float.values.data = widened.data();
    return Coalesce(as_float, widened.data(), indices, out);
  }
  size_t row_bytes = n ? g.values.bytes() / n : 0;
  indices->clear();
  out->assign((n * row_bytes + 7) / 8, 0);
  uint8_t* dst = reinterpret_cast<uint8_t*>(out->data());
  const uint8_t* src = static_cast<const uint8_t*>(values);
  size_t elems = row_bytes / psd::DTypeSize(g.values.dtype);
  for (size_t k = 0; k < n; ++k) {
    size_t i = order[k];
    if (!indices->empty() && indices->back() == g.indices[i]) {
      uint8_t* row = dst + (indices->size() - 1) * row_bytes;
      if (g.values.dtype == DType::kFloat32) {
        for (size_t e = 0; e < elems; ++e) {
          reinterpret_cast<float*>(row)[e] += reinterpret_cast<const float*>(src + i * row_bytes)[e];
        }
      } else {
        for (size_t e = 0; e < elems; ++e) {
          reinterpret_cast<double*>(row)[e] += reinterpret_cast<const double*>(src + i * row_bytes)[e];
        }
      }
      continue;
    }
    std::memcpy(dst + indices->size() * row_bytes, src + i * row_bytes, row_bytes);
    indices->push_back(g.indices[i]);
  }
  return g.values.dtype;
}

// The one frame a shard's part of a push takes when its gradients' values go through shared
// memory (dense gradients, and sparse ones' rows; their indices stay in the frame): false (plan
// over TCP) unless the connection has a segment with room for all the values and the indices fit
// a frame. Dense gradients in the shared buffers (in_buffers >= 0) take no room: psd reads them
// in place.
bool ShmPlan(const Conn& conn, const std::vector<uint64_t>& dense_bytes, const std::vector<int64_t>& in_buffers,
             const std::vector<uint64_t>& sparse_values, const std::vector<uint64_t>& sparse_indices,
             std::vector<internal::FramePlan>* frames) {
  if (!conn.shm || (dense_bytes.empty() && sparse_values.empty())) return false;
  uint64_t need = 0, in_frame = 0;
  for (size_t i = 0; i < dense_bytes.size(); ++i) need += in_buffers[i] >= 0 ? 0 : psd::wire::ShmAlign(dense_bytes[i]);
  for (uint64_t b : sparse_values) need += psd::wire::ShmAlign(b);
  for (uint64_t b : sparse_indices) in_frame += b + internal::kFrameEntryOverhead;
  const uint64_t limit = conn.PushFrameLimit();
  if (!conn.ShmFits(need) || (limit > 0 && in_frame + Conn::kFrameSlack > limit)) return false;
  internal::FramePlan plan;
  for (size_t i = 0; i < dense_bytes.size(); ++i) plan.dense.push_back({i, 0, dense_bytes[i]});
  for (size_t j = 0; j < sparse_values.size(); ++j) plan.sparse.push_back({j, 0, sparse_indices[j] / sizeof(int64_t)});
  frames->assign(1, std::move(plan));
  return true;
}

// Sorts and coalesces sparse gradients' rows, then splits them by the variable's slices:
// part k gets the rows in its range, re-based to the slice.
struct SparsePart {
  std::vector<int64_t> indices;
  const void* values = nullptr;
  size_t bytes = 0;
  Shape shape;
  std::optional<Shape> dense_shape;
  DType dtype = DType::kFloat32;  // of `values`
};

}  // namespace

Result<PushOutcome> Client::Push(int64_t local_step, const std::vector<Gradient>& grads,
                                 const std::vector<SparseGradient>& sparse, bool wait_token, int64_t timeout_ms,
                                 const std::vector<std::pair<std::string, TensorView>>* pull_after) {
  if (grads.empty() && sparse.empty()) return psd::InvalidArgument("Must supply at least one variable");
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  Impl& im = *impl_;
  const bool cluster = im.cluster();
  const int chief = im.chief_.load();
  std::deque<std::vector<uint64_t>> staged;  // device gradients copied to host, coalesced rows
  // Device gradients and pull_after views go through host twins where the client has them.
  Impl::Twins twins(im);
  Impl::Outs after_twins;
  const bool after_on_device = pull_after != nullptr && twins.Substitute(*pull_after, &after_twins);
  if (after_on_device) pull_after = &after_twins;
  // Per shard: the gradient parts it gets, as (result slot, name, part).
  struct DensePart {
    size_t slot;
    const std::string* name;
    ConstTensorView view;
    bool padded;
  };
  struct SparseEntry {
    size_t slot;
    const std::string* name;
    SparsePart part;
  };
  std::vector<std::vector<DensePart>> dense_by(static_cast<size_t>(im.shards()));
  std::vector<std::vector<SparseEntry>> sparse_by(static_cast<size_t>(im.shards()));
  for (size_t i = 0; i < grads.size(); ++i) {
    const Gradient& g = grads[i];
    if (g.grad.data == nullptr && g.grad.bytes() > 0) {
      return psd::InvalidArgument("gradient for '" + g.name + "' has no data");
    }
    ConstTensorView host = g.grad;
    if (g.grad.memory != MemoryKind::kHost) {
      void* to = twins.Take(g.grad.bytes());
      if (to == nullptr) to = staged.emplace_back((g.grad.bytes() + 7) / 8).data();
      PSD_RETURN_IF_ERROR(im.staging_.ToHost(to, g.grad.data, g.grad.bytes(), g.grad.memory, g.grad.stream));
      host.data = to;
      host.memory = MemoryKind::kHost;
    }
    auto loc = im.Locate(g.name);
    if (!loc.ok()) return loc.status();
    if (loc->sliced && (host.shape != loc->shape || !psd::ConvertibleDTypes(host.dtype, loc->dtype))) {
      return psd::InvalidArgument("gradient for '" + g.name + "' is " + psd::DTypeName(host.dtype) + " " +
                                  psd::ShapeString(host.shape) + "; the variable is " + psd::DTypeName(loc->dtype) +
                                  " " + psd::ShapeString(loc->shape));
    }
    for (size_t k = 0; k < loc->parts.size(); ++k) {
      dense_by[static_cast<size_t>(loc->parts[k].shard)].push_back(
          {i, &g.name, SliceOf(host, *loc, k), /*padded=*/g.grad.memory != MemoryKind::kHost && !loc->sliced});
    }
  }
  for (size_t j = 0; j < sparse.size(); ++j) {
    const SparseGradient& g = sparse[j];
    PSD_RETURN_IF_ERROR(internal::CheckSparseGradient(g, nullptr));
    if (g.values.data == nullptr && g.values.bytes() > 0) {
      return psd::InvalidArgument("sparse gradient for '" + g.name + "' has no data");
    }
    const void* values = g.values.data;
    if (g.values.memory != MemoryKind::kHost) {
      staged.emplace_back((g.values.bytes() + 7) / 8);
      PSD_RETURN_IF_ERROR(
          im.staging_.ToHost(staged.back().data(), values, g.values.bytes(), g.values.memory, g.values.stream));
      values = staged.back().data();
    }
    std::vector<int64_t> indices;
    staged.emplace_back();
    DType rows_dtype = Coalesce(g, values, &indices, &staged.back());
    const uint8_t* rows = reinterpret_cast<const uint8_t*>(staged.back().data());
    size_t row_bytes = static_cast<size_t>(psd::NumElements(Shape(g.values.shape.begin() + 1, g.values.shape.end()))) *
                       psd::DTypeSize(rows_dtype);
    auto loc = im.Locate(g.name);
    if (!loc.ok()) return loc.status();
    // A cluster's client knows the whole shape: rows outside it would fall outside every slice.
    if (cluster) PSD_RETURN_IF_ERROR(internal::CheckSparseGradient(g, &loc->shape));
    for (size_t k = 0; k < loc->parts.size(); ++k) {
      SparsePart part;
      size_t first = 0, last = indices.size();
      if (loc->sliced) {
        first = static_cast<size_t>(std::lower_bound(indices.begin(), indices.end(), loc->parts[k].row_begin) -
                                    indices.begin());
        last = static_cast<size_t>(std::lower_bound(indices.begin(), indices.end(), loc->parts[k].row_end) -
                                   indices.begin());
        if (first == last && loc->parts.size() > 1) continue;  // no rows for this slice
        for (size_t r = first; r < last; ++r) part.indices.push_back(indices[r] - loc->parts[k].row_begin);
      } else {
        part.indices = indices;
      }
      part.values = rows + first * row_bytes;
      part.bytes = (last - first) * row_bytes;
      part.shape = g.values.shape;
      part.shape[0] = static_cast<int64_t>(last - first);
      part.dtype = rows_dtype;
      part.dense_shape = g.dense_shape;
      if (loc->sliced && part.dense_shape && !part.dense_shape->empty()) {
        (*part.dense_shape)[0] = loc->parts[k].row_end - loc->parts[k].row_begin;
      }
      sparse_by[static_cast<size_t>(loc->parts[k].shard)].push_back({grads.size() + j, &g.name, std::move(part)});
    }
  }
  // The values come with the token when they fit one reply; else (and on a cluster) they are
  // pulled after it, in frames.
  bool pull_in_push = !cluster && pull_after && !pull_after->empty();
  int64_t pull_shm_at = -1;  // ... through shared memory, there
  uint64_t pull_shm_bytes = 0;
  std::vector<uint64_t> pull_in_buffers;  // ... or in place, in the shared buffers
  if (pull_in_push) {
    std::vector<Impl::PullFrame> frames;
    im.PlanPull(chief, *pull_after, &frames);
    pull_in_push = !frames[0].ranged;
    if (!frames[0].in_buffers.empty()) {
      pull_in_buffers = std::move(frames[0].in_buffers);
    } else if (frames[0].to_shm) {
      // The values are written where the gradients were: psd has read the gradients (applied or
      // dropped them) before it answers, so the room is reused and a step touches
      // max(gradients, values) of shared memory, not their sum.
      pull_shm_bytes = Impl::ShmTargetBytes(*pull_after);
      pull_shm_at = im.conn(chief).ShmReserve(pull_shm_bytes);
      pull_in_push = pull_shm_at >= 0;
      im.conn(chief).ShmReset();
    }
  }
  Impl::Calls calls;
  const bool counts_at_chief = im.AppliesOnArrival();

  // Non-chief shards first, the chief (with the token wait) last: its reply comes last.
  std::vector<int> order;
  for (int k = 0; k < im.shards(); ++k) {
    if (k != chief) order.push_back(k);
  }
  order.push_back(chief);
  std::vector<std::vector<size_t>> slots_of_call;
  Impl::Call* token_call = nullptr;
  bool token_only = false;  // token_call is a WaitToken, not a push
  for (int k : order) {
    auto& dense = dense_by[static_cast<size_t>(k)];
    auto& sp = sparse_by[static_cast<size_t>(k)];
    bool waits = wait_token && k == chief;
    if (dense.empty() && sp.empty()) {
      if (counts_at_chief && k == chief) {
        // The chief holds no part of these gradients but counts the step (async/ssp): a push
        // with no gradient, which waits for the ssp barrier if asked.
        proto::Request::Builder req(nullptr);
        Impl::Call& c = im.Add(calls, k, &req, waits ? timeout_ms : 0);
        auto p = req.initPush();
        p.setLocalStep(local_step);
        p.setWaitToken(waits);
        p.setTimeoutMs(timeout_ms);
        p.setClusterEpoch(im.cluster_epoch_.load());
        p.initGrads(0);
        if (waits) token_call = &c;
        slots_of_call.emplace_back();
        continue;
      }
      if (!waits) continue;
      // The chief holds no part of these gradients: wait for the token on its own.
      proto::Request::Builder req(nullptr);
      Impl::Call& c = im.Add(calls, k, &req, timeout_ms);
      req.initWaitToken().setTimeoutMs(timeout_ms);
      token_call = &c;
      token_only = true;
      slots_of_call.emplace_back();
      continue;
    }
    Conn& conn = im.conn(k);
    std::vector<uint64_t> dense_bytes, element_bytes, sparse_rows, sparse_row_bytes;
    std::vector<int64_t> in_buffers;  // per dense part: where it is in the shared buffers, or -1
    for (const DensePart& d : dense) {
      dense_bytes.push_back(d.view.bytes());
      element_bytes.push_back(psd::DTypeSize(d.view.dtype));
      in_buffers.push_back(conn.BufferOffset(d.view.data, d.view.bytes()));
    }
    std::vector<uint64_t> sparse_values, sparse_indices;
    for (const SparseEntry& e : sp) {
      const size_t rows = e.part.indices.size();
      sparse_rows.push_back(rows);
      sparse_row_bytes.push_back((rows ? e.part.bytes / rows : 0) + sizeof(int64_t));
      sparse_values.push_back(e.part.bytes);
      sparse_indices.push_back(e.part.indices.size() * sizeof(int64_t));
    }
    // Same host: the gradients' values go through shared memory and one frame says where they
    // are (with the sparse ones' indices). Else: bigger than a frame, several frames, gradients
    // cut into chunks, the token wait on the last.
    std::vector<internal::FramePlan> frames;
    const bool via_shm = ShmPlan(conn, dense_bytes, in_buffers, sparse_values, sparse_indices, &frames);
    if (!via_shm) {
      frames = internal::PlanFrames(dense_bytes, element_bytes, sparse_rows, sparse_row_bytes, conn.PushFrameLimit(),
                                    conn.chunk_elements);
    }
    for (size_t f = 0; f < frames.size(); ++f) {
      const internal::FramePlan& plan = frames[f];
      const bool last = f + 1 == frames.size();
      proto::Request::Builder req(nullptr);
      Impl::Call& c = im.Add(calls, k, &req, waits && last ? timeout_ms : 0);
      auto p = req.initPush();
      p.setLocalStep(local_step);
      p.setWaitToken(waits && last);
      p.setTimeoutMs(timeout_ms);
      p.setMore(!last);
      if (cluster) p.setClusterEpoch(im.cluster_epoch_.load());
      if (waits && last) token_call = &c;
      if (pull_in_push && last) {
        auto names = p.initPullAfter(static_cast<unsigned>(pull_after->size()));
        for (size_t i = 0; i < pull_after->size(); ++i) names.set(static_cast<unsigned>(i), (*pull_after)[i].first);
        SetWantedDTypes(*pull_after, p.initPullAfterDtypes(static_cast<unsigned>(pull_after->size())));
        if (!pull_in_buffers.empty()) {
          Impl::SetBufferTarget(pull_in_buffers, p.initPullToShm());
        } else if (pull_shm_at >= 0) {
          auto target = p.initPullToShm();
          target.setOffset(static_cast<uint64_t>(pull_shm_at));
          target.setBytes(pull_shm_bytes);
        } else {
          c.landing = Impl::LandingFor(*pull_after);  // one value: read straight into the caller's view
        }
      }
      auto list = p.initGrads(static_cast<unsigned>(plan.dense.size() + plan.sparse.size()));
      slots_of_call.emplace_back();
      for (size_t i = 0; i < plan.dense.size(); ++i) {
        const internal::FramePiece& piece = plan.dense[i];
        const DensePart& d = dense[piece.entry];
        auto e = list[static_cast<unsigned>(i)];
        e.setName(*d.name);
        const ConstTensorView& v = d.view;
        if (via_shm && in_buffers[piece.entry] >= 0) {
          Conn::RefInShm(e.initGrad(), v.dtype, v.shape, 1, static_cast<uint64_t>(in_buffers[piece.entry]));
        } else if (via_shm) {
          conn.PutInShm(e.initGrad(), v.dtype, v.shape, v.data, v.bytes());
        } else if (piece.offset == 0 && piece.bytes == v.bytes()) {
          psd::wire::SetTensor(c.frame.builder, e.initGrad(), v.dtype, v.shape, v.data, v.bytes(), d.padded);
        } else {
          // A chunk: a flat run of the gradient's elements (the last one ends where the whole does).
          size_t es = psd::DTypeSize(v.dtype);
          e.setChunk(true);
          e.setChunkOffset(static_cast<int64_t>(piece.offset / es));
          const uint8_t* at = static_cast<const uint8_t*>(v.data) + piece.offset;
          psd::wire::SetTensor(c.frame.builder, e.initGrad(), v.dtype, {static_cast<int64_t>(piece.bytes / es)}, at,
                               piece.bytes, d.padded || piece.offset + piece.bytes < v.bytes());
        }
        slots_of_call.back().push_back(d.slot);
      }
      for (size_t j = 0; j < plan.sparse.size(); ++j) {
        auto e = list[static_cast<unsigned>(plan.dense.size() + j)];
        const internal::SparsePiece& piece = plan.sparse[j];
        const SparseEntry& entry = sp[piece.entry];
        const SparsePart& part = entry.part;
        // Rows [row_begin, row_end) of it (all of them unless it is bigger than a frame).
        const size_t r0 = piece.row_begin, r1 = piece.row_end, rows = part.indices.size();
        const size_t row_bytes = rows ? part.bytes / rows : 0;
        Shape shape = part.shape;
        if (!shape.empty()) shape[0] = static_cast<int64_t>(r1 - r0);
        const void* values = static_cast<const uint8_t*>(part.values) + r0 * row_bytes;
        e.setName(*entry.name);
        e.setSparse(true);
        e.setRowsMore(r1 < rows);
        auto idx = e.initIndices(static_cast<unsigned>(r1 - r0));
        for (size_t k2 = r0; k2 < r1; ++k2) idx.set(static_cast<unsigned>(k2 - r0), part.indices[k2]);
        if (part.dense_shape) {
          e.setHasDenseShape(true);
          auto ds = e.initDenseShape(static_cast<unsigned>(part.dense_shape->size()));
          for (size_t k2 = 0; k2 < part.dense_shape->size(); ++k2)
            ds.set(static_cast<unsigned>(k2), (*part.dense_shape)[k2]);
        }
        if (via_shm) {
          conn.PutInShm(e.initGrad(), part.dtype, shape, values, (r1 - r0) * row_bytes);
        } else {
          psd::wire::SetTensor(c.frame.builder, e.initGrad(), part.dtype, shape, values, (r1 - r0) * row_bytes);
        }
        slots_of_call.back().push_back(entry.slot);
      }
    }
  }
  PushOutcome out;
  out.waited = wait_token;
  out.results.assign(grads.size() + sparse.size(), {true, INT64_MAX, 0});
  // Each reply is read as it arrives (a shard sent several frames answers each in turn, and a
  // reply's reader lasts until the next reply on its connection).
  Status consumed;
  auto consume = [&](size_t c) -> Status {
    Impl::Call& call = *calls[c];
    if (&call == token_call && token_only) {
      // A plain token wait: its failure is the token's outcome, not the push's.
      if (call.status.ok()) {
        auto t = call.resp.getToken();
        out.token = t.getToken();
        out.is_chief = t.getIsChief();
        out.step_gradients = t.getStepGradients();
      } else if (call.status.code() != Code::kUnavailable || call.sent) {
        out.token_status = call.status;
      }
      return Status::Ok();
    }
    if (!call.status.ok()) return call.status;
    auto r = call.resp.getPush();
    auto results = r.getResults();
    if (results.size() != slots_of_call[c].size()) return psd::Internal("push reply has the wrong number of results");
    for (size_t i = 0; i < slots_of_call[c].size(); ++i) {
      PushResult& res = out.results[slots_of_call[c][i]];
      auto got = results[static_cast<unsigned>(i)];
      res.accepted = res.accepted && got.getAccepted();
      res.step = std::min(res.step, got.getStep());
      res.staleness = std::max(res.staleness, got.getStaleness());
    }
    if (call.shard == chief) {
      out.is_chief = r.getIsChief();
      out.step_gradients = r.getStepGradients();
      if (cluster && r.getChiefShard() >= 0) im.chief_ = r.getChiefShard();
    }
    if (&call == token_call) {
      out.token_status = Status(psd::wire::FromWire(r.getTokenCode()), r.getTokenMessage());
      out.token = r.getToken();
    }
    // A single daemon's reply carries the values: after the token when it waited, else at once.
    if (pull_in_push && (&call == token_call || (!wait_token && r.hasPulled()))) {
      if (r.hasPulled() && out.token_status.ok()) {
        auto step = im.ReadValues(r.getPulled(), *pull_after, &im.conn(chief));
        if (!step.ok()) return step.status();
        out.pulled_step = *step;
      }
    }
    return Status::Ok();
  };
  Status run = im.Run(calls, [&](size_t c) {
    if (!consumed.ok()) return;
    try {
      consumed = consume(c);
    } catch (const kj::Exception& e) {
      consumed = Malformed(e);
    }
  });
  if (!consumed.ok()) return consumed;
  if (!run.ok() && (token_call == nullptr || !out.token_status.ok() || run.code() != out.token_status.code())) {
    // A failure other than the token wait's own outcome.
    bool only_token = token_call != nullptr && !token_call->status.ok();
    for (auto& c : calls) only_token = only_token && (c.get() == token_call || c->status.ok());
    if (!only_token) return run;
  }
  for (auto& r : out.results) {
    if (r.step == INT64_MAX) r.step = 0;
  }
  im.is_chief_ = out.is_chief;
  if (!pull_in_push && out.token_status.ok() && pull_after && !pull_after->empty()) {
    // A cluster's values come from every shard, and big ones in several frames: read them now
    // that the step is in.
    auto step = im.PullLocked(*pull_after, false);
    if (!step.ok()) return step.status();
    out.pulled_step = *step;
  }
  if (after_on_device && out.pulled_step >= 0) PSD_RETURN_IF_ERROR(twins.CopyBack());
  return out;
}

Result<int64_t> Client::WaitToken(int64_t timeout_ms) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  proto::Response::Reader resp;
  PSD_RETURN_IF_ERROR(impl_->CallChief(
      [&](proto::Request::Builder req) { req.initWaitToken().setTimeoutMs(timeout_ms); }, &resp, timeout_ms));
  try {
    auto t = resp.getToken();
    impl_->is_chief_ = t.getIsChief();
    return t.getToken();
  } catch (const kj::Exception& e) {
    return Malformed(e);
  }
}

namespace {

Result<JobStatus> ReadStatus(proto::JobStatus::Reader s) {
  JobStatus st;
  st.global_step = s.getGlobalStep();
  st.is_chief = s.getIsChief();
  st.tokens_queued = s.getTokensQueued();
  st.workers_connected = s.getWorkersConnected();
  st.workers_finished = s.getWorkersFinished();
  st.replicas_required = s.getReplicasRequired();
  st.accepted_pushes = s.getAcceptedPushes();
  st.stale_pushes = s.getStalePushes();
  st.last_step_gradients = s.getLastStepGradients();
  st.max_staleness = s.getMaxStaleness();
  st.learning_rate = s.getLearningRate();
  st.last_checkpoint_step = s.getLastCheckpointStep();
  st.config = ReadConfig(s.getConfig());
  st.shard_index = static_cast<int>(s.getShardIndex());
  st.shards = std::max(1, static_cast<int>(s.getShards()));
  st.chief_shard = s.getChiefShard();
  st.term = s.getTerm();
  st.cluster_epoch = s.getClusterEpoch();
  st.cluster_state = s.getClusterState();
  for (uint32_t m : s.getMissingShards()) st.missing_shards.push_back(static_cast<int>(m));
  st.version = s.getVersion();
  st.uptime_s = s.getUptimeS();
  st.ready = s.getReady();
  return st;
}

}  // namespace

Result<JobStatus> Client::GetShardStatus(int shard) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  if (shard < 0 || shard >= impl_->shards()) return psd::InvalidArgument("no shard " + std::to_string(shard));
  OutFrame frame;
  impl_->conn(shard).NewRequest(frame).setStatus();
  proto::Response::Reader resp;
  PSD_RETURN_IF_ERROR(impl_->Single(shard, frame, &resp));
  try {
    return ReadStatus(resp.getStatus());
  } catch (const kj::Exception& e) {
    return Malformed(e);
  }
}

Result<JobStatus> Client::GetStatus() {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  proto::Response::Reader resp;
  Status s = impl_->CallChief([](proto::Request::Builder req) { req.setStatus(); }, &resp);
  if (!s.ok()) return s;
  try {
    auto st = ReadStatus(resp.getStatus());
    if (st.ok()) impl_->is_chief_ = st->is_chief;
    return st;
  } catch (const kj::Exception& e) {
    return Malformed(e);
  }
}

Result<int64_t> Client::GlobalStep() {
  auto s = GetStatus();
  if (!s.ok()) return s.status();
  return s->global_step;
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
      im.Add(calls, loc->parts[k].shard, &req);
      auto g = req.initGetSlot();
      g.setVariable(variable);
      g.setSlot(slot);
      g.setHasDtype(true);
      g.setDtype(psd::wire::ToWire(out.dtype));
      Piece piece{k};
      if (ranged) {
        piece.offset = off;
        piece.count = std::min(step, n - off);
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
      if (read.ok()) read = im.staging_.FromHost(part.data, t->data, t->bytes, part.memory, part.stream);
    } catch (const kj::Exception& e) {
      read = Malformed(e);
    }
  });
  PSD_RETURN_IF_ERROR(run);
  return read;
}

Status Client::SetLearningRate(double learning_rate) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  proto::Response::Reader resp;
  return impl_->CallChief([&](proto::Request::Builder req) { req.setSetLearningRate(learning_rate); }, &resp);
}

Status Client::RequestCheckpoint() {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  proto::Response::Reader resp;
  return impl_->CallChief([](proto::Request::Builder req) { req.setCheckpoint(); }, &resp);
}

Status Client::Recover(int64_t step, bool empty) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  proto::Response::Reader resp;
  return impl_->CallChief(
      [step, empty](proto::Request::Builder req) {
        auto r = req.initRecover();
        r.setStep(step);
        r.setEmpty(empty);
      },
      &resp);
}

namespace {

// A host copy of a view when it lives on a device (kept alive by `keep`).
ConstTensorView OnHost(internal::DeviceStaging& staging, const ConstTensorView& v,
                       std::deque<std::vector<uint64_t>>* keep, Status* status) {
  if (v.memory == MemoryKind::kHost || v.data == nullptr) return v;
  keep->emplace_back((v.bytes() + 7) / 8);
  *status = staging.ToHost(keep->back().data(), v.data, v.bytes(), v.memory, v.stream);
  ConstTensorView h = v;
  h.data = keep->back().data();
  h.memory = MemoryKind::kHost;
  return h;
}

}  // namespace

Result<ReduceResult> Client::ReduceTo(ReduceOp op, int64_t local_step, ConstTensorView value,
                                      const std::string& destination, TensorView result, int64_t timeout_ms) {
  auto all = BatchReduceTo(op, local_step, {{value, destination, result}}, {0, timeout_ms});
  if (!all.ok()) return all.status();
  return (*all)[0];
}

Result<std::vector<ReduceResult>> Client::BatchReduceTo(ReduceOp op, int64_t local_step,
                                                        const std::vector<ReduceItem>& items,
                                                        const CollectiveHints& hints) {
  if (items.empty()) return psd::InvalidArgument("batch_reduce_to needs at least one value");
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  Impl& im = *impl_;
  std::deque<std::vector<uint64_t>> keep;
  // Every (item, part) goes to its shard; a shard's entries are packed into messages of at most
  // bytes_per_pack. Messages are sent in waves of at most one per shard (all of a wave before
  // any reply is read).
  struct Entry {
    size_t item;
    ConstTensorView value;
    TensorView result;
  };
  std::vector<std::vector<std::vector<Entry>>> packs(static_cast<size_t>(im.shards()));
  for (size_t i = 0; i < items.size(); ++i) {
    Status copied;
    ConstTensorView host = OnHost(im.staging_, items[i].value, &keep, &copied);
    PSD_RETURN_IF_ERROR(copied);
    auto loc = im.Locate(items[i].destination);
    if (!loc.ok()) return loc.status();
    if (loc->sliced && host.shape != loc->shape) {
      return psd::InvalidArgument("reduce_to '" + items[i].destination + "': value is " + psd::ShapeString(host.shape) +
                                  ", the variable " + psd::ShapeString(loc->shape));
    }
    for (size_t k = 0; k < loc->parts.size(); ++k) {
      auto& shard_packs = packs[static_cast<size_t>(loc->parts[k].shard)];
      ConstTensorView part = SliceOf(host, *loc, k);
      uint64_t used = 0;
      if (!shard_packs.empty()) {
        for (const Entry& e : shard_packs.back()) used += e.value.bytes();
      }
      if (shard_packs.empty() || (hints.bytes_per_pack > 0 && used > 0 && used + part.bytes() > hints.bytes_per_pack)) {
        shard_packs.emplace_back();
      }
      TensorView out = items[i].result.data ? SliceOf(items[i].result, *loc, k) : TensorView{};
      shard_packs.back().push_back({i, part, out});
    }
  }
  std::vector<ReduceResult> results(items.size(), {true, INT64_MAX});
  for (size_t wave = 0;; ++wave) {
    Impl::Calls calls;
    std::vector<const std::vector<Entry>*> sent;
    for (int k = 0; k < im.shards(); ++k) {
      const auto& shard_packs = packs[static_cast<size_t>(k)];
      if (wave >= shard_packs.size()) continue;
      proto::Request::Builder req(nullptr);
      Impl::Call& call = im.Add(calls, k, &req, hints.timeout_ms > 0 ? hints.timeout_ms : 60000);
      auto r = req.initReduce();
      r.setOp(op == ReduceOp::kMean ? proto::Reduction::MEAN : proto::Reduction::SUM);
      r.setLocalStep(local_step);
      r.setTimeoutMs(hints.timeout_ms);
      const auto& entries = shard_packs[wave];
      auto list = r.initEntries(static_cast<unsigned>(entries.size()));
      for (size_t e = 0; e < entries.size(); ++e) {
        list[static_cast<unsigned>(e)].setDestination(items[entries[e].item].destination);
        const ConstTensorView& v = entries[e].value;
        psd::wire::SetTensor(call.frame.builder, list[static_cast<unsigned>(e)].initValue(), v.dtype, v.shape, v.data,
                             v.bytes());
      }
      sent.push_back(&entries);
    }
    if (calls.empty()) break;
    PSD_RETURN_IF_ERROR(im.Run(calls));
    try {
      for (size_t c = 0; c < calls.size(); ++c) {
        auto got = calls[c]->resp.getReduce().getResults();
        const auto& entries = *sent[c];
        if (got.size() != entries.size()) return psd::Internal("reduce reply has the wrong number of results");
        for (size_t e = 0; e < entries.size(); ++e) {
          auto g = got[static_cast<unsigned>(e)];
          ReduceResult& r = results[entries[e].item];
          r.accepted = r.accepted && g.getAccepted();
          r.step = std::min(r.step, g.getStep());
          if (entries[e].result.data == nullptr) continue;
          auto t = psd::wire::ReadTensor(g.getValue(), im.options_.max_frame_bytes);
          if (!t.ok()) return t.status();
          PSD_RETURN_IF_ERROR(CheckView("reduce_to result", t->dtype, t->shape, entries[e].result));
          PSD_RETURN_IF_ERROR(im.staging_.FromHost(entries[e].result.data, t->data, t->bytes, entries[e].result.memory,
                                                   entries[e].result.stream));
        }
      }
    } catch (const kj::Exception& e) {
      return Malformed(e);
    }
  }
  return results;
}

Result<bool> Client::Update(const std::string& variable, UpdateOp op, ConstTensorView value,
                            const UpdateOptions& options) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  Impl& im = *impl_;
  std::deque<std::vector<uint64_t>> keep;
  Status copied;
  ConstTensorView host = OnHost(im.staging_, value, &keep, &copied);
  PSD_RETURN_IF_ERROR(copied);
  auto loc = im.Locate(variable);
  if (!loc.ok()) return loc.status();
  if (op != UpdateOp::kScale && loc->sliced && host.shape != loc->shape) {
    return psd::InvalidArgument("update '" + variable + "': value is " + psd::ShapeString(host.shape) +
                                ", the variable " + psd::ShapeString(loc->shape));
  }
  Impl::Calls calls;
  std::vector<bool> last_of_part;  // per call: the update itself (not a chunk answered `none`)
  for (size_t k = 0; k < loc->parts.size(); ++k) {
    // A value bigger than a frame goes in chunks (the daemon updates with the last one); a scale has none.
    const bool valued = op != UpdateOp::kScale;
    ConstTensorView part = valued ? SliceOf(host, *loc, k) : host;
    std::vector<ValueChunk> chunks = valued ? ChunksOf(part, im.conn(loc->parts[k].shard).CreateChunkBytes())
                                            : std::vector<ValueChunk>{ValueChunk{}};
    for (const ValueChunk& chunk : chunks) {
      proto::Request::Builder req(nullptr);
      Impl::Call& call =
          im.Add(calls, loc->parts[k].shard, &req, options.cross_replica || chunk.more ? 0 : options.timeout_ms);
      auto u = req.initUpdate();
      u.setVariable(variable);
      u.setOp(static_cast<proto::UpdateOp>(static_cast<int>(op)));
      if (valued) SetChunk(call.frame.builder, u, u.initValue(), part, chunk);
      u.setFactor(options.factor);
      u.setCrossReplica(options.cross_replica);
      u.setReplica(im.chief().worker_id);
      u.setLocalStep(options.local_step);
      u.setTimeoutMs(options.timeout_ms);
      u.setAtNextStep(options.at_next_step);
      last_of_part.push_back(!chunk.more);
    }
  }
  // Each reply is read as it arrives (a reply's reader lasts until the next on its connection).
  bool applied = true;
  Status read;
  Status run = im.Run(calls, [&](size_t c) {
    if (!read.ok() || !calls[c]->status.ok() || !last_of_part[c]) return;
    try {
      applied = applied && calls[c]->resp.getUpdate().getApplied();
    } catch (const kj::Exception& e) {
      read = Malformed(e);
    }
  });
  PSD_RETURN_IF_ERROR(run);
  PSD_RETURN_IF_ERROR(read);
  return applied;
}

Status Client::BroadcastTo(ConstTensorView value, const std::vector<std::string>& destinations, bool at_next_step) {
  UpdateOptions options;
  options.at_next_step = at_next_step;
  for (const std::string& d : destinations) {
    auto applied = Update(d, UpdateOp::kAssign, value, options);
    if (!applied.ok()) return applied.status();
  }
  return Status::Ok();
}

Result<std::vector<std::string>> Client::WorkerDevices() {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  proto::Response::Reader resp;
  PSD_RETURN_IF_ERROR(impl_->CallChief([](proto::Request::Builder req) { req.setStatus(); }, &resp));
  try {
    std::vector<std::string> out;
    for (auto n : resp.getStatus().getWorkers()) out.emplace_back(n);
    return out;
  } catch (const kj::Exception& e) {
    return Malformed(e);
  }
}

std::vector<std::string> Client::ParameterDevices() const {
  std::vector<std::string> out;
  for (const auto& c : impl_->conns_) out.push_back(c->Where());
  return out;
}

uint64_t Client::requests_sent() const {
  uint64_t n = 0;
  for (const auto& c : impl_->conns_) n += c->requests.load();
  return n;
}

Client::ColocationScope Client::ColocateVarsWith(const std::string& variable) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  std::string previous = impl_->colocate_default_;
  impl_->colocate_default_ = variable;
  return ColocationScope(this, std::move(previous));
}

Client::ColocationScope::~ColocationScope() {
  if (client_ == nullptr) return;
  std::lock_guard<std::mutex> lock(client_->impl_->mu_);
  client_->impl_->colocate_default_ = previous_;
}

Status Client::Finish() {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->Begin();
  // Every shard counts the worker out; the chief's count ends the job (and may stop the shards),
  // so the chief hears it last.
  Status first;
  int chief = impl_->chief_.load();
  for (int k = 0; k <= impl_->shards(); ++k) {
    int shard = k < impl_->shards() ? k : chief;
    if (k < impl_->shards() && k == chief) continue;
    OutFrame frame;
    impl_->conn(shard).NewRequest(frame).setFinish();
    proto::Response::Reader resp;
    Status s = impl_->Single(shard, frame, &resp);
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

}  // namespace psclient
