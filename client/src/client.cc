// The public psclient::Client calls that are neither pulls (pull.cc) nor pushes (push.cc):
// connecting, the job's configuration, shared buffers, placements, creating variables, status,
// checkpoints, collectives and updates. Client::Impl is in client_impl.h.
#include <capnp/dynamic.h>
#include <kj/exception.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>

#include "client_impl.h"
#include "psd/cluster_list.h"

namespace psclient {

int PushOutcome::accepted() const {
  int n = 0;
  for (const auto& r : results) n += r.accepted ? 1 : 0;
  return n;
}

int PushOutcome::stale() const { return static_cast<int>(results.size()) - accepted(); }

using internal::CheckView;
using internal::HumanBytes;
using internal::ReadConfig;
using internal::ReadPlacement;
using internal::SliceOf;
using internal::WritePlacement;

namespace {

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
int Client::shared_memory_lanes() const {
  int n = 0;
  for (int k = 0; k < impl_->shards(); ++k) {
    std::lock_guard<std::mutex> lock(impl_->conn(k).shm_mu);
    n += impl_->conn(k).shm && impl_->conn(k).on_lane() ? 1 : 0;
  }
  return n;
}
std::string Client::shared_memory_status() const {
  std::string out;
  for (int k = 0; k < impl_->shards(); ++k) {
    const auto& c = impl_->conn(k);
    std::lock_guard<std::mutex> lock(c.shm_mu);
    std::string why = c.shm ? c.buffers_status : c.shm_status;
    if (c.shm && !c.lane_status.empty()) why += (why.empty() ? "" : "; ") + c.lane_status;
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
      auto loc = ReadPlacement(resp.getPlacement(), im.shards());
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
  for (auto a : s.getShardAddresses()) st.shard_addresses.emplace_back(a.cStr());
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
  proto::Response::Reader resp;
  PSD_RETURN_IF_ERROR(impl_->AskStatus(shard, &resp));
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
    // Every result of the wave is checked before any is written (one call per shard: the replies
    // all stay readable until the next wave): a reply that does not fit its view writes nothing.
    struct Copy {
      const Entry* entry;
      psd::wire::TensorRef value;
    };
    std::vector<Copy> copies;
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
          // The data's own length, not only its shape, must be the view's: it is what is copied.
          if (t->bytes != entries[e].result.bytes()) {
            return psd::Internal("reduce reply for '" + items[entries[e].item].destination + "' has a wrong size");
          }
          copies.push_back({&entries[e], std::move(*t)});
        }
      }
    } catch (const kj::Exception& e) {
      return Malformed(e);
    }
    for (const Copy& cp : copies) {
      const TensorView& out = cp.entry->result;
      PSD_RETURN_IF_ERROR(im.staging_.FromHost(out.data, cp.value.data, cp.value.bytes, out.memory, out.stream));
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
  std::lock_guard<std::mutex> lock(impl_->mu_);  // a call's RefreshChief may retarget a shard meanwhile
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
