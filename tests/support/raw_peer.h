// RawPeer: a hand-driven connection to psd for tests that send what a client never would.
#ifndef PSD_TESTS_SUPPORT_RAW_PEER_H_
#define PSD_TESTS_SUPPORT_RAW_PEER_H_

#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "psd.capnp.h"
#include "psd/status.h"
#include "wire/asio.h"
#include "wire/frame.h"
#include "wire/shm.h"

namespace psd::testing {

struct RawPeer {
  explicit RawPeer(uint16_t port) : socket(io) {
    socket.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  }
  void SendBytes(const std::string& bytes) { asio::write(socket, asio::buffer(bytes)); }
  void Send(wire::OutFrame& f) { REQUIRE(wire::WriteFrame(socket, f).ok()); }
  // Reads one response; returns false if the connection was closed instead.
  bool Read(Code* code, std::string* message, uint64_t* id = nullptr) {
    Status s = wire::ReadFrame(socket, in, 1 << 20);
    if (!s.ok()) return false;
    auto r = in.Reader();
    auto resp = r->getRoot<proto::Response>();
    *code = wire::FromWire(resp.getCode());
    *message = resp.getMessage();
    if (id) *id = resp.getId();
    return true;
  }
  // The code of the next response (its message in *message); fails the test if psd closed the
  // connection instead.
  Code Answer(std::string* message) {
    Code code = Code::kInternal;
    REQUIRE(Read(&code, message));
    return code;
  }
  bool ClosedByPeer() {
    char c;
    boost::system::error_code ec;
    socket.non_blocking(false, ec);  // wait for the close (the frame helpers made it non-blocking)
    socket.read_some(asio::buffer(&c, 1), ec);
    return ec == asio::error::eof || ec == asio::error::connection_reset;
  }
  // True if psd closes the connection within `limit` (a test bound, not a timing assert).
  bool ClosedWithin(std::chrono::seconds limit) {
    char c;
    bool closed = false;
    socket.async_read_some(asio::buffer(&c, 1), [&](boost::system::error_code ec, size_t) {
      closed = ec == asio::error::eof || ec == asio::error::connection_reset;
    });
    io.restart();
    io.run_for(limit);
    return closed;
  }
  void Hello(const std::string& name = "raw", const std::string& token = "") {
    wire::OutFrame f;
    auto h = f.builder.initRoot<proto::Request>();
    h.setId(1);
    auto hello = h.initHello();
    hello.setProtocolVersion(proto::PROTOCOL_VERSION);
    hello.setWorkerName(name);
    hello.setAuthToken(token);
    Send(f);
    REQUIRE(wire::ReadFrame(socket, in, 1 << 20).ok());
    auto r = in.Reader();
    auto resp = r->getRoot<proto::Response>();
    REQUIRE(resp.getCode() == proto::Code::OK);
    auto hr = resp.getHello();
    shm_socket = hr.getShmSocket();
    shm_nonce.assign(reinterpret_cast<const char*>(hr.getShmNonce().begin()), hr.getShmNonce().size());
    connection_id = hr.getConnectionId();
  }
  asio::io_context io;
  tcp::socket socket;
  wire::InFrame in;
  // From the hello's answer: where a segment may be attached (shm_test.cc).
  std::string shm_socket;
  std::string shm_nonce;
  uint64_t connection_id = 0;
};

// What psd's shared-memory socket answers to `message` with `fd` (-1: no descriptor) and, when
// given, `buffers_fd` (the shared buffers' arena). `passed`: the descriptors that came with the
// answer (psd's values segment, a lane's; the caller owns them), else they are closed.
inline std::string ShmAttach(const std::string& socket_name, const std::string& message, int fd, int buffers_fd = -1,
                             std::vector<int>* passed = nullptr) {
  auto sock = wire::ConnectAbstract(socket_name);
  REQUIRE(sock.ok());
  if (fd >= 0) {
    std::vector<int> fds{fd};
    if (buffers_fd >= 0) fds.push_back(buffers_fd);
    REQUIRE(wire::SendWithFds(*sock, message.data(), message.size(), fds).ok());
  } else {
    REQUIRE(::write(*sock, message.data(), message.size()) == static_cast<ssize_t>(message.size()));
  }
  std::string answer;
  char buf[512];
  ssize_t n;
  std::vector<int> got;
  while ((n = wire::ReadKeepingFds(*sock, buf, sizeof(buf), &got, wire::kShmMaxSentFds)) > 0) {
    answer.append(buf, static_cast<size_t>(n));
  }
  ::close(*sock);
  if (passed != nullptr) {
    *passed = std::move(got);
  } else {
    for (int f : got) ::close(f);
  }
  return answer;
}
// A push of one float32 [n] gradient "v" at step 0 whose bytes are in shared-memory segment
// `segment` (0: the connection's own; 1: the worker's shared buffers) at `offset`.
inline void PushFromShm(RawPeer& p, uint64_t id, uint64_t offset, int64_t n, unsigned segment = 0) {
  wire::OutFrame f;
  auto req = f.builder.initRoot<proto::Request>();
  req.setId(id);
  auto g = req.initPush().initGrads(1)[0];
  g.setName("v");
  auto t = g.initGrad();
  t.setDtype(proto::DType::FLOAT32);
  t.initShape(1).set(0, n);
  t.setInShm(true);
  t.setShmOffset(offset);
  t.setShmSegment(static_cast<uint8_t>(segment));
  p.Send(f);
}

}  // namespace psd::testing

#endif  // PSD_TESTS_SUPPORT_RAW_PEER_H_
