#include "connect.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "wire/shm.h"

namespace psclient::internal {
namespace {

using Clock = std::chrono::steady_clock;
using psd::tcp;

// The answer of a name lookup, shared with the thread that does it.
struct Lookup {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;                 // guarded by mu
  boost::system::error_code ec;      // guarded by mu
  std::vector<tcp::endpoint> found;  // guarded by mu
};

psd::Status Resolve(const std::string& host, uint16_t port, Clock::time_point deadline,
                    std::vector<tcp::endpoint>* out) {
  boost::system::error_code ec;
  auto address = psd::asio::ip::make_address(host, ec);
  if (!ec) {
    out->emplace_back(address, port);
    return psd::Status::Ok();
  }
  auto lookup = std::make_shared<Lookup>();
  std::thread([lookup, host, port] {
    psd::asio::io_context io;
    tcp::resolver resolver(io);
    boost::system::error_code ec;
    auto results = resolver.resolve(host, std::to_string(port), ec);
    std::lock_guard<std::mutex> lock(lookup->mu);
    lookup->ec = ec;
    for (const auto& r : results) lookup->found.push_back(r.endpoint());
    lookup->done = true;
    lookup->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(lookup->mu);
  if (!lookup->cv.wait_until(lock, deadline, [&] { return lookup->done; })) {
    return psd::Unavailable("cannot resolve '" + host + "' within the connect deadline");
  }
  if (lookup->ec) return psd::Unavailable("cannot resolve '" + host + "': " + lookup->ec.message());
  if (lookup->found.empty()) return psd::Unavailable("'" + host + "' has no address");
  *out = std::move(lookup->found);
  return psd::Status::Ok();
}

// One non-blocking connect, waited on until `deadline`.
psd::Status ConnectOne(tcp::socket& socket, const tcp::endpoint& ep, Clock::time_point deadline) {
  boost::system::error_code ec;
  if (socket.is_open()) socket.close(ec);
  socket.open(ep.protocol(), ec);
  if (!ec) socket.non_blocking(true, ec);
  if (ec) return psd::Unavailable("socket: " + ec.message());
  // ::connect, not socket.connect: Asio's synchronous connect waits for completion even on a
  // non-blocking socket, with no bound.
  if (::connect(socket.native_handle(), ep.data(), static_cast<socklen_t>(ep.size())) != 0) {
    // Interrupted, the connect goes on in the background: wait for it as for EINPROGRESS.
    ec = boost::system::error_code(errno == EINTR ? EINPROGRESS : errno, boost::system::system_category());
  }
  if (ec == psd::asio::error::in_progress || ec == psd::asio::error::would_block) {
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return psd::Unavailable("the connection was not accepted within the connect deadline");
      pollfd p{socket.native_handle(), POLLOUT, 0};
      int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left + 1, 1 << 30)));
      if (r < 0 && errno != EINTR) return psd::Unavailable(std::string("poll: ") + std::strerror(errno));
      if (r <= 0) continue;
      int err = 0;
      socklen_t len = sizeof(err);
      if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      ec = boost::system::error_code(err, boost::system::system_category());
      break;
    }
  }
  if (ec) return psd::Unavailable(ec.message());
  socket.non_blocking(false, ec);
  return psd::Status::Ok();
}

}  // namespace

psd::Status ConnectBefore(tcp::socket& socket, const std::string& host, uint16_t port, Clock::time_point deadline) {
  std::string where = host + ":" + std::to_string(port);
  std::vector<tcp::endpoint> endpoints;
  psd::Status s = Resolve(host, port, deadline, &endpoints);
  if (!s.ok()) return psd::Unavailable("cannot connect to psd at " + where + ": " + s.message());
  for (const tcp::endpoint& ep : endpoints) {
    s = ConnectOne(socket, ep, deadline);
    if (s.ok()) return s;
  }
  boost::system::error_code ec;
  socket.close(ec);
  return psd::Unavailable("cannot connect to psd at " + where + ": " + s.message());
}

std::string ReadAnswer(int fd, std::chrono::steady_clock::time_point deadline, std::vector<int>* passed) {
  std::string got;
  char buf[512];
  while (got.size() < sizeof(buf)) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return "no answer in time";
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (r < 0 && errno != EINTR) return std::string("poll: ") + std::strerror(errno);
    if (r <= 0) continue;
    ssize_t n = passed != nullptr ? psd::wire::ReadKeepingFds(fd, buf, sizeof(buf) - got.size(), passed, kMaxAnswerFds)
                                  : ::read(fd, buf, sizeof(buf) - got.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return std::string("read: ") + std::strerror(errno);
    if (n == 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  return got;
}

}  // namespace psclient::internal
