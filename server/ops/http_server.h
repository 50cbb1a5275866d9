// HttpServer: a small HTTP/1.1 listener for the operator endpoints (/metrics, /healthz, /readyz,
// the status page). One request per connection (`Connection: close`), GET and HEAD only. It knows
// nothing of psd: a handler turns an HttpRequest into an HttpResponse.
//
// Hardened like the data port: a request head is at most 8 KiB and must arrive within
// `header_timeout`; at most `max_connections` are open at once: a connection beyond that closes
// the one that has waited longest for its request head (so clients that connect and send nothing
// cannot keep a liveness probe out), or is closed itself when every open one is being answered.
// The body of a request is never read. Malformed requests get 400, other methods 405.
//
// Threading: runs on the io_context it is given; each connection's handlers run on its own strand;
// the handler is called on an I/O thread and must not block for long. Stop() may be called from
// any thread; the server must outlive the io_context's run (destroy it after the threads join).
#ifndef PSD_SERVER_OPS_HTTP_SERVER_H_
#define PSD_SERVER_OPS_HTTP_SERVER_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/waiting_queue.h"
#include "psd/status.h"
#include "wire/asio.h"

namespace psd::server::ops {

struct HttpRequest {
  std::string method;                          // "GET", "HEAD"
  std::string path;                            // "/metrics" (percent-escapes are not decoded; psd's paths have none)
  std::string query;                           // after '?', without it
  std::map<std::string, std::string> headers;  // names lower-cased, values trimmed
  // The header's value, or "".
  std::string Header(const std::string& lower_name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers
};

// Parses a request head (request line + headers, up to and including the blank line). Errors are
// InvalidArgument with what is wrong.
Status ParseHttpRequest(std::string_view head, HttpRequest* out);
// The whole response as bytes on the wire (status line, headers, body unless `head_only`).
std::string SerializeHttpResponse(const HttpResponse& r, bool head_only);

class HttpServer {
 public:
  using Handler = std::function<HttpResponse(const HttpRequest&)>;
  struct Limits {
    int max_connections = 64;
    std::chrono::milliseconds header_timeout{5000};
    size_t max_header_bytes = 8192;
  };

  HttpServer(asio::io_context& io, Handler handler, Limits limits);
  HttpServer(asio::io_context& io, Handler handler) : HttpServer(io, std::move(handler), Limits{}) {}
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds host:port (0: the kernel picks) and starts accepting. Unavailable if it cannot listen.
  Status Listen(const std::string& host, uint16_t port);
  uint16_t port() const { return port_; }
  // Closes the listener; open connections finish or time out.
  void Stop();

 private:
  class Session;
  void Accept();

  asio::io_context& io_;
  std::shared_ptr<const Handler> handler_;  // shared with sessions still in flight
  const Limits limits_;
  tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  std::shared_ptr<std::atomic<int>> open_ = std::make_shared<std::atomic<int>>(0);
  WaitingQueue<Session> waiting_;  // sessions waiting for their request head
};

}  // namespace psd::server::ops

#endif  // PSD_SERVER_OPS_HTTP_SERVER_H_
