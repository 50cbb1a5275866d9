// Pushes: gradients split by shard, sparse rows coalesced and sliced, each shard's part in one
// frame through shared memory or in frames of chunks over TCP, the token wait and pull_after on
// the chief's last frame; and the plain token wait.
#include <kj/exception.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>

#include "client_impl.h"
#include "frame_plan.h"
#include "psd/half.h"
#include "sparse_check.h"
#include "wire/shm.h"

namespace psclient {

using internal::SetWantedDTypes;
using internal::SliceOf;

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

// The frames a shard's part of a push takes when its gradients' values go through shared memory
// (dense gradients, and sparse ones' rows; their indices stay in the frame): false (plan over
// TCP) unless the connection has a segment with room for all the values and the indices fit a
// frame. Gradients in the shared buffers (in_buffers, sparse_in_buffers >= 0) take no room: psd
// reads them in place. One frame, unless the bytes to copy into the segment are more than
// Conn::ShmPieceBytes and all dense: then pieces of about that size, chunks of the gradients as
// over TCP, each frame sent as soon as its piece is copied (Call::copies), so that psd adds piece
// k while the client copies piece k+1 in.
bool ShmPlan(const Conn& conn, const std::vector<uint64_t>& dense_bytes, const std::vector<uint64_t>& element_bytes,
             const std::vector<int64_t>& in_buffers, const std::vector<uint64_t>& sparse_values,
             const std::vector<int64_t>& sparse_in_buffers, const std::vector<uint64_t>& sparse_indices,
             std::vector<internal::FramePlan>* frames) {
  if (!conn.shm || (dense_bytes.empty() && sparse_values.empty())) return false;
  uint64_t need = 0, in_frame = 0;
  for (size_t i = 0; i < dense_bytes.size(); ++i) need += in_buffers[i] >= 0 ? 0 : psd::wire::ShmAlign(dense_bytes[i]);
  for (size_t j = 0; j < sparse_values.size(); ++j) {
    need += sparse_in_buffers[j] >= 0 ? 0 : psd::wire::ShmAlign(sparse_values[j]);
  }
  for (uint64_t b : sparse_indices) in_frame += b + internal::kFrameEntryOverhead;
  const uint64_t limit = conn.PushFrameLimit();
  if (!conn.ShmFits(need) || (limit > 0 && in_frame + Conn::kFrameSlack > limit)) return false;
  const uint64_t piece = conn.ShmPieceBytes();
  const bool copies_all = std::all_of(in_buffers.begin(), in_buffers.end(), [](int64_t at) { return at < 0; });
  if (piece > 0 && need > piece && sparse_values.empty() && copies_all) {
    *frames = internal::PlanFrames(dense_bytes, element_bytes, {}, {}, piece, conn.chunk_elements);
    return true;
  }
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
  // Device gradients copied to host, coalesced rows. Each one's data() stays put as more are added
  // (a moved vector keeps its buffer), and a vector allocates nothing until it is used (a deque
  // allocates even when empty).
  std::vector<std::vector<uint64_t>> staged;
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
    // Rows already in increasing order (distinct) go as they are, from the caller's memory (in
    // place from shared buffers); else sorted and coalesced into a copy.
    std::vector<int64_t> indices;
    DType rows_dtype = g.values.dtype;
    const uint8_t* rows = static_cast<const uint8_t*>(values);
    if (std::adjacent_find(g.indices.begin(), g.indices.end(), std::greater_equal<int64_t>()) == g.indices.end()) {
      indices = g.indices;
    } else {
      staged.emplace_back();
      rows_dtype = Coalesce(g, values, &indices, &staged.back());
      rows = reinterpret_cast<const uint8_t*>(staged.back().data());
    }
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
        // A slice with no rows gets an empty gradient all the same: each slice counts its own
        // gradients towards a step, as TensorFlow's partitioned variables do.
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
    pull_in_push = !frames[0].ranged;  // ranges (over TCP, or pieces through shared memory): after the token
    if (!frames[0].in_buffers.empty()) {
      pull_in_buffers = std::move(frames[0].in_buffers);
    } else if (pull_in_push && frames[0].to_shm) {
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
      auto wait = req.initWaitToken();
      wait.setTimeoutMs(timeout_ms);
      // The token of the step these pushes go into, not one an earlier step left for a slower
      // worker whose wait has not reached the chief yet (TokenQueue).
      wait.setAfterStep(local_step);
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
    std::vector<int64_t> sparse_in_buffers;  // per sparse part: where its rows are in the shared buffers, or -1
    for (const SparseEntry& e : sp) {
      sparse_in_buffers.push_back(conn.BufferOffset(e.part.values, e.part.bytes));
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
    const bool via_shm = ShmPlan(conn, dense_bytes, element_bytes, in_buffers, sparse_values, sparse_in_buffers,
                                 sparse_indices, &frames);
    if (!via_shm) {
      frames = internal::PlanFrames(dense_bytes, element_bytes, sparse_rows, sparse_row_bytes, conn.PushFrameLimit(),
                                    conn.chunk_elements);
    }
    // In pieces through shared memory: each gradient's room is taken now, its pieces copied there
    // as their frames go out.
    std::vector<int64_t> shm_room;
    if (via_shm && frames.size() > 1) {
      for (uint64_t b : dense_bytes) shm_room.push_back(conn.ShmReserve(b));
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
          target.setValues(im.conn(chief).values != nullptr);
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
        } else if (via_shm && !shm_room.empty()) {
          // A piece: a chunk of the gradient (or the whole of a small one) at its place in the room.
          const uint64_t at = static_cast<uint64_t>(shm_room[piece.entry]) + piece.offset;
          const bool whole = piece.offset == 0 && piece.bytes == v.bytes();
          const size_t es = psd::DTypeSize(v.dtype);
          if (!whole) {
            e.setChunk(true);
            e.setChunkOffset(static_cast<int64_t>(piece.offset / es));
          }
          Conn::RefInShm(e.initGrad(), v.dtype, whole ? v.shape : Shape{static_cast<int64_t>(piece.bytes / es)}, 0, at);
          if (piece.bytes > 0) {
            c.copies.push_back({conn.shm->data() + at, static_cast<const uint8_t*>(v.data) + piece.offset,
                                static_cast<size_t>(piece.bytes)});
          }
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
        if (via_shm && sparse_in_buffers[piece.entry] >= 0) {
          Conn::RefInShm(e.initGrad(), part.dtype, shape, 1, static_cast<uint64_t>(sparse_in_buffers[piece.entry]));
        } else if (via_shm) {
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
      } else if (call.sent) {
        out.token_status = call.status;
      } else {
        // Never sent (the chief is unreachable): the gradients went in, the token did not come.
        // Not OK with token 0, which would set the caller's local step back to 0.
        out.token_status = Status(call.status.code(), call.status.message() +
                                                          "; the gradients were pushed but the token wait was not "
                                                          "sent: wait for the token (Client::WaitToken) before the "
                                                          "next push");
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
      if (cluster && r.getChiefShard() >= 0 && r.getChiefShard() < im.shards()) im.chief_ = r.getChiefShard();
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

}  // namespace psclient
