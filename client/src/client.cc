#include "psclient/client.h"

#include <kj/exception.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "device_memory.h"
#include "wire/frame.h"

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

namespace {

JobConfig ReadConfig(proto::JobConfig::Reader c) {
  JobConfig cfg;
  cfg.replicas_to_aggregate = c.getReplicasToAggregate();
  cfg.total_replicas = c.getTotalReplicas();
  cfg.tokens_per_step = c.getTokensPerStep();
  cfg.init_tokens = c.getInitTokens();
  cfg.optimizer = c.getOptimizer();
  cfg.learning_rate = c.getLearningRate();
  cfg.reduction_sum = c.getReduction() == proto::Reduction::SUM;
  for (auto s : c.getSlotNames()) cfg.slot_names.emplace_back(s);
  cfg.mode = c.getMode();
  cfg.staleness_bound = c.getStalenessBound();
  cfg.soft_sync_fraction = c.getSoftSyncFraction();
  cfg.step_deadline_ms = c.getStepDeadlineMs();
  cfg.ema_decay = c.getEmaDecay();
  return cfg;
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

}  // namespace

class Client::Impl {
 public:
  explicit Impl(ClientOptions options) : options_(std::move(options)), socket_(io_) {}

  Status Connect() {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.connect_timeout_ms);
    boost::system::error_code ec;
    for (;;) {
      // Names are resolved on every try: a restarted daemon (a Kubernetes pod, say) may have
      // come back at another address.
      psd::tcp::resolver resolver(io_);
      auto endpoints = resolver.resolve(options_.host, std::to_string(options_.port), ec);
      socket_ = psd::tcp::socket(io_);
      if (!ec) psd::asio::connect(socket_, endpoints, ec);
      if (!ec) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        return psd::Unavailable("cannot connect to psd at " + options_.host + ":" + std::to_string(options_.port) +
                                ": " + ec.message());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    socket_.set_option(psd::tcp::no_delay(true), ec);
    OutFrame frame;
    auto req = NewRequest(frame);
    auto h = req.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setWorkerName(options_.worker_name);
    h.setIncarnation(options_.incarnation);
    h.setAuthToken(options_.auth_token);
    h.setObserver(options_.observer);
    std::unique_ptr<capnp::MessageReader> reader;
    proto::Response::Reader resp;
    PSD_RETURN_IF_ERROR(RoundTrip(frame, &reader, &resp));
    if (resp.which() != proto::Response::HELLO) return psd::Internal("unexpected reply to hello");
    auto hr = resp.getHello();
    config_ = ReadConfig(hr.getConfig());
    worker_id_ = hr.getWorkerId();
    is_chief_ = hr.getIsChief();
    initial_step_ = hr.getGlobalStep();
    ++epoch_;
    return Status::Ok();
  }

  // Starts a request with a fresh id.
  proto::Request::Builder NewRequest(OutFrame& frame) {
    auto req = frame.builder.initRoot<proto::Request>();
    req.setId(++next_id_);
    return req;
  }

  // Sends `frame`, reads the reply with the same id; a non-OK reply becomes the returned Status.
  // `wait_ms` is how long the daemon may legitimately hold the reply (a token wait); the reply
  // deadline is the longer of request_timeout_ms and wait_ms + 10 s.
  Status RoundTrip(OutFrame& frame, std::unique_ptr<capnp::MessageReader>* reader, proto::Response::Reader* resp,
                   int64_t wait_ms = 0) {
    if (!socket_.is_open()) {
      Status s = Connect();
      if (!s.ok()) return s;
    }
    uint64_t id = frame.builder.getRoot<proto::Request>().getId();
    int64_t limit_ms = std::max<int64_t>(options_.request_timeout_ms, wait_ms > 0 ? wait_ms + 10000 : 0);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(limit_ms);
    Status s = psd::wire::WriteFrame(socket_, frame, deadline);
    if (s.ok()) s = psd::wire::ReadFrame(socket_, in_, options_.max_frame_bytes, deadline);
    if (!s.ok()) {
      // The stream is out of step (or gone): the next call reconnects.
      Drop();
      if (s.code() == psd::Code::kDeadlineExceeded) {
        return psd::DeadlineExceeded("no reply from psd within " + std::to_string(limit_ms) +
                                     " ms; the connection was reset");
      }
      return s;
    }
    try {
      *reader = in_.Reader();
      *resp = (*reader)->getRoot<proto::Response>();
      if (resp->getId() != id) {
        Drop();
        return psd::Internal("reply id " + std::to_string(resp->getId()) + " does not match request " +
                             std::to_string(id));
      }
      if (resp->getCode() != proto::Code::OK) {
        return Status(psd::wire::FromWire(resp->getCode()), resp->getMessage());
      }
    } catch (const kj::Exception& e) {
      Drop();
      return psd::Internal(std::string("malformed reply from psd: ") + e.getDescription().cStr());
    }
    return Status::Ok();
  }

