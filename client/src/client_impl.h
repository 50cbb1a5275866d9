// Client::Impl: what stands behind a psclient::Client — one connection per shard (conn.h), the
// batch of requests one public call sends and reads (Call, Run), who the chief is, where each
// variable lives, the shared buffers and the device views' pinned twins. Its methods and the
// public calls are defined by job: client_impl.cc (connections, the chief, placements), pull.cc
// (planning and reading pulls, PullRows, GetSlot), push.cc (pushes and the token) and client.cc
// (everything else: creation, status, collectives, updates).
//
// Thread-safety: a public call holds mu_ for its whole length; what is not atomic is guarded by it.
#ifndef PSCLIENT_SRC_CLIENT_IMPL_H_
#define PSCLIENT_SRC_CLIENT_IMPL_H_

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "base/thread_pool.h"
#include "conn.h"
#include "device_memory.h"
#include "psclient/client.h"
#include "shared_arena.h"
#include "wire/frame.h"

namespace psclient {

namespace proto = psd::proto;
using internal::Conn;
using internal::FromShard;
using internal::Malformed;
using psd::wire::OutFrame;

namespace internal {

// Asks the daemon to deliver each value in its view's dtype (it converts halves and float32 both ways).
void SetWantedDTypes(const std::vector<std::pair<std::string, TensorView>>& outs, capnp::List<proto::DType>::Builder b);
// OK when `out` is a view of `want_dtype`/`want_shape` with memory; else INVALID_ARGUMENT naming `what`.
Status CheckView(const std::string& what, DType want_dtype, const Shape& want_shape, const TensorView& out);
// The placement in `r`, checked against a cluster of `shards` (INTERNAL when it is not one this
// client can follow).
Result<VariablePlacement> ReadPlacement(proto::VariablePlacement::Reader r, int shards);
void WritePlacement(proto::VariablePlacement::Builder b, const VariablePlacement& p);

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

}  // namespace internal

class Client::Impl {
 public:
  // One connection per shard (not yet connected: ConnectAll), sharing the client's shared buffers.
  explicit Impl(ClientOptions options);

  Status ConnectAll();
  // INVALID_ARGUMENT when the shard at `c` says the cluster has another number of shards.
  Status CheckShardCount(const Conn& c) const;

  // A cluster that is electing its chief or restoring a checkpoint does not serve yet: a trainer
  // that just connected waits for it (up to connect_timeout_ms) rather than failing its set-up.
  Status WaitUntilServing();
  // Shard `shard`'s status (psd_admin status's answer), into *resp.
  Status AskStatus(int shard, proto::Response::Reader* resp);
  // "" when every shard but the chief serves workers at `epoch`, else what one of them waits for.
  std::string OthersServing(uint64_t epoch);

  bool cluster() const { return conns_.size() > 1; }
  // Async/ssp on a cluster: shards apply pushes as they come, each at its own count; the chief's
  // is the global step, and every push reaches it (coordinator.h on the daemon).
  bool AppliesOnArrival() const;
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
    // The values its reply carries in the frame (a pull's over TCP; 0 for small answers and for
    // values in shared memory): Run reads replies before it sends more once a connection's unread
    // ones could exceed Conn::ReplyWindow.
    uint64_t reply_bytes = 0;
    // Bytes copied into the shared-memory segment just before the frame is sent (a push in
    // pieces: the copy of this piece overlaps psd's work on the frames before it).
    struct ShmCopy {
      uint8_t* dst;
      const void* src;
      size_t bytes;
    };
    std::vector<ShmCopy> copies;
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
  // A shard's replies are read before its next request goes out once those unread could hold more
  // than Conn::ReplyWindow (a big lookup's): `each` may then come for a later call before an
  // earlier one of another shard, but always in order within a shard.
  Status Run(Calls& calls, const std::function<void(size_t)>& each = {});

  Status Single(int shard, OutFrame& frame, proto::Response::Reader* resp, int64_t wait_ms = 0) {
    return FromShard(conn(shard).RoundTrip(frame, resp, wait_ms), conn(shard), cluster());
  }

  // A block of the shared buffers (AllocateShared, and device views' twins).
  Result<SharedBuffer> NewShared(size_t bytes);

  // Called first by every public call (mu_ held): learns a new chief if the last call suggested one.
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

  // Shard k's reply is late: asks another shard, over a connection of its own, whether the cluster
  // serves k elsewhere now (a takeover) or counts it gone while it does not serve; UNAVAILABLE
  // saying so if it does (the caller gives the reply up), else OK (wait on). Conn::stall_check.
  Status CheckStalled(int k);

