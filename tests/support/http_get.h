// Test helper: one raw HTTP/1.1 exchange with a server on 127.0.0.1 (the client closes after
// reading to the end: the server sends `Connection: close`).
#ifndef PSD_TESTS_SUPPORT_HTTP_GET_H_
#define PSD_TESTS_SUPPORT_HTTP_GET_H_

#include <cstdint>
#include <string>

#include "wire/asio.h"

namespace psd::testing {

// Sends `request` as is (it may be partial) and returns everything the server sent.
inline std::string HttpExchange(uint16_t port, const std::string& request) {
  asio::io_context io;
  tcp::socket s(io);
  s.connect({asio::ip::make_address("127.0.0.1"), port});
  asio::write(s, asio::buffer(request));
  std::string out;
  boost::system::error_code ec;
  char buf[4096];
  for (;;) {
    size_t n = s.read_some(asio::buffer(buf), ec);
    if (ec) break;
    out.append(buf, n);
  }
  return out;
}

struct HttpReply {
  int status = 0;
  std::string headers;
  std::string body;
};

inline HttpReply HttpGet(uint16_t port, const std::string& path, const std::string& extra_headers = "") {
  std::string raw = HttpExchange(port, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra_headers + "\r\n");
  HttpReply r;
  if (raw.size() > 12) r.status = std::stoi(raw.substr(9, 3));
  size_t split = raw.find("\r\n\r\n");
  if (split != std::string::npos) {
    r.headers = raw.substr(0, split);
    r.body = raw.substr(split + 4);
  }
  return r;
}

}  // namespace psd::testing

#endif  // PSD_TESTS_SUPPORT_HTTP_GET_H_
