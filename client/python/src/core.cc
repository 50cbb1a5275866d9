// psclient._core: the Python binding of libpsclient (README "Python").
//
// Uses only libpsclient's public headers (psclient/*.h, psd/*.h), so it builds against an
// installed libpsclient too. Conventions:
// - Every psd::Status that is not OK becomes an exception of psclient._errors (one class per
//   code, carrying the code and the message); bad Python argument types raise TypeError.
// - Tensors are numpy arrays (anything with the buffer protocol: C-contiguous float32, float64 or
//   float16) or psclient.RawTensor (a raw pointer: bfloat16, CUDA memory). Views are built over
//   the caller's memory — no copies: a pull writes into the caller's array, a push reads from it.
//   The exported buffers are held until the call returns, so numpy cannot resize them meanwhile.
// - The GIL is released during every call that talks to the daemon.
// - A Client may be shared between threads (libpsclient serializes the calls). close() drops this
//   object's reference: calls already running on other threads finish first; later calls raise
//   FailedPrecondition.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "convert.h"

using namespace psclient_py;  // NOLINT: the conversions this module is made of

namespace {

// The Client constructor's keyword arguments as libpsclient's options.
psclient::ClientOptions MakeOptions(const std::string& host, int port, py::object cluster, py::object worker_name,
                                    uint64_t incarnation, int connect_timeout_ms, int64_t request_timeout_ms,
                                    uint64_t max_frame_bytes, uint64_t push_frame_bytes, uint64_t pull_frame_bytes,
                                    int64_t busy_poll_us, bool observer, py::object auth_token, bool tls,
                                    py::object tls_ca_file, py::object tls_cert_file, py::object tls_key_file,
                                    py::object tls_server_name, uint64_t shared_memory_bytes,
                                    uint64_t shared_buffer_bytes, uint64_t shm_piece_bytes, int copy_threads,
                                    bool shm_lane) {
  if (port < 0 || port > 65535) RaiseInvalid("port " + std::to_string(port) + " is outside 0..65535");
  // Any object's str() (a pathlib.Path, say).
  auto str = [](py::object o, const char* what) { return o.is_none() ? std::string() : ToString(py::str(o), what); };
  psclient::ClientOptions o;
  o.host = host;
  o.port = static_cast<uint16_t>(port);
  o.cluster = ClusterEntries(cluster);
  o.worker_name = str(worker_name, "worker_name");
  o.incarnation = incarnation;
  o.connect_timeout_ms = connect_timeout_ms;
  o.request_timeout_ms = request_timeout_ms;
  o.max_frame_bytes = max_frame_bytes;
  o.push_frame_bytes = push_frame_bytes;
  o.pull_frame_bytes = pull_frame_bytes;
  o.busy_poll_us = busy_poll_us;
  o.shared_memory_bytes = shared_memory_bytes;
  o.shared_buffer_bytes = shared_buffer_bytes;
  o.shm_piece_bytes = shm_piece_bytes;
  o.shm_lane = shm_lane;
  if (copy_threads < 0 || copy_threads > 64) {
    RaiseInvalid("copy_threads " + std::to_string(copy_threads) + " is outside 0..64");
  }
  o.copy_threads = copy_threads;
  o.observer = observer;
  o.auth_token = str(auth_token, "auth_token");
  o.tls = tls;
  o.tls_ca_file = str(tls_ca_file, "tls_ca_file");
  o.tls_cert_file = str(tls_cert_file, "tls_cert_file");
  o.tls_key_file = str(tls_key_file, "tls_key_file");
  o.tls_server_name = str(tls_server_name, "tls_server_name");
  return o;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "psclient's binding of libpsclient (see the psclient package)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object error = ErrorObject(e.status());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    }
  });

  m.def(
      "code_name", [](int code) { return std::string(psd::CodeName(static_cast<psd::Code>(code))); }, py::arg("code"),
      "psd's name of a status code number (psd::CodeName).");
  m.def(
      "_raise_status",
      [](int code, const std::string& message) { Raise(psd::Status(static_cast<psd::Code>(code), message)); },
      py::arg("code"), py::arg("message"), "Raises what a libpsclient call failing with this status raises (tests).");
  m.def(
      "dtype_size", [](const std::string& dtype) { return psd::DTypeSize(ParseDTypeOrRaise(dtype)); },
      py::arg("dtype"));
  m.def("parse_cluster_list", &psclient::ParseClusterList, py::arg("cluster"),
        "'h:p,h:p,...' (psd's --cluster syntax) as a list of entries.");

  py::class_<RawTensor>(m, "RawTensor",
                        "A tensor at a raw address: bfloat16 host memory, or CUDA device memory "
                        "(device='cuda', ordered on `stream`, a cudaStream_t as an int). The caller keeps the "
                        "memory alive and unchanged during the call; `owner` is kept alive as long as this.")
      .def(py::init([](uintptr_t ptr, const std::string& dtype, py::object shape, const std::string& device,
                       uintptr_t stream, py::object owner) {
             RawTensor t;
             t.ptr = ptr;
             t.dtype = ParseDTypeOrRaise(dtype);
             t.shape = ToInt64s(shape, "RawTensor shape");
             // Negative dimensions, and sizes whose element or byte count would not fit an int64
             // (nbytes and every view's size are computed from it).
             if (psd::Status v = psd::ValidateShape(t.shape, t.dtype, INT64_MAX); !v.ok()) {
               RaiseInvalid("RawTensor: " + v.message());
             }
             if (device == "cpu") {
               t.memory = psd::MemoryKind::kHost;
             } else if (device.rfind("cuda", 0) == 0) {
               t.memory = psd::MemoryKind::kCuda;
             } else {
               RaiseInvalid("RawTensor device '" + device + "': use 'cpu' or 'cuda'");
             }
             if (ptr == 0 && psd::NumElements(t.shape) > 0) RaiseInvalid("RawTensor: a null pointer with elements");
             t.stream = stream;
             t.owner = std::move(owner);
             return t;
           }),
           py::arg("ptr"), py::arg("dtype"), py::arg("shape"), py::arg("device") = "cpu", py::arg("stream") = 0,
           py::arg("owner") = py::none())
      .def_readonly("ptr", &RawTensor::ptr)
      .def_property_readonly("dtype", [](const RawTensor& t) { return std::string(psd::DTypeName(t.dtype)); })
      .def_property_readonly("shape", [](const RawTensor& t) { return ShapeTuple(t.shape); })
      .def_property_readonly("device",
                             [](const RawTensor& t) { return t.memory == psd::MemoryKind::kCuda ? "cuda" : "cpu"; })
      .def_readonly("stream", &RawTensor::stream)
      .def_readonly("owner", &RawTensor::owner)
      .def_property_readonly("nbytes",
                             [](const RawTensor& t) { return psd::NumElements(t.shape) * psd::DTypeSize(t.dtype); })
      .def("__repr__", [](const RawTensor& t) {
        return "RawTensor(ptr=" + std::to_string(t.ptr) + ", dtype='" + psd::DTypeName(t.dtype) +
               "', shape=" + psd::ShapeString(t.shape) + ", device='" +
               (t.memory == psd::MemoryKind::kCuda ? "cuda" : "cpu") + "')";
      });

  py::class_<psclient::JobConfig>(m, "JobConfig", "The daemon's job settings, as announced in the handshake.")
      .def_readonly("replicas_to_aggregate", &psclient::JobConfig::replicas_to_aggregate)
      .def_readonly("total_replicas", &psclient::JobConfig::total_replicas)
      .def_readonly("tokens_per_step", &psclient::JobConfig::tokens_per_step)
      .def_readonly("init_tokens", &psclient::JobConfig::init_tokens)
      .def_property_readonly("optimizer", [](const psclient::JobConfig& c) { return Text(c.optimizer); })
      .def_readonly("learning_rate", &psclient::JobConfig::learning_rate)
      .def_readonly("reduction_sum", &psclient::JobConfig::reduction_sum)
      .def_property_readonly("slot_names", [](const psclient::JobConfig& c) { return Texts(c.slot_names); })
      .def_property_readonly("mode", [](const psclient::JobConfig& c) { return Text(c.mode); })
      .def_readonly("staleness_bound", &psclient::JobConfig::staleness_bound)
      .def_readonly("soft_sync_fraction", &psclient::JobConfig::soft_sync_fraction)
      .def_readonly("step_deadline_ms", &psclient::JobConfig::step_deadline_ms)
      .def_readonly("ema_decay", &psclient::JobConfig::ema_decay)
      .def("__repr__", [](const psclient::JobConfig& c) {
        return Text("JobConfig(replicas_to_aggregate=" + std::to_string(c.replicas_to_aggregate) +
                    ", total_replicas=" + std::to_string(c.total_replicas) + ", optimizer='" + c.optimizer +
                    "', mode='" + c.mode + "', learning_rate=" + std::to_string(c.learning_rate) + ")");
      });

  py::class_<psclient::JobStatus>(m, "JobStatus", "GetStatus(): the job as the answering shard sees it.")
      .def_readonly("global_step", &psclient::JobStatus::global_step)
      .def_readonly("is_chief", &psclient::JobStatus::is_chief)
      .def_readonly("tokens_queued", &psclient::JobStatus::tokens_queued)
      .def_readonly("workers_connected", &psclient::JobStatus::workers_connected)
      .def_readonly("workers_finished", &psclient::JobStatus::workers_finished)
      .def_readonly("replicas_required", &psclient::JobStatus::replicas_required)
      .def_readonly("accepted_pushes", &psclient::JobStatus::accepted_pushes)
      .def_readonly("stale_pushes", &psclient::JobStatus::stale_pushes)
      .def_readonly("last_step_gradients", &psclient::JobStatus::last_step_gradients)
      .def_readonly("max_staleness", &psclient::JobStatus::max_staleness)
      .def_readonly("learning_rate", &psclient::JobStatus::learning_rate)
      .def_readonly("last_checkpoint_step", &psclient::JobStatus::last_checkpoint_step)
      .def_readonly("config", &psclient::JobStatus::config)
      .def_readonly("shard_index", &psclient::JobStatus::shard_index)
      .def_readonly("shards", &psclient::JobStatus::shards)
      .def_readonly("chief_shard", &psclient::JobStatus::chief_shard)
      .def_readonly("term", &psclient::JobStatus::term)
      .def_readonly("cluster_epoch", &psclient::JobStatus::cluster_epoch)
      .def_property_readonly("cluster_state", [](const psclient::JobStatus& s) { return Text(s.cluster_state); })
      .def_readonly("missing_shards", &psclient::JobStatus::missing_shards)
      .def_property_readonly("version", [](const psclient::JobStatus& s) { return Text(s.version); })
      .def_readonly("uptime_s", &psclient::JobStatus::uptime_s)
      .def_readonly("ready", &psclient::JobStatus::ready)
      .def("__repr__", [](const psclient::JobStatus& s) {
        return Text("JobStatus(global_step=" + std::to_string(s.global_step) + ", workers_connected=" +
                    std::to_string(s.workers_connected) + ", workers_finished=" + std::to_string(s.workers_finished) +
                    ", accepted_pushes=" + std::to_string(s.accepted_pushes) +
                    ", stale_pushes=" + std::to_string(s.stale_pushes) + ", cluster_state='" + s.cluster_state + "')");
      });

  py::class_<psclient::VariableInfo>(m, "VariableInfo")
      .def_property_readonly("name", [](const psclient::VariableInfo& v) { return Text(v.name); })
      .def_property_readonly("dtype",
                             [](const psclient::VariableInfo& v) { return std::string(psd::DTypeName(v.dtype)); })
      .def_property_readonly("shape", [](const psclient::VariableInfo& v) { return ShapeTuple(v.shape); })
      .def_readonly("created", &psclient::VariableInfo::created)
      .def_readonly("trainable", &psclient::VariableInfo::trainable)
      .def("__repr__", [](const psclient::VariableInfo& v) {
        return Text("VariableInfo(name='" + v.name + "', dtype='" + psd::DTypeName(v.dtype) +
                    "', shape=" + psd::ShapeString(v.shape) + ", created=" + (v.created ? "True" : "False") +
                    ", trainable=" + (v.trainable ? "True" : "False") + ")");
      });

  py::class_<psclient::SlicePart>(m, "SlicePart")
      .def_readonly("shard", &psclient::SlicePart::shard)
      .def_readonly("row_begin", &psclient::SlicePart::row_begin)
      .def_readonly("row_end", &psclient::SlicePart::row_end);
  py::class_<psclient::VariablePlacement>(m, "VariablePlacement")
      .def_property_readonly("name", [](const psclient::VariablePlacement& v) { return Text(v.name); })
      .def_property_readonly("dtype",
                             [](const psclient::VariablePlacement& v) { return std::string(psd::DTypeName(v.dtype)); })
      .def_property_readonly("shape", [](const psclient::VariablePlacement& v) { return ShapeTuple(v.shape); })
      .def_readonly("sliced", &psclient::VariablePlacement::sliced)
      .def_readonly("parts", &psclient::VariablePlacement::parts);
  py::class_<psclient::PlacementMap>(m, "PlacementMap")
      .def_readonly("variables", &psclient::PlacementMap::variables)
      .def_readonly("shard_bytes", &psclient::PlacementMap::shard_bytes);

  py::class_<psclient::PushResult>(m, "PushResult")
      .def_readonly("accepted", &psclient::PushResult::accepted)
      .def_readonly("step", &psclient::PushResult::step)
      .def_readonly("staleness", &psclient::PushResult::staleness)
      .def("__repr__", [](const psclient::PushResult& r) {
        return std::string("PushResult(accepted=") + (r.accepted ? "True" : "False") +
               ", step=" + std::to_string(r.step) + ", staleness=" + std::to_string(r.staleness) + ")";
      });
  py::class_<PushOutcome>(m, "PushOutcome",
                          "What push() did: one PushResult per gradient (dense first, then sparse); with "
                          "wait_token, token_status is None (token holds the new local step) or the "
                          "psclient.Error the wait ended with (DeadlineExceeded, OutOfRange, ...): not raised.")
      .def_readonly("results", &PushOutcome::results)
      .def_readonly("waited", &PushOutcome::waited)
      .def_readonly("token_status", &PushOutcome::token_status)
      .def_readonly("token", &PushOutcome::token)
      .def_readonly("is_chief", &PushOutcome::is_chief)
      .def_readonly("step_gradients", &PushOutcome::step_gradients)
      .def_readonly("pulled_step", &PushOutcome::pulled_step)
      .def_readonly("accepted", &PushOutcome::accepted)
      .def_readonly("stale", &PushOutcome::stale)
      .def("__repr__", [](const PushOutcome& o) {
        return "PushOutcome(accepted=" + std::to_string(o.accepted) + ", stale=" + std::to_string(o.stale) +
               ", waited=" + (o.waited ? "True" : "False") + ", token=" + std::to_string(o.token) +
               ", token_status=" + std::string(py::repr(o.token_status)) + ")";
      });
  py::class_<psclient::ReduceResult>(m, "ReduceResult")
      .def_readonly("accepted", &psclient::ReduceResult::accepted)
      .def_readonly("step", &psclient::ReduceResult::step)
      .def("__repr__", [](const psclient::ReduceResult& r) {
        return std::string("ReduceResult(accepted=") + (r.accepted ? "True" : "False") +
               ", step=" + std::to_string(r.step) + ")";
      });

  py::class_<psclient::LaunchEnvironment>(m, "LaunchEnvironment", "psrun's environment contract.")
      .def_property_readonly(
          "client_options", [](const psclient::LaunchEnvironment& e) { return OptionsDict(e.options); },
          "keyword arguments for psclient.Client(**...)")
      .def_readonly("worker_index", &psclient::LaunchEnvironment::worker_index)
      .def_readonly("num_workers", &psclient::LaunchEnvironment::num_workers)
      .def_readonly("chief_eligible", &psclient::LaunchEnvironment::chief_eligible);
  m.def(
      "read_launch_environment", [] { return Check(psclient::ReadLaunchEnvironment()); },
      "Reads psrun's PSD_* variables (InvalidArgument naming the variable when one is wrong).");

  py::class_<ColocationScope>(m, "ColocationScope",
                              "colocate_vars_with(name): use as `with client.colocate_vars_with('w'):`")
      .def("__enter__",
           [](ColocationScope& s) -> ColocationScope& {
             if (s.scope) Raise(psd::FailedPrecondition("colocate_vars_with scope entered twice"));
             // The client's lock may be held by a call of another thread (GIL released): wait without the GIL.
             py::gil_scoped_release release;
             s.scope = std::make_unique<psclient::Client::ColocationScope>(s.client->ColocateVarsWith(s.variable));
             return s;
           })
      .def("__exit__", [](ColocationScope& s, py::args) {
        {
          py::gil_scoped_release release;
          s.scope.reset();
        }
        return false;
      });

  py::class_<PyClient>(m, "Client",
                       "A connection to psd (one daemon or a cluster). Calls block until the daemon answers "
                       "(bounded by the client's deadlines) with the GIL released; errors raise psclient.Error "
                       "subclasses. Use as a context manager, or call close().")
      .def(py::init([](const std::string& host, int port, py::object cluster, py::object worker_name,
                       uint64_t incarnation, int connect_timeout_ms, int64_t request_timeout_ms,
                       uint64_t max_frame_bytes, uint64_t push_frame_bytes, uint64_t pull_frame_bytes,
                       int64_t busy_poll_us, bool observer, py::object auth_token, bool tls, py::object tls_ca_file,
                       py::object tls_cert_file, py::object tls_key_file, py::object tls_server_name,
                       uint64_t shared_memory_bytes, uint64_t shared_buffer_bytes, uint64_t shm_piece_bytes,
                       int copy_threads, bool shm_lane) {
             return PyClient::Connect(
                 MakeOptions(host, port, cluster, worker_name, incarnation, connect_timeout_ms, request_timeout_ms,
                             max_frame_bytes, push_frame_bytes, pull_frame_bytes, busy_poll_us, observer, auth_token,
                             tls, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name, shared_memory_bytes,
                             shared_buffer_bytes, shm_piece_bytes, copy_threads, shm_lane));
           }),
           py::arg("host") = "127.0.0.1", py::arg("port") = 7070, py::kw_only(), py::arg("cluster") = py::none(),
           py::arg("worker_name") = py::none(), py::arg("incarnation") = 0, py::arg("connect_timeout_ms") = 10000,
           py::arg("request_timeout_ms") = 300000, py::arg("max_frame_bytes") = uint64_t{1} << 30,
           py::arg("push_frame_bytes") = uint64_t{1} << 20, py::arg("pull_frame_bytes") = uint64_t{16} << 20,
           py::arg("busy_poll_us") = int64_t{0}, py::arg("observer") = false, py::arg("auth_token") = py::none(),
           py::arg("tls") = false, py::arg("tls_ca_file") = py::none(), py::arg("tls_cert_file") = py::none(),
           py::arg("tls_key_file") = py::none(), py::arg("tls_server_name") = py::none(),
           py::arg("shared_memory_bytes") = uint64_t{1} << 30, py::arg("shared_buffer_bytes") = uint64_t{1} << 30,
           py::arg("shm_piece_bytes") = uint64_t{4} << 20, py::arg("copy_threads") = 2, py::arg("shm_lane") = true)
      .def_static(
          "from_environment", [] { return PyClient::Connect(Check(psclient::ClientOptionsFromEnvironment())); },
          "Connects as psrun's environment says (PSD_CLUSTER, PSD_WORKER_NAME, PSD_AUTH_TOKEN_FILE).")
      .def("close", &PyClient::Close, "Closes the connection (idempotent); later calls raise FailedPrecondition.")
      .def_property_readonly("closed", &PyClient::closed)
      .def("__enter__", [](PyClient& self) -> PyClient& { return self; })
      .def("__exit__",
           [](PyClient& self, py::args) {
             self.Close();
             return false;
           })
      // --- the handshake's facts ---------------------------------------------------------------
      .def_property_readonly("config", [](const PyClient& self) { return self.Get()->config(); })
      .def_property_readonly("worker_id", [](const PyClient& self) { return self.Get()->worker_id(); })
      .def_property_readonly("is_chief", [](const PyClient& self) { return self.Get()->is_chief(); })
      .def_property_readonly("initial_global_step",
                             [](const PyClient& self) { return self.Get()->initial_global_step(); })
      .def_property_readonly("connection_epoch", [](const PyClient& self) { return self.Get()->connection_epoch(); })
      .def_property_readonly("shards", [](const PyClient& self) { return self.Get()->shards(); })
      .def_property_readonly("chief_shard", [](const PyClient& self) { return self.Get()->chief_shard(); })
      .def_property_readonly("cluster_epoch", [](const PyClient& self) { return self.Get()->cluster_epoch(); })
      .def_property_readonly("slot_names", [](const PyClient& self) { return Texts(self.Get()->SlotNames()); })
      .def_property_readonly("requests_sent", [](const PyClient& self) { return self.Get()->requests_sent(); })
      // Both wait for each connection's shm_mu, which a reconnect holds while it attaches shared memory
      // (socket I/O, up to seconds): without the GIL, as parameter_devices.
      .def_property_readonly("shared_memory_shards",
                             [](const PyClient& self) {
                               std::shared_ptr<psclient::Client> c = self.Get();
                               py::gil_scoped_release release;
                               return c->shared_memory_shards();
                             })
      .def_property_readonly("shared_memory_lanes",
                             [](const PyClient& self) {
                               std::shared_ptr<psclient::Client> c = self.Get();
                               py::gil_scoped_release release;
                               return c->shared_memory_lanes();
                             })
      .def_property_readonly("shared_memory_status",
                             [](const PyClient& self) {
                               std::shared_ptr<psclient::Client> c = self.Get();
                               std::string status;
                               {
                                 py::gil_scoped_release release;
                                 status = c->shared_memory_status();
                               }
                               return Text(status);  // psd's answer may be in it
                             })
      .def(
          "allocate_shared",
          [](const PyClient& self, py::object shape, const std::string& dtype) {
            const psd::DType dt = ParseDTypeOrRaise(dtype);
            // One integer (numpy's too), or a sequence or array of them.
            const bool one = PyIndex_Check(shape.ptr()) && !py::isinstance<py::iterable>(shape);
            const psd::Shape dims =
                one ? psd::Shape{ToInt64(shape, "allocate_shared shape")} : ToInt64s(shape, "allocate_shared shape");
            for (int64_t d : dims) {
              if (d < 0) RaiseInvalid("allocate_shared: shape " + psd::ShapeString(dims) + " has a negative size");
            }
            // A byte count that would not fit (the shared buffers refuse whatever does not fit them).
            if (psd::Status v = psd::ValidateShape(dims, dt, INT64_MAX); !v.ok()) {
              RaiseInvalid("allocate_shared: " + v.message());
            }
            if (dt == psd::DType::kBFloat16) {
              RaiseInvalid("allocate_shared: numpy has no " + dtype +
                           "; use float32, float64 or float16 (or a float16-sized buffer viewed with a RawTensor)");
            }
            const char* format = psd::DTypeName(dt);  // numpy's name too
            const size_t bytes = static_cast<size_t>(psd::NumElements(dims)) * psd::DTypeSize(dt);
            auto buffer = Check(self.Get()->AllocateShared(bytes));
            auto* owned = new psclient::SharedBuffer(std::move(buffer));
            // The array owns the block: it goes back to the arena when the array (and every view of it) is gone.
            py::capsule base(owned, [](void* p) { delete static_cast<psclient::SharedBuffer*>(p); });
            return py::array(py::dtype(format), std::vector<py::ssize_t>(dims.begin(), dims.end()), owned->data(),
                             base);
          },
          py::arg("shape"), py::arg("dtype") = "float32",
          "A zeroed numpy array in memory shared with same-host daemons (shared_buffer_bytes in all): gradients "
          "pushed from it and values pulled into it move with no copy on either side. Use it as any array "
          "(torch.from_numpy shares it too); change it only between calls.")
      .def_property_readonly("parameter_devices",
                             [](const PyClient& self) {
                               std::shared_ptr<psclient::Client> c = self.Get();
                               std::vector<std::string> devices;
                               {
                                 py::gil_scoped_release release;  // waits for the client's lock (see Call)
                                 devices = c->ParameterDevices();
                               }
                               return Texts(devices);
                             })
      .def_property_readonly("should_init", [](const PyClient& self) { return self.Get()->should_init(); })
      .def_property_readonly("should_checkpoint", [](const PyClient& self) { return self.Get()->should_checkpoint(); })
      .def_property_readonly("should_save_summary",
                             [](const PyClient& self) { return self.Get()->should_save_summary(); })
      // --- variables ----------------------------------------------------------------------------
      .def(
          "create_variable",
          [](const PyClient& self, const std::string& name, py::object initial, py::object shape, py::object dtype,
             bool trainable, bool average, const std::string& optimizer, const std::string& colocate_with,
             const std::string& aggregation, bool sync_on_read) {
            Held held;
            if (!initial.is_none()) {
              held = MakeView(initial, false, "create_variable('" + name + "') initial value");
              if (!dtype.is_none() && ParseDTypeOrRaise(ToString(dtype, "dtype")) != held.view.dtype) {
                RaiseInvalid("create_variable('" + name + "'): dtype '" + ToString(dtype, "dtype") +
                             "' but the initial value is " + psd::DTypeName(held.view.dtype) +
                             " (give one or make them agree)");
              }
              if (!shape.is_none() && ToInt64s(shape, "shape") != held.view.shape) {
                RaiseInvalid("create_variable('" + name + "'): shape " + psd::ShapeString(ToInt64s(shape, "shape")) +
                             " but the initial value's is " + psd::ShapeString(held.view.shape));
              }
            } else {
              if (shape.is_none()) RaiseInvalid("create_variable('" + name + "'): give an initial value or a shape");
              held.view.dtype = dtype.is_none() ? psd::DType::kFloat32 : ParseDTypeOrRaise(ToString(dtype, "dtype"));
              held.view.shape = ToInt64s(shape, "shape");
            }
            psclient::VariableOptions options;
            options.trainable = trainable;
            options.average = average;
            options.optimizer = optimizer;
            options.colocate_with = colocate_with;
            options.aggregation = ParseAggregation(aggregation);
            options.sync_on_read = sync_on_read;
            psd::ConstTensorView view = held.view;
            return Check(Call(self, [&](psclient::Client& c) { return c.CreateVariable(name, view, options); }));
          },
          py::arg("name"), py::arg("initial") = py::none(), py::kw_only(), py::arg("shape") = py::none(),
          py::arg("dtype") = py::none(), py::arg("trainable") = true, py::arg("average") = false,
          py::arg("optimizer") = "", py::arg("colocate_with") = "", py::arg("aggregation") = "none",
          py::arg("sync_on_read") = false,
          "Create-or-get. Without `initial`: zeros of `shape` and `dtype` (default float32). AlreadyExists when "
          "the name exists with another dtype, shape or trainability.")
      .def(
          "pull",
          [](const PyClient& self, const std::string& name, py::object out) {
            Held held = MakeView(out, true, "pull('" + name + "') out");
            return Check(Call(self, [&](psclient::Client& c) { return c.Pull(name, held.view); }));
          },
          py::arg("name"), py::arg("out"), "Writes the variable's value into `out`; returns its global step.")
      .def(
          "pull_many",
          [](const PyClient& self, py::object outs) {
            auto held = NamedViews(outs, true, "pull_many out");
            auto views = Views(held);
            return Check(Call(self, [&](psclient::Client& c) { return c.Pull(views); }));
          },
          py::arg("outs"), "Pulls several variables at one global step: a dict {name: out} or [(name, out), ...].")
      .def(
          "pull_averages",
          [](const PyClient& self, py::object outs) {
            auto held = NamedViews(outs, true, "pull_averages out");
            auto views = Views(held);
            return Check(Call(self, [&](psclient::Client& c) { return c.PullAverages(views); }));
          },
          py::arg("outs"), "The moving averages of variables created with average=True (as pull_many).")
      .def(
          "pull_rows",
          [](const PyClient& self, const std::string& name, py::object rows, py::object out) {
            std::vector<int64_t> r = ToInt64s(rows, "pull_rows rows");
            Held held = MakeView(out, true, "pull_rows('" + name + "') out");
            return Check(Call(self, [&](psclient::Client& c) { return c.PullRows(name, r, held.view); }));
          },
          py::arg("name"), py::arg("rows"), py::arg("out"))
      .def(
          "push",
          [](const PyClient& self, int64_t local_step, py::object grads, py::object sparse, bool wait_token,
             int64_t timeout_ms, py::object pull_after) {
            auto dense_held = NamedViews(grads, false, "gradient");
            std::vector<psclient::Gradient> dense;
            dense.reserve(dense_held.size());
            for (const auto& [name, h] : dense_held) dense.push_back({name, h.view});
            std::vector<Held> sparse_held;
            std::vector<psclient::SparseGradient> sparse_grads;
            if (!sparse.is_none()) {
              for (py::handle item : sparse) {
                py::object name, indices, values, dense_shape = py::none();
                if (py::isinstance<py::tuple>(item) || py::isinstance<py::list>(item)) {
                  auto seq = py::reinterpret_borrow<py::sequence>(item);
                  if (py::len(seq) != 3 && py::len(seq) != 4) {
                    RaiseType("sparse: expected (name, indices, values[, dense_shape]) or SparseGradient");
                  }
                  name = seq[0], indices = seq[1], values = seq[2];
                  if (py::len(seq) == 4) dense_shape = seq[3];
                } else {
                  name = item.attr("name"), indices = item.attr("indices"), values = item.attr("values");
                  if (py::hasattr(item, "dense_shape")) dense_shape = item.attr("dense_shape");
                }
                psclient::SparseGradient g;
                g.name = ToString(name, "sparse gradient name");
                g.indices = ToInt64s(indices, "sparse gradient '" + g.name + "' indices");
                sparse_held.push_back(MakeView(values, false, "sparse gradient '" + g.name + "' values"));
                g.values = sparse_held.back().view;
                if (!dense_shape.is_none()) g.dense_shape = ToInt64s(dense_shape, "dense_shape");
                sparse_grads.push_back(std::move(g));
              }
            }
            auto after_held = NamedViews(pull_after, true, "pull_after out");
            auto after = Views(after_held);
            const bool has_after = !pull_after.is_none();
            psclient::PushOutcome o = Check(Call(self, [&](psclient::Client& c) {
              return c.Push(local_step, dense, sparse_grads, wait_token, timeout_ms, has_after ? &after : nullptr);
            }));
            PushOutcome out;
            out.results = std::move(o.results);
            out.waited = o.waited;
            out.token_status = ErrorObject(o.token_status);
            out.token = o.token;
            out.is_chief = o.is_chief;
            out.step_gradients = o.step_gradients;
            out.pulled_step = o.pulled_step;
            for (const auto& r : out.results) (r.accepted ? out.accepted : out.stale)++;
            return out;
          },
          py::arg("local_step"), py::arg("grads") = py::none(), py::kw_only(), py::arg("sparse") = py::none(),
          py::arg("wait_token") = false, py::arg("timeout_ms") = 0, py::arg("pull_after") = py::none(),
          "Pushes dense gradients ({name: array} or [(name, array)]) and sparse ones (SparseGradient or "
          "(name, indices, values[, dense_shape])) tagged with local_step. With wait_token, also waits for the "
          "token (its outcome in token_status: not raised); with pull_after, writes those variables' new "
          "values into the given arrays once the token is in.")
      .def(
          "wait_token",
          [](const PyClient& self, int64_t timeout_ms) {
            return Check(Call(self, [&](psclient::Client& c) { return c.WaitToken(timeout_ms); }));
          },
          py::arg("timeout_ms") = 0,
          "Waits for a token (the barrier); returns its step. DeadlineExceeded after timeout_ms (<= 0: the "
          "daemon's --token-timeout-ms), OutOfRange once training is over.")
      .def(
          "set_learning_rate",
          [](const PyClient& self, double lr) {
            Check(Call(self, [&](psclient::Client& c) { return c.SetLearningRate(lr); }));
          },
          py::arg("learning_rate"))
      .def("request_checkpoint",
           [](const PyClient& self) { Check(Call(self, [&](psclient::Client& c) { return c.RequestCheckpoint(); })); })
      .def(
          "recover",
          [](const PyClient& self, int64_t step, bool empty) {
            Check(Call(self, [&](psclient::Client& c) { return c.Recover(step, empty); }));
          },
          py::arg("step") = -1, py::arg("empty") = false)
      .def("get_status",
           [](const PyClient& self) { return Check(Call(self, [&](psclient::Client& c) { return c.GetStatus(); })); })
      .def(
          "get_shard_status",
          [](const PyClient& self, int shard) {
            return Check(Call(self, [&](psclient::Client& c) { return c.GetShardStatus(shard); }));
          },
          py::arg("shard"))
      .def("global_step",
           [](const PyClient& self) { return Check(Call(self, [&](psclient::Client& c) { return c.GlobalStep(); })); })
      .def(
          "placement",
          [](const PyClient& self, const std::string& name) {
            return Check(Call(self, [&](psclient::Client& c) { return c.Placement(name); }));
          },
          py::arg("name"))
      .def("placement_map",
           [](const PyClient& self) {
             return Check(Call(self, [&](psclient::Client& c) { return c.GetPlacementMap(); }));
           })
      .def(
          "get_slot",
          [](const PyClient& self, const std::string& variable, const std::string& slot, py::object out) {
            Held held = MakeView(out, true, "get_slot('" + variable + "', '" + slot + "') out");
            Check(Call(self, [&](psclient::Client& c) { return c.GetSlot(variable, slot, held.view); }));
          },
          py::arg("variable"), py::arg("slot"), py::arg("out"))
      // --- distribution-aware primitives ----------------------------------------------------------
      .def(
          "reduce_to",
          [](const PyClient& self, const std::string& op, int64_t local_step, py::object value,
             const std::string& destination, py::object result, int64_t timeout_ms) {
            psclient::ReduceOp rop = ParseReduceOp(op);
            Held v = MakeView(value, false, "reduce_to('" + destination + "') value");
            Held r;
            if (!result.is_none()) r = MakeView(result, true, "reduce_to('" + destination + "') result");
            return Check(Call(self, [&](psclient::Client& c) {
              return c.ReduceTo(rop, local_step, v.view, destination, r.view, timeout_ms);
            }));
          },
          py::arg("op"), py::arg("local_step"), py::arg("value"), py::arg("destination"),
          py::arg("result") = py::none(), py::arg("timeout_ms") = 0)
      .def(
          "batch_reduce_to",
          [](const PyClient& self, const std::string& op, int64_t local_step, py::object items, uint64_t bytes_per_pack,
             int64_t timeout_ms) {
            psclient::ReduceOp rop = ParseReduceOp(op);
            std::vector<Held> held;
            std::vector<psclient::ReduceItem> list;
            for (py::handle item : items) {
              auto seq = py::reinterpret_borrow<py::sequence>(item);
              if (py::len(seq) != 2 && py::len(seq) != 3) {
                RaiseType("batch_reduce_to: expected (value, destination[, result]) items");
              }
              psclient::ReduceItem ri;
              ri.destination = ToString(seq[1], "batch_reduce_to destination");
              held.push_back(MakeView(seq[0], false, "batch_reduce_to('" + ri.destination + "') value"));
              ri.value = held.back().view;
              if (py::len(seq) == 3 && !py::object(seq[2]).is_none()) {
                held.push_back(MakeView(seq[2], true, "batch_reduce_to('" + ri.destination + "') result"));
                ri.result = held.back().view;
              }
              list.push_back(std::move(ri));
            }
            psclient::CollectiveHints hints{bytes_per_pack, timeout_ms};
            return Check(
                Call(self, [&](psclient::Client& c) { return c.BatchReduceTo(rop, local_step, list, hints); }));
          },
          py::arg("op"), py::arg("local_step"), py::arg("items"), py::arg("bytes_per_pack") = 0,
          py::arg("timeout_ms") = 0)
      .def(
          "broadcast_to",
          [](const PyClient& self, py::object value, std::vector<std::string> destinations, bool at_next_step) {
            Held v = MakeView(value, false, "broadcast_to value");
            Check(Call(self, [&](psclient::Client& c) { return c.BroadcastTo(v.view, destinations, at_next_step); }));
          },
          py::arg("value"), py::arg("destinations"), py::arg("at_next_step") = false)
      .def(
          "update",
          [](const PyClient& self, const std::string& variable, const std::string& op, py::object value,
             bool cross_replica, int64_t local_step, int64_t timeout_ms, double factor, bool at_next_step) {
            psclient::UpdateOp uop = ParseUpdateOp(op);
            Held v;
            if (!value.is_none()) v = MakeView(value, false, "update('" + variable + "') value");
            psclient::UpdateOptions options{cross_replica, local_step, timeout_ms, factor, at_next_step};
            return Check(Call(self, [&](psclient::Client& c) { return c.Update(variable, uop, v.view, options); }));
          },
          py::arg("variable"), py::arg("op"), py::arg("value") = py::none(), py::kw_only(),
          py::arg("cross_replica") = true, py::arg("local_step") = 0, py::arg("timeout_ms") = 0,
          py::arg("factor") = 1.0, py::arg("at_next_step") = false)
      .def(
          "colocate_vars_with",
          [](const PyClient& self, const std::string& name) {
            ColocationScope s;
            s.client = self.Get();
            s.variable = name;
            return s;
          },
          py::arg("name"))
      .def("worker_devices",
           [](const PyClient& self) {
             return Texts(Check(Call(self, [&](psclient::Client& c) { return c.WorkerDevices(); })));
           })
      .def(
          "finish", [](const PyClient& self) { Check(Call(self, [&](psclient::Client& c) { return c.Finish(); })); },
          "Declares this worker done (psd --exit-when-done exits once all workers did).");
}