  Result<int64_t> PullInto(const std::vector<std::pair<std::string, TensorView>>& outs, bool averages) {
    if (outs.empty()) return psd::InvalidArgument("Pull needs at least one variable");
    std::lock_guard<std::mutex> lock(mu_);
    OutFrame frame;
    auto req = NewRequest(frame);
    auto pull = req.initPull();
    pull.setAverages(averages);
    auto names = pull.initNames(static_cast<unsigned>(outs.size()));
    for (size_t i = 0; i < outs.size(); ++i) names.set(static_cast<unsigned>(i), outs[i].first);
    std::unique_ptr<capnp::MessageReader> reader;
    proto::Response::Reader resp;
    PSD_RETURN_IF_ERROR(RoundTrip(frame, &reader, &resp));
    return ReadValues(resp, outs);
  }

  Result<int64_t> ReadValues(proto::Response::Reader resp,
                             const std::vector<std::pair<std::string, TensorView>>& outs) {
    try {
      return ReadValues(resp.getPull(), outs);
    } catch (const kj::Exception& e) {
      return psd::Internal(std::string("malformed reply from psd: ") + e.getDescription().cStr());
    }
  }

  // Copies a pull reply's values into the caller's views; returns the step they reflect.
  Result<int64_t> ReadValues(proto::PullReply::Reader p, const std::vector<std::pair<std::string, TensorView>>& outs) {
    try {
      auto values = p.getValues();
      if (values.size() != outs.size()) return psd::Internal("pull reply has the wrong number of values");
      for (size_t i = 0; i < outs.size(); ++i) {
        auto t = psd::wire::ReadTensor(values[static_cast<unsigned>(i)], options_.max_frame_bytes);
        if (!t.ok()) return t.status();
        const TensorView& out = outs[i].second;
        PSD_RETURN_IF_ERROR(CheckView("'" + outs[i].first + "'", t->dtype, t->shape, out));
        if (t->bytes != out.bytes()) return psd::Internal("pull reply for '" + outs[i].first + "' has a wrong size");
        PSD_RETURN_IF_ERROR(internal::CopyFromHost(out.data, t->data, t->bytes, out.memory));
      }
      return p.getStep();
    } catch (const kj::Exception& e) {
      return psd::Internal(std::string("malformed reply from psd: ") + e.getDescription().cStr());
    }
  }

  // A request whose reply carries nothing but its status.
  template <typename Fill>
  Status Call(Fill fill) {
    std::lock_guard<std::mutex> lock(mu_);
    OutFrame frame;
    fill(NewRequest(frame));
    std::unique_ptr<capnp::MessageReader> reader;
    proto::Response::Reader resp;
    return RoundTrip(frame, &reader, &resp);
  }

  void Drop() {
    boost::system::error_code ec;
    socket_.close(ec);
  }