  // Asks the shards who the chief is and where each shard is served now (the answer of the
  // highest term wins); connections to a shard served elsewhere move there.
  void RefreshChief();

  // Where `name` lives (mu_ held). A single daemon holds everything whole.
  Result<VariablePlacement> Locate(const std::string& name);

  // The chief's placement map (asked again, once, after a refresh of who the chief is).
  Result<PlacementMap> FetchMap();

  // Copies a pull reply's values into the caller's views; returns the step they reflect.
  // `from`: the connection it came on (its shared memory holds values sent that way).
  Result<int64_t> ReadValues(proto::PullReply::Reader p, const std::vector<std::pair<std::string, TensorView>>& outs,
                             Conn* from);
  // A pull reply that named values in psd's values segment: they were read (or will not be), so
  // psd may let go of them (Conn::ValuesRead). ReadValues does it whatever its outcome.
  void LetGoOfValues(proto::PullReply::Reader p, Conn* from);

  // The caller's views split by shard: per shard, (name, view of that shard's part).
  using Outs = std::vector<std::pair<std::string, TensorView>>;

  // One call's host twins of its device views (the caller holds mu_): a block of the shared
  // buffers, pinned, that a same-host psd reads gradients from or writes values into in place,
  // and that the GPU copies to or from in one DMA (no staging copies). Where there is none (no
  // shared buffers, no room, a CPU-only build) the views take the staging path.
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
      // Host views only (the common case): nothing to copy.
      if (std::all_of(outs.begin(), outs.end(),
                      [](const auto& o) { return o.second.memory == MemoryKind::kHost || o.second.data == nullptr; })) {
        return false;
      }
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

  Status SplitOuts(const Outs& outs, std::vector<Outs>* per_shard);

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
    std::vector<Shape> whole_shapes = {};  // ranged: each one's whole view (psd checks the value's shape)
  };

  // Where each of `outs` is in shard k's shared buffers, when all are (host memory the connection
  // has attached), else empty: the daemon then writes the values in place.
  std::vector<uint64_t> BufferOffsets(int k, const Outs& outs);
  // Asks for the values written at `offsets` of the shared buffers (segment 1).
  static void SetBufferTarget(const std::vector<uint64_t>& offsets, proto::ShmTarget::Builder target);

  // The room a pull of `outs` takes in shared memory: each value at a multiple of 64 bytes.
  static uint64_t ShmTargetBytes(const Outs& outs);
  // Asks for `outs` in shard k's shared memory (room reserved now), when it has room.
  template <typename B>
  bool SetShmTarget(int k, const Outs& outs, B target) {
    const uint64_t need = ShmTargetBytes(outs);
    int64_t at = conn(k).ShmReserve(need);
    if (at < 0) return false;
    target.setOffset(static_cast<uint64_t>(at));
    target.setBytes(need);
    target.setValues(conn(k).values != nullptr);
    return true;
  }

  // The frames that read `outs` from shard k: one, or (the values bigger than a reply frame)
  // several that ask for element ranges of whole parts.
  void PlanPull(int k, const Outs& outs, std::vector<PullFrame>* frames);

  // Where a reply that carries `outs` may land: the one value's host memory (a multiple of 8
  // bytes; ReadFrameWith checks the alignment), else nowhere.
  static psd::wire::Landing LandingFor(const Outs& outs);

  // Pulls (mu_ held): one request per shard holding a part, or several for values bigger than a
  // reply; every reply must be at the same step (a pull racing a commit is read again).
  Result<int64_t> PullLocked(const Outs& outs, bool averages);
  Result<int64_t> PullViewsLocked(const Outs& outs, bool averages);

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
  // Helpers of big copies into and out of the shared-memory segments (ClientOptions::copy_threads).
  psd::ThreadPool copy_pool_;
  std::shared_ptr<internal::SharedArena> arena_;  // the shared buffers (null: none)
  Status arena_status_;                           // why there is no arena, when it failed
  std::vector<std::unique_ptr<Conn>> conns_;
  // CheckStalled's connection (an observer's: no worker slot, no shared memory) and the shard it
  // goes to; guarded by mu_. probe_options_ outlives it (a Conn keeps a reference).
  ClientOptions probe_options_;
  std::unique_ptr<Conn> probe_;
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

}  // namespace psclient

#endif  // PSCLIENT_SRC_CLIENT_IMPL_H_
