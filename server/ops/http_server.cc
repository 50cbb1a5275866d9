#include "ops/http_server.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>

namespace psd::server::ops {
namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
    default:
      return "Status";
  }
}

// The end of a request head: a blank line. A head whose lines end in "\n" alone is malformed,
// but it is found too, to be answered 400 at once rather than left to time out.
struct HeadEnd {
  template <typename Iterator>
  std::pair<Iterator, bool> operator()(Iterator begin, Iterator end) const {
    int after_newline = 0;  // 1: just after '\n'; 2: after "\n\r"
    for (Iterator i = begin; i != end; ++i) {
      const char c = *i;
      if (c == '\n') {
        if (after_newline > 0) return {++i, true};
        after_newline = 1;
      } else {
        after_newline = c == '\r' && after_newline == 1 ? 2 : 0;
      }
    }
    return {begin, false};  // searched again from the start once more bytes came (a head is small)
  }
};

}  // namespace
}  // namespace psd::server::ops

template <>
struct boost::asio::is_match_condition<psd::server::ops::HeadEnd> : std::true_type {};

namespace psd::server::ops {

std::string HttpRequest::Header(const std::string& lower_name) const {
  auto it = headers.find(lower_name);
  return it == headers.end() ? std::string() : it->second;
}

Status ParseHttpRequest(std::string_view head, HttpRequest* out) {
  size_t eol = head.find("\r\n");
  if (eol == std::string_view::npos) return InvalidArgument("no request line");
  std::string_view line = head.substr(0, eol);
  size_t sp1 = line.find(' ');
  size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos) return InvalidArgument("malformed request line");
  out->method = std::string(line.substr(0, sp1));
  std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  std::string_view version = line.substr(sp2 + 1);
  if (version != "HTTP/1.1" && version != "HTTP/1.0") return InvalidArgument("unsupported HTTP version");
  if (target.empty() || target.front() != '/') return InvalidArgument("the request target must be a path");
  for (char c : target) {
    if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
      return InvalidArgument("invalid character in the request target");
    }
  }
  size_t q = target.find('?');
  out->path = std::string(target.substr(0, q));
  out->query = q == std::string_view::npos ? "" : std::string(target.substr(q + 1));
  out->headers.clear();
  size_t pos = eol + 2;
  while (pos < head.size()) {
    size_t end = head.find("\r\n", pos);
    if (end == std::string_view::npos) return InvalidArgument("a header line is not terminated");
    if (end == pos) break;  // the blank line
    std::string_view h = head.substr(pos, end - pos);
    size_t colon = h.find(':');
    if (colon == std::string_view::npos || colon == 0) return InvalidArgument("malformed header line");
    out->headers[Lower(h.substr(0, colon))] = std::string(Trim(h.substr(colon + 1)));
    pos = end + 2;
  }
  return Status::Ok();
}

std::string SerializeHttpResponse(const HttpResponse& r, bool head_only) {
  std::string out = "HTTP/1.1 " + std::to_string(r.status) + " " + Reason(r.status) + "\r\n";
  out += "Content-Type: " + r.content_type + "\r\n";
  out += "Content-Length: " + std::to_string(r.body.size()) + "\r\n";
  out += "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n";
  for (const auto& [k, v] : r.headers) out += k + ": " + v + "\r\n";
  out += "\r\n";
  if (!head_only) out += r.body;
  return out;
}