  ClientOptions options_;
  psd::asio::io_context io_;
  psd::tcp::socket socket_;
  InFrame in_;
  uint64_t next_id_ = 0;
  std::mutex mu_;  // serializes calls
  JobConfig config_;
  uint32_t worker_id_ = 0;
  std::atomic<bool> is_chief_{false};
  int64_t initial_step_ = 0;
  std::atomic<uint64_t> epoch_{0};
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  ClientOptions o = options;
  if (o.worker_name.empty()) o.worker_name = "worker-" + std::to_string(::getpid());
  if (o.incarnation == 0) {
    o.incarnation = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  }
  auto impl = std::make_unique<Impl>(std::move(o));
  Status s = impl->Connect();
  if (!s.ok()) return s;
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

const JobConfig& Client::config() const { return impl_->config_; }
uint32_t Client::worker_id() const { return impl_->worker_id_; }
bool Client::is_chief() const { return impl_->is_chief_.load(); }
int64_t Client::initial_global_step() const { return impl_->initial_step_; }
uint64_t Client::connection_epoch() const { return impl_->epoch_.load(); }
std::vector<std::string> Client::SlotNames() const { return impl_->config_.slot_names; }

Result<VariableInfo> Client::CreateVariable(const std::string& name, ConstTensorView initial, bool trainable) {
  VariableOptions options;
  options.trainable = trainable;
  return CreateVariable(name, initial, options);
}

Result<VariableInfo> Client::CreateVariable(const std::string& name, ConstTensorView initial,
                                            const VariableOptions& options) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  OutFrame frame;
  auto req = impl_->NewRequest(frame);
  auto c = req.initCreateVariable();
  c.setName(name);
  c.setTrainable(options.trainable);
  c.setAverage(options.average);
  c.setOptimizer(options.optimizer);
  std::vector<uint8_t> staged;
  const void* data = initial.data;
  size_t bytes = initial.data ? initial.bytes() : 0;
  if (initial.data && initial.memory != MemoryKind::kHost) {
    staged.resize(bytes);
    PSD_RETURN_IF_ERROR(internal::CopyToHost(staged.data(), initial.data, bytes, initial.memory));
    data = staged.data();
  }
  psd::wire::SetTensor(frame.builder, c.initInitial(), initial.dtype, initial.shape, data, bytes);
  std::unique_ptr<capnp::MessageReader> reader;
  proto::Response::Reader resp;
  PSD_RETURN_IF_ERROR(impl_->RoundTrip(frame, &reader, &resp));
  auto v = resp.getVariable();
  auto dtype = psd::wire::FromWire(v.getDtype());
  if (!dtype.ok()) return dtype.status();
  Shape shape;
  for (int64_t d : v.getShape()) shape.push_back(d);
  VariableInfo info{v.getName(), *dtype, std::move(shape), v.getCreated(), v.getTrainable()};
  return info;
}

Result<int64_t> Client::Pull(const std::string& name, TensorView out) { return Pull({{name, out}}); }

Result<int64_t> Client::Pull(const std::vector<std::pair<std::string, TensorView>>& outs) {
  return impl_->PullInto(outs, /*averages=*/false);
}

Result<int64_t> Client::PullAverages(const std::vector<std::pair<std::string, TensorView>>& outs) {
  return impl_->PullInto(outs, /*averages=*/true);
}

Result<int64_t> Client::PullRows(const std::string& name, const std::vector<int64_t>& rows, TensorView out) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  OutFrame frame;
  auto req = impl_->NewRequest(frame);
  auto p = req.initPullRows();
  p.setName(name);
  auto list = p.initRows(static_cast<unsigned>(rows.size()));
  for (size_t i = 0; i < rows.size(); ++i) list.set(static_cast<unsigned>(i), rows[i]);
  std::unique_ptr<capnp::MessageReader> reader;
  proto::Response::Reader resp;
  PSD_RETURN_IF_ERROR(impl_->RoundTrip(frame, &reader, &resp));
  return impl_->ReadValues(resp, {{name, out}});
}

Result<PushOutcome> Client::Push(int64_t local_step, const std::vector<Gradient>& grads, bool wait_token,
                                 int64_t timeout_ms) {
  return Push(local_step, grads, {}, wait_token, timeout_ms);
}

