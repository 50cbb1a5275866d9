// Fuzz target `worker_request`: a worker connection of a live single psd. The input is one byte
// choosing the daemon's settings (WorkerConfig) followed by the byte stream a worker sends; it goes, through a local
// socket pair, into a real Connection of a real Server (started on 127.0.0.1:0, so it is restored and serving), which
// frames it, enforces the pre-hello limit, dispatches every request to the engine and writes its replies. A fresh
// Server per input keeps runs reproducible. The connection runs on an io_context driven by this thread only (poll,
// never run), so an input's processing is deterministic and ends when nothing is left to do: the input ends with end of
// stream, which closes the connection and cancels what it parked. Nothing may crash, leak or hit undefined behaviour.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "fuzz_support.h"
#include "net/connection.h"
#include "daemon/server.h"
#include "service/worker_session.h"

namespace {

// The settings byte: bits 0-1 the mode (sync, async, ssp, sync with soft sync at half the
// replicas), bit 2 reduction sum, bit 3 moving averages, bit 4 two replicas to aggregate (a step
// then never completes with one connection: pushes stay accumulated until the connection closes).
psd::server::ServerConfig WorkerConfig(uint8_t settings) {
  using psd::server::Mode;
  psd::server::ServerConfig config = psd::fuzz::FuzzConfig();
  config.default_token_timeout_ms = 50;
  switch (settings & 3) {
    case 1:
      config.mode = Mode::kAsync;
      break;
    case 2:
      config.mode = Mode::kSsp;
      break;
    case 3:
      config.soft_sync_fraction = 0.5;
      break;
    default:
      break;
  }
  if (settings & 4) config.reduction = psd::server::Reduction::kSum;
  if (settings & 8) config.ema_decay = 0.9;
  if (settings & 16) config.replicas_to_aggregate = 2;
  return config;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace asio = boost::asio;
  using psd::tcp;
  if (size == 0) return 0;
  psd::server::ServerConfig config = WorkerConfig(data[0]);
  ++data;
  --size;
  std::unique_ptr<psd::server::Server> server = psd::fuzz::MakeServer(std::move(config), /*start=*/true);
  {
    asio::io_context io;
    tcp::socket psd_end(io), worker_end(io);
    psd::fuzz::MakeSocketPair(io, &psd_end, &worker_end);
    auto conn = std::make_shared<psd::server::Connection>(std::move(psd_end), server->connection_env(), /*id=*/1);
    conn->Start(std::make_shared<psd::server::WorkerSession>(*server, conn));
    psd::fuzz::Feed(worker_end, data, size);
    // Until two rounds in a row run no handler and read no reply (replies are read as they come,
    // so the connection's writes never block). Bounded: an input has at most kMaxInputBytes.
    for (int quiet = 0, round = 0; quiet < 2 && round < 100000; ++round) {
      size_t ran = io.poll();
      size_t read = psd::fuzz::Drain(worker_end);
      quiet = (ran == 0 && read == 0) ? quiet + 1 : 0;
      if (io.stopped()) io.restart();
    }
    // Stopping the server cancels what is still parked in its engine (their handlers are posted
    // to `io`); they run while the server still exists, and the connection's remaining handlers
    // are dropped with `io`, before the server goes.
    server->Stop();
    io.restart();
    io.poll();
    conn->CloseNow();  // the connection and its session hold each other until it closes
    io.restart();
    io.poll();
  }
  server.reset();
  return 0;
}