class HttpServer::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, std::shared_ptr<const Handler> handler, Limits limits,
          std::shared_ptr<std::atomic<int>> open)
      : socket_(std::move(socket)),
        timer_(socket_.get_executor()),
        buf_(limits.max_header_bytes),
        handler_(std::move(handler)),
        limits_(limits),
        open_(std::move(open)) {}
  ~Session() { open_->fetch_sub(1); }

  // Whether it still waits for its request head (what a full server closes to admit another).
  bool waiting() const { return waiting_.load(); }
  // Closes it if it still waits for its head; false if it has one already (it is being answered).
  bool Evict() {
    if (!waiting_.exchange(false)) return false;
    asio::post(socket_.get_executor(), [self = shared_from_this()] {
      self->timer_.cancel();
      boost::system::error_code ignored;
      self->socket_.close(ignored);  // the pending read fails and the session ends
    });
    return true;
  }

  void Start() {
    auto self = shared_from_this();
    timer_.expires_after(limits_.header_timeout);
    timer_.async_wait([self](boost::system::error_code ec) {
      if (ec) return;
      boost::system::error_code ignored;
      self->socket_.close(ignored);  // too slow: the pending read fails and the session ends
    });
    asio::async_read_until(socket_, buf_, HeadEnd{}, [self](boost::system::error_code ec, size_t n) {
      if (!self->waiting_.exchange(false)) return;  // evicted
      self->timer_.cancel();
      if (ec == asio::error::not_found) return self->Reply(431, "request head over the size limit\n", false);
      if (ec) return;
      std::string head(asio::buffers_begin(self->buf_.data()), asio::buffers_begin(self->buf_.data()) + n);
      HttpRequest req;
      Status s = ParseHttpRequest(head, &req);
      if (!s.ok()) return self->Reply(400, s.message() + "\n", false);
      if (req.method != "GET" && req.method != "HEAD") return self->Reply(405, "only GET and HEAD\n", false);
      HttpResponse resp;
      try {
        resp = (*self->handler_)(req);
      } catch (const std::exception& e) {
        spdlog::error("ops endpoint {}: {}", req.path, e.what());
        resp = {500, "text/plain; charset=utf-8", "internal error\n", {}};
      }
      self->Send(SerializeHttpResponse(resp, req.method == "HEAD"));
    });
  }

 private:
  void Reply(int status, std::string body, bool head_only) {
    Send(SerializeHttpResponse({status, "text/plain; charset=utf-8", std::move(body), {}}, head_only));
  }
  void Send(std::string bytes) {
    auto self = shared_from_this();
    auto data = std::make_shared<std::string>(std::move(bytes));
    // A reader that never reads its reply is cut off after the same timeout.
    timer_.expires_after(limits_.header_timeout);
    timer_.async_wait([self](boost::system::error_code ec) {
      if (ec) return;
      boost::system::error_code ignored;
      self->socket_.close(ignored);
    });
    asio::async_write(socket_, asio::buffer(*data), [self, data](boost::system::error_code ec, size_t) {
      boost::system::error_code ignored;
      if (ec) {
        self->socket_.close(ignored);
        return;
      }
      // A lingering close: stop sending, then drain what the client still sends until it closes
      // (or the timer fires). Closing with unread input would reset the connection and could
      // destroy the reply before the client reads it.
      self->socket_.shutdown(tcp::socket::shutdown_send, ignored);
      self->Drain();
    });
  }
  void Drain() {
    auto self = shared_from_this();
    socket_.async_read_some(asio::buffer(drain_), [self](boost::system::error_code ec, size_t) {
      if (!ec) return self->Drain();
      self->timer_.cancel();
      boost::system::error_code ignored;
      self->socket_.close(ignored);
    });
  }

  tcp::socket socket_;
  asio::steady_timer timer_;
  asio::streambuf buf_;
  std::shared_ptr<const Handler> handler_;
  const Limits limits_;
  std::shared_ptr<std::atomic<int>> open_;
  std::atomic<bool> waiting_{true};
  char drain_[1024];
};

HttpServer::HttpServer(asio::io_context& io, Handler handler, Limits limits)
    : io_(io), handler_(std::make_shared<const Handler>(std::move(handler))), limits_(limits), acceptor_(io) {}

HttpServer::~HttpServer() {
  boost::system::error_code ec;
  acceptor_.close(ec);
}

Status HttpServer::Listen(const std::string& host, uint16_t port) {
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(host, ec);
  if (ec) return InvalidArgument("--metrics-host '" + host + "' is not an IP address: " + ec.message());
  tcp::endpoint ep(addr, port);
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Unavailable("cannot listen on " + host + ":" + std::to_string(port) + ": " + ec.message());
  port_ = acceptor_.local_endpoint().port();
  Accept();
  return Status::Ok();
}

void HttpServer::Stop() {
  asio::post(io_, [this] {
    boost::system::error_code ec;
    acceptor_.close(ec);
  });
}

void HttpServer::Accept() {
  acceptor_.async_accept(asio::make_strand(io_), [this](boost::system::error_code ec, tcp::socket socket) {
    if (ec) {
      if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
      // EMFILE and friends: wait a little rather than spin on a failing accept.
      auto t = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(100));
      t->async_wait([this, t](boost::system::error_code) {
        if (acceptor_.is_open()) Accept();
      });
      return;
    }
    // Full: the session that has waited longest for its request head makes room (a probe is not
    // turned away by clients that connect and send nothing); with none waiting, the new one goes.
    if (open_->fetch_add(1) >= limits_.max_connections && !waiting_.EvictOldest()) {
      open_->fetch_sub(1);
      boost::system::error_code ignored;
      socket.close(ignored);
    } else {
      auto session = std::make_shared<Session>(std::move(socket), handler_, limits_, open_);
      waiting_.Add(session);
      session->Start();
    }
    Accept();
  });
}

}  // namespace psd::server::ops