namespace {

// Sorts the rows of a sparse gradient by index and sums repeated rows (the daemon takes strictly
// increasing indices). `values` is host memory.
void Coalesce(const SparseGradient& g, const void* values, std::vector<int64_t>* indices, std::vector<uint64_t>* out) {
  size_t n = g.indices.size();
  size_t row_bytes = n ? g.values.bytes() / n : 0;
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return g.indices[a] < g.indices[b]; });
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
}

}  // namespace

Result<PushOutcome> Client::Push(int64_t local_step, const std::vector<Gradient>& grads,
                                 const std::vector<SparseGradient>& sparse, bool wait_token, int64_t timeout_ms,
                                 const std::vector<std::pair<std::string, TensorView>>* pull_after) {
  if (grads.empty() && sparse.empty()) return psd::InvalidArgument("Must supply at least one variable");
  std::lock_guard<std::mutex> lock(impl_->mu_);
  OutFrame frame;
  auto req = impl_->NewRequest(frame);
  auto p = req.initPush();
  p.setLocalStep(local_step);
  p.setWaitToken(wait_token);
  p.setTimeoutMs(timeout_ms);
  if (pull_after && !pull_after->empty()) {
    auto names = p.initPullAfter(static_cast<unsigned>(pull_after->size()));
    for (size_t i = 0; i < pull_after->size(); ++i) names.set(static_cast<unsigned>(i), (*pull_after)[i].first);
  }
  auto list = p.initGrads(static_cast<unsigned>(grads.size() + sparse.size()));
  std::deque<std::vector<uint64_t>> staged;  // device gradients copied to host, coalesced rows
  for (size_t i = 0; i < grads.size(); ++i) {
    const Gradient& g = grads[i];
    if (g.grad.data == nullptr && g.grad.bytes() > 0) {
      return psd::InvalidArgument("gradient for '" + g.name + "' has no data");
    }
    const void* data = g.grad.data;
    if (g.grad.memory != MemoryKind::kHost) {
      staged.emplace_back((g.grad.bytes() + 7) / 8);
      PSD_RETURN_IF_ERROR(internal::CopyToHost(staged.back().data(), g.grad.data, g.grad.bytes(), g.grad.memory));
      data = staged.back().data();
    }
    auto e = list[static_cast<unsigned>(i)];
    e.setName(g.name);
    psd::wire::SetTensor(frame.builder, e.initGrad(), g.grad.dtype, g.grad.shape, data, g.grad.bytes(),
                         /*padded=*/g.grad.memory != MemoryKind::kHost);
  }
  for (size_t j = 0; j < sparse.size(); ++j) {
    const SparseGradient& g = sparse[j];
    if (g.values.shape.empty() || g.values.shape[0] != static_cast<int64_t>(g.indices.size())) {
      return psd::InvalidArgument("sparse gradient for '" + g.name + "': values need shape [" +
                                  std::to_string(g.indices.size()) + ", row dims...], got " +
                                  psd::ShapeString(g.values.shape));
    }
    if (g.values.data == nullptr && g.values.bytes() > 0) {
      return psd::InvalidArgument("sparse gradient for '" + g.name + "' has no data");
    }
    const void* values = g.values.data;
    if (g.values.memory != MemoryKind::kHost) {
      staged.emplace_back((g.values.bytes() + 7) / 8);
      PSD_RETURN_IF_ERROR(internal::CopyToHost(staged.back().data(), values, g.values.bytes(), g.values.memory));
      values = staged.back().data();
    }
    std::vector<int64_t> indices;
    staged.emplace_back();
    Coalesce(g, values, &indices, &staged.back());
    Shape shape = g.values.shape;
    shape[0] = static_cast<int64_t>(indices.size());
    size_t bytes = static_cast<size_t>(psd::NumElements(shape)) * psd::DTypeSize(g.values.dtype);
    auto e = list[static_cast<unsigned>(grads.size() + j)];
    e.setName(g.name);
    e.setSparse(true);
    auto idx = e.initIndices(static_cast<unsigned>(indices.size()));
    for (size_t k = 0; k < indices.size(); ++k) idx.set(static_cast<unsigned>(k), indices[k]);
    if (g.dense_shape) {
      e.setHasDenseShape(true);
      auto ds = e.initDenseShape(static_cast<unsigned>(g.dense_shape->size()));
      for (size_t k = 0; k < g.dense_shape->size(); ++k) ds.set(static_cast<unsigned>(k), (*g.dense_shape)[k]);
    }
    psd::wire::SetTensor(frame.builder, e.initGrad(), g.values.dtype, shape, staged.back().data(), bytes,
                         /*padded=*/true);
  }
  std::unique_ptr<capnp::MessageReader> reader;
  proto::Response::Reader resp;
  PSD_RETURN_IF_ERROR(impl_->RoundTrip(frame, &reader, &resp, wait_token ? timeout_ms : 0));
  try {
    auto r = resp.getPush();
    PushOutcome out;
    for (auto res : r.getResults()) out.results.push_back({res.getAccepted(), res.getStep(), res.getStaleness()});
    out.is_chief = r.getIsChief();
    out.step_gradients = r.getStepGradients();
    impl_->is_chief_ = out.is_chief;
    out.waited = wait_token;
    if (wait_token) {
      out.token_status = Status(psd::wire::FromWire(r.getTokenCode()), r.getTokenMessage());
      out.token = r.getToken();
    }
    if (pull_after && !pull_after->empty() && r.hasPulled()) {
      auto step = impl_->ReadValues(r.getPulled(), *pull_after);
      if (!step.ok()) return step.status();
      out.pulled_step = *step;
    }
    return out;
  } catch (const kj::Exception& e) {
    return psd::Internal(std::string("malformed reply from psd: ") + e.getDescription().cStr());
  }
}

