// psclient._core's conversions between Python and libpsclient (README "Python"): statuses to
// exceptions, Python objects to tensor views over the caller's memory (buffer protocol, RawTensor),
// text both ways, the client's options, and the Python Client object that holds the C++ one.
// Used by the module's definition (core.cc); the conventions are core.cc's.
#ifndef PSCLIENT_PYTHON_SRC_CONVERT_H_
#define PSCLIENT_PYTHON_SRC_CONVERT_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "psclient/client.h"
#include "psd/status.h"
#include "psd/tensor.h"

namespace py = pybind11;

namespace psclient_py {

// A non-OK status on its way to Python (translated into psclient._errors' classes).
class StatusError : public std::exception {
 public:
  explicit StatusError(psd::Status status) : status_(std::move(status)) {}
  const char* what() const noexcept override { return status_.message().c_str(); }
  const psd::Status& status() const { return status_; }

 private:
  psd::Status status_;
};

[[noreturn]] void Raise(psd::Status status);
[[noreturn]] void RaiseInvalid(std::string message);
void Check(const psd::Status& status);
template <typename T>
T Check(psd::Result<T> result) {
  if (!result.ok()) Raise(result.status());
  return std::move(result).value();
}

// Text from the daemon (or from the environment, or the user) as a Python str. Bytes that are not
// UTF-8 come through as \xNN escapes: pybind11's strict decoding would raise UnicodeDecodeError
// instead, and the status or the answer they were part of would be lost.
py::str Text(const std::string& s);
// A TypeError whose message may quote user text that is not UTF-8 (pybind11's type_error would
// decode it strictly and raise something else).
[[noreturn]] void RaiseType(const std::string& message);
py::list Texts(const std::vector<std::string>& v);
// Text that goes back into psclient.Client(**...) (LaunchEnvironment.client_options): non-UTF-8
// bytes become surrogates, as in os.environ, so that ToString gives the same bytes back.
py::str RoundTripText(const std::string& s);
// The psclient exception instance for `status` (an OK status: None).
py::object ErrorObject(const psd::Status& status);
py::tuple ShapeTuple(const psd::Shape& shape);
psd::DType ParseDTypeOrRaise(const std::string& name);
// A raw tensor: a pointer the caller vouches for (bfloat16 host memory, CUDA device memory).
struct RawTensor {
  uintptr_t ptr = 0;
  psd::DType dtype = psd::DType::kFloat32;
  psd::Shape shape;
  psd::MemoryKind memory = psd::MemoryKind::kHost;
  uintptr_t stream = 0;  // a cudaStream_t as an integer (torch: torch.cuda.current_stream().cuda_stream)
  py::object owner;      // kept alive while the RawTensor is
};

// One exported Py_buffer, released (with the GIL held) when this goes away.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (held_) PyBuffer_Release(&view_);
  }
  // Returns false with a Python error set when `obj` cannot export a buffer with `flags`.
  bool Get(PyObject* obj, int flags) {
    if (PyObject_GetBuffer(obj, &view_, flags) != 0) return false;
    held_ = true;
    return true;
  }
  const Py_buffer& view() const { return view_; }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// A tensor argument: the psd view over the caller's memory plus what keeps that memory alive.
struct Held {
  std::unique_ptr<Buffer> buffer;
  py::object keep;
  psd::TensorView view;
};

std::string TypeName(py::handle obj);
// repr(obj) for an error message: at most 80 characters, and never an error of its own.
std::string Repr(py::handle obj);
// `item` as an int64: a Python int, a numpy integer or anything else with __index__. TypeError
// naming `what` and the item otherwise (pybind11's cast would raise a RuntimeError, and accept
// numpy floats by truncating them).
int64_t ToInt64(py::handle item, const std::string& what);
// `obj` (a str, or bytes taken as they are) as a std::string, in UTF-8 (surrogates of
// os.environ's non-UTF-8 bytes back as those bytes); TypeError naming `what` otherwise.
std::string ToString(py::handle obj, const std::string& what);
// What a numpy/buffer format string means for psd ('f', 'd', 'e', with a native/little-endian prefix).
std::optional<psd::DType> FormatDType(const char* format, Py_ssize_t itemsize);
// Builds a view over `obj` (a buffer or a RawTensor). `what` names the argument in errors.
Held MakeView(py::handle obj, bool writable, const std::string& what);
std::vector<int64_t> ToInt64s(py::handle obj, const std::string& what);
// (name, tensor) pairs from a dict or a sequence of pairs.
std::vector<std::pair<std::string, Held>> NamedViews(py::handle obj, bool writable, const char* what);
std::vector<std::pair<std::string, psd::TensorView>> Views(const std::vector<std::pair<std::string, Held>>& held);
std::vector<std::string> ClusterEntries(py::handle obj);
psclient::Aggregation ParseAggregation(const std::string& s);
psclient::ReduceOp ParseReduceOp(const std::string& s);
psclient::UpdateOp ParseUpdateOp(const std::string& s);
// PushOutcome with the token status as a psclient exception instance (None when OK).
struct PushOutcome {
  std::vector<psclient::PushResult> results;
  bool waited = false;
  py::object token_status;
  int64_t token = 0;
  bool is_chief = false;
  int step_gradients = 0;
  int64_t pulled_step = -1;
  int accepted = 0;
  int stale = 0;
};

// The active colocate_vars_with scope (a context manager).
struct ColocationScope {
  std::shared_ptr<psclient::Client> client;
  std::string variable;
  std::unique_ptr<psclient::Client::ColocationScope> scope;
};

// The Python Client. Holds the C++ Client through a shared_ptr so close() on one thread cannot
// destroy it under a call running on another.
class PyClient {
 public:
  explicit PyClient(std::shared_ptr<psclient::Client> client) : client_(std::move(client)) {}

  static std::unique_ptr<PyClient> Connect(const psclient::ClientOptions& options) {
    psd::Result<std::unique_ptr<psclient::Client>> result = psd::Unavailable("not connected");
    {
      py::gil_scoped_release release;
      result = psclient::Client::Connect(options);
    }
    return std::make_unique<PyClient>(std::shared_ptr<psclient::Client>(Check(std::move(result))));
  }

  std::shared_ptr<psclient::Client> Get() const {
    if (!client_) Raise(psd::FailedPrecondition("this psclient.Client is closed: connect a new one"));
    return client_;
  }

  void Close() {
    std::shared_ptr<psclient::Client> c = std::move(client_);
    client_.reset();
    py::gil_scoped_release release;
    c.reset();  // the connection closes here unless another thread's call still runs
  }
  bool closed() const { return !client_; }

 private:
  std::shared_ptr<psclient::Client> client_;
};

// Runs `f` on the C++ client with the GIL released.
template <typename F>
auto Call(const PyClient& self, F&& f) {
  std::shared_ptr<psclient::Client> c = self.Get();
  py::gil_scoped_release release;
  return f(*c);
}

py::dict OptionsDict(const psclient::ClientOptions& o);

}  // namespace psclient_py

#endif  // PSCLIENT_PYTHON_SRC_CONVERT_H_
