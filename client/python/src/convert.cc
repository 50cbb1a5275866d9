#include "convert.h"

namespace psclient_py {

[[noreturn]] void Raise(psd::Status status) { throw StatusError(std::move(status)); }

[[noreturn]] void RaiseInvalid(std::string message) { Raise(psd::InvalidArgument(std::move(message))); }

void Check(const psd::Status& status) {
  if (!status.ok()) Raise(status);
}

py::str Text(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "backslashreplace");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

[[noreturn]] void RaiseType(const std::string& message) {
  PyErr_SetObject(PyExc_TypeError, Text(message).ptr());
  throw py::error_already_set();
}

py::list Texts(const std::vector<std::string>& v) {
  py::list out;
  for (const std::string& s : v) out.append(Text(s));
  return out;
}

py::str RoundTripText(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogateescape");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

py::object ErrorObject(const psd::Status& status) {
  if (status.ok()) return py::none();
  return py::module_::import("psclient._errors")
      .attr("error_for")(static_cast<int>(status.code()), Text(status.message()));
}

py::tuple ShapeTuple(const psd::Shape& shape) {
  py::tuple t(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t[i] = py::int_(shape[i]);
  return t;
}

psd::DType ParseDTypeOrRaise(const std::string& name) { return Check(psd::ParseDType(name)); }

std::string TypeName(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

std::string Repr(py::handle obj) {
  std::string out = "<" + TypeName(obj) + ">";
  if (PyObject* r = PyObject_Repr(obj.ptr())) {
    if (PyObject* b = PyUnicode_AsEncodedString(r, "utf-8", "backslashreplace")) {
      out.assign(PyBytes_AS_STRING(b), static_cast<size_t>(PyBytes_GET_SIZE(b)));
      Py_DECREF(b);
    }
    Py_DECREF(r);
  }
  PyErr_Clear();
  if (out.size() > 80) out = out.substr(0, 77) + "...";
  return out;
}

int64_t ToInt64(py::handle item, const std::string& what) {
  int overflow = 0;
  long long v = -1;
  PyObject* index = PyNumber_Index(item.ptr());
  if (index != nullptr) {
    v = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
  }
  if (index == nullptr || overflow != 0 || (v == -1 && PyErr_Occurred() != nullptr)) {
    PyErr_Clear();
    RaiseType(what + ": expected integers in int64 range, got " + Repr(item));
  }
  return static_cast<int64_t>(v);
}

std::string ToString(py::handle obj, const std::string& what) {
  if (PyBytes_Check(obj.ptr())) {
    return std::string(PyBytes_AS_STRING(obj.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(obj.ptr())));
  }
  if (!PyUnicode_Check(obj.ptr())) RaiseType(what + ": expected a str, got " + TypeName(obj));
  PyObject* b = PyUnicode_AsEncodedString(obj.ptr(), "utf-8", "surrogateescape");
  if (b == nullptr) {  // a lone surrogate that stands for no byte
    PyErr_Clear();
    RaiseInvalid(what + " " + Repr(obj) + " cannot be encoded as UTF-8");
  }
  std::string out(PyBytes_AS_STRING(b), static_cast<size_t>(PyBytes_GET_SIZE(b)));
  Py_DECREF(b);
  return out;
}

std::optional<psd::DType> FormatDType(const char* format, Py_ssize_t itemsize) {
  if (format == nullptr) return std::nullopt;  // plain bytes
  std::string f(format);
  if (!f.empty() && (f[0] == '@' || f[0] == '=' || f[0] == '<')) f.erase(0, 1);
  if (f == "f" && itemsize == 4) return psd::DType::kFloat32;
  if (f == "d" && itemsize == 8) return psd::DType::kFloat64;
  if (f == "e" && itemsize == 2) return psd::DType::kFloat16;
  return std::nullopt;
}

Held MakeView(py::handle obj, bool writable, const std::string& what) {
  Held held;
  if (py::isinstance<RawTensor>(obj)) {
    const auto& raw = obj.cast<const RawTensor&>();
    held.keep = py::reinterpret_borrow<py::object>(obj);
    held.view = {reinterpret_cast<void*>(raw.ptr), raw.dtype, raw.shape, raw.memory,
                 reinterpret_cast<void*>(raw.stream)};
    return held;
  }
  if (!PyObject_CheckBuffer(obj.ptr())) {
    RaiseType(what +
              ": expected a numpy array (C-contiguous float32, float64 or float16) or a "
              "psclient.RawTensor, got " +
              TypeName(obj));
  }
  held.buffer = std::make_unique<Buffer>();
  const int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (!held.buffer->Get(obj.ptr(), flags)) {
    py::error_already_set original;  // takes the Python error
    Buffer probe;
    if (writable && probe.Get(obj.ptr(), PyBUF_STRIDES | PyBUF_FORMAT)) {
      RaiseInvalid(what +
                   " is read-only: pulls write into the caller's array, so pass a writable one "
                   "(numpy.array(x) makes a writable copy)");
    }
    PyErr_Clear();
    RaiseType(what + ": cannot read its buffer (" + std::string(py::str(original.value())) + ")");
  }
  const Py_buffer& b = held.buffer->view();
  std::optional<psd::DType> dtype = FormatDType(b.format, b.itemsize);
  if (!dtype) {
    RaiseInvalid(what + ": unsupported element type (buffer format '" + std::string(b.format ? b.format : "B") +
                 "'): use float32, float64 or float16 arrays (numpy.asarray(x, dtype=numpy.float32)); "
                 "bfloat16 and device memory go through psclient.RawTensor");
  }
  if (!PyBuffer_IsContiguous(&b, 'C')) {
    RaiseInvalid(what +
                 " is not C-contiguous: psd reads and writes arrays in place, without copies; pass "
                 "numpy.ascontiguousarray(x) (one explicit copy) — and for a pull, copy the result back");
  }
  held.keep = py::reinterpret_borrow<py::object>(obj);
  held.view.data = b.buf;
  held.view.dtype = *dtype;
  held.view.shape.assign(b.shape, b.shape + b.ndim);
  return held;
}

std::vector<int64_t> ToInt64s(py::handle obj, const std::string& what) {
  std::vector<int64_t> out;
  if (PyObject_CheckBuffer(obj.ptr())) {
    Buffer b;
    if (b.Get(obj.ptr(), PyBUF_STRIDES | PyBUF_FORMAT) && PyBuffer_IsContiguous(&b.view(), 'C') &&
        b.view().format != nullptr) {
      std::string f(b.view().format);
      if (!f.empty() && (f[0] == '@' || f[0] == '=' || f[0] == '<')) f.erase(0, 1);
      const Py_ssize_t n = b.view().itemsize > 0 ? b.view().len / b.view().itemsize : 0;
      if ((f == "q" || f == "l") && b.view().itemsize == 8) {
        out.resize(n);
        std::memcpy(out.data(), b.view().buf, n * sizeof(int64_t));
        return out;
      }
      if ((f == "i" || f == "l") && b.view().itemsize == 4) {
        const auto* p = static_cast<const int32_t*>(b.view().buf);
        out.assign(p, p + n);
        return out;
      }
    }
    PyErr_Clear();
  }
  if (!py::isinstance<py::iterable>(obj) || py::isinstance<py::str>(obj)) {
    RaiseType(what + ": expected a sequence or array of integers, got " + TypeName(obj));
  }
  for (py::handle item : obj) out.push_back(ToInt64(item, what));
  return out;
}

std::vector<std::pair<std::string, Held>> NamedViews(py::handle obj, bool writable, const char* what) {
  std::vector<std::pair<std::string, Held>> out;
  if (obj.is_none()) return out;
  auto add = [&](py::handle name, py::handle value) {
    std::string n = ToString(name, std::string(what) + " name");
    out.emplace_back(n, MakeView(value, writable, std::string(what) + " '" + n + "'"));
  };
  if (py::isinstance<py::dict>(obj)) {
    for (auto item : py::reinterpret_borrow<py::dict>(obj)) add(item.first, item.second);
    return out;
  }
  if (!py::isinstance<py::iterable>(obj) || py::isinstance<py::str>(obj)) {
    RaiseType(std::string(what) + ": expected a dict {name: array} or a list of (name, array) pairs");
  }
  for (py::handle item : obj) {
    auto pair = py::reinterpret_borrow<py::sequence>(item);
    if (py::len(pair) != 2) {
      RaiseType(std::string(what) + ": expected (name, array) pairs");
    }
    add(pair[0], pair[1]);
  }
  return out;
}

std::vector<std::pair<std::string, psd::TensorView>> Views(const std::vector<std::pair<std::string, Held>>& held) {
  std::vector<std::pair<std::string, psd::TensorView>> out;
  out.reserve(held.size());
  for (const auto& [name, h] : held) out.emplace_back(name, h.view);
  return out;
}

std::vector<std::string> ClusterEntries(py::handle obj) {
  std::vector<std::string> out;
  if (obj.is_none()) return out;
  if (py::isinstance<py::str>(obj)) return psclient::ParseClusterList(ToString(obj, "cluster"));
  if (!py::isinstance<py::iterable>(obj)) {
    RaiseType("cluster: expected 'h:p,h:p' or a list of 'h:p' entries, got " + TypeName(obj));
  }
  for (py::handle item : obj) {
    for (auto& e : psclient::ParseClusterList(ToString(item, "cluster entry"))) out.push_back(std::move(e));
  }
  return out;
}

psclient::Aggregation ParseAggregation(const std::string& s) {
  if (s == "none") return psclient::Aggregation::kNone;
  if (s == "sum") return psclient::Aggregation::kSum;
  if (s == "mean") return psclient::Aggregation::kMean;
  if (s == "only_first_replica") return psclient::Aggregation::kOnlyFirstReplica;
  RaiseInvalid("aggregation '" + s + "': use 'none', 'sum', 'mean' or 'only_first_replica'");
}

psclient::ReduceOp ParseReduceOp(const std::string& s) {
  if (s == "sum") return psclient::ReduceOp::kSum;
  if (s == "mean") return psclient::ReduceOp::kMean;
  RaiseInvalid("reduce op '" + s + "': use 'sum' or 'mean'");
}

psclient::UpdateOp ParseUpdateOp(const std::string& s) {
  if (s == "assign") return psclient::UpdateOp::kAssign;
  if (s == "assign_add") return psclient::UpdateOp::kAssignAdd;
  if (s == "assign_sub") return psclient::UpdateOp::kAssignSub;
  if (s == "scale") return psclient::UpdateOp::kScale;
  RaiseInvalid("update op '" + s + "': use 'assign', 'assign_add', 'assign_sub' or 'scale'");
}

py::dict OptionsDict(const psclient::ClientOptions& o) {
  py::dict d;
  d["host"] = RoundTripText(o.host);
  d["port"] = o.port;
  py::list cluster;
  for (const std::string& e : o.cluster) cluster.append(RoundTripText(e));
  d["cluster"] = cluster;
  d["worker_name"] = RoundTripText(o.worker_name);
  d["auth_token"] = o.auth_token.empty() ? py::object(py::none()) : py::object(RoundTripText(o.auth_token));
  return d;
}

}  // namespace psclient_py