Result<int64_t> Client::WaitToken(int64_t timeout_ms) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  OutFrame frame;
  auto req = impl_->NewRequest(frame);
  req.initWaitToken().setTimeoutMs(timeout_ms);
  std::unique_ptr<capnp::MessageReader> reader;
  proto::Response::Reader resp;
  PSD_RETURN_IF_ERROR(impl_->RoundTrip(frame, &reader, &resp, timeout_ms));
  auto t = resp.getToken();
  impl_->is_chief_ = t.getIsChief();
  return t.getToken();
}

Result<JobStatus> Client::GetStatus() {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  OutFrame frame;
  auto req = impl_->NewRequest(frame);
  req.setStatus();
  std::unique_ptr<capnp::MessageReader> reader;
  proto::Response::Reader resp;
  PSD_RETURN_IF_ERROR(impl_->RoundTrip(frame, &reader, &resp));
  auto s = resp.getStatus();
  JobStatus st;
  st.global_step = s.getGlobalStep();
  st.is_chief = s.getIsChief();
  impl_->is_chief_ = st.is_chief;
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
  return st;
}

Result<int64_t> Client::GlobalStep() {
  auto s = GetStatus();
  if (!s.ok()) return s.status();
  return s->global_step;
}

Status Client::GetSlot(const std::string& variable, const std::string& slot, TensorView out) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  OutFrame frame;
  auto req = impl_->NewRequest(frame);
  auto g = req.initGetSlot();
  g.setVariable(variable);
  g.setSlot(slot);
  std::unique_ptr<capnp::MessageReader> reader;
  proto::Response::Reader resp;
  PSD_RETURN_IF_ERROR(impl_->RoundTrip(frame, &reader, &resp));
  auto t = psd::wire::ReadTensor(resp.getSlot(), impl_->options_.max_frame_bytes);
  if (!t.ok()) return t.status();
  PSD_RETURN_IF_ERROR(CheckView("slot '" + slot + "' of '" + variable + "'", t->dtype, t->shape, out));
  return internal::CopyFromHost(out.data, t->data, t->bytes, out.memory);
}

Status Client::SetLearningRate(double learning_rate) {
  return impl_->Call([&](proto::Request::Builder req) { req.setSetLearningRate(learning_rate); });
}

Status Client::RequestCheckpoint() {
  return impl_->Call([&](proto::Request::Builder req) { req.setCheckpoint(); });
}

Status Client::Finish() {
  return impl_->Call([&](proto::Request::Builder req) { req.setFinish(); });
}

}  // namespace psclient
