// RawPeer: a hand-driven connection to psd for tests that send what a client never would.
#ifndef PSD_TESTS_SUPPORT_RAW_PEER_H_
#define PSD_TESTS_SUPPORT_RAW_PEER_H_

#include <catch2/catch.hpp>
#include <string>

#include "psd.capnp.h"
#include "psd/status.h"
#include "wire/asio.h"
#include "wire/frame.h"

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

}  // namespace psd::testing

#endif  // PSD_TESTS_SUPPORT_RAW_PEER_H_
