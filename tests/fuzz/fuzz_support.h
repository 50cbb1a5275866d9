// Shared by the libFuzzer targets of tests/fuzz: feeding a fuzz input to psd's code as the bytes
// a peer sent on a stream socket. Not part of psd.
//
// Every target takes the same input: bytes as they arrive on a psd port (Cap'n Proto stream
// frames: segment table, then segments), so the seeds written by psd_fuzz_corpus serve all three.
#ifndef PSD_TESTS_FUZZ_FUZZ_SUPPORT_H_
#define PSD_TESTS_FUZZ_FUZZ_SUPPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "config/server_config.h"
#include "daemon/server.h"
#include "wire/asio.h"
#include "wire/frame.h"

namespace psd::fuzz {

// The largest input the targets take (run.sh passes -max_len with it): the socket buffers hold it
// whole, so feeding never blocks. Longer inputs are cut there.
constexpr size_t kMaxInputBytes = 64 << 10;

// A connected pair of local stream sockets (AF_UNIX) as asio tcp sockets on `io`: psd's code
// reads one end exactly as it reads a TCP connection; the target writes into the other. Aborts
// (a harness failure, not a finding) if the sockets cannot be made.
void MakeSocketPair(asio::io_context& io, tcp::socket* psd_end, tcp::socket* peer_end);

// Writes data (up to kMaxInputBytes) into `peer_end` and shuts its sending side down, so the
// reader sees the bytes and then end of stream.
void Feed(tcp::socket& peer_end, const uint8_t* data, size_t size);

// Reads and discards whatever is readable on `peer_end` now; returns the bytes read.
size_t Drain(tcp::socket& peer_end);

// Reads the frames of data with wire::ReadFrame (as the client does), at most `max_frames`, and
// calls `on_frame` with each one's reader; stops at the first framing error. A kj::Exception
// thrown while decoding a frame (malformed message) ends that frame only.
void ForEachFrame(const uint8_t* data, size_t size, uint64_t max_frame_bytes, int max_frames,
                  const std::function<void(capnp::MessageReader&)>& on_frame);

// The daemon settings the targets share: loopback on port 0, one I/O thread, frames up to 1 MiB and
// variables up to 4 MiB in all (so no input makes psd allocate much), no grace timers or summaries.
server::ServerConfig FuzzConfig();

// A fresh daemon for one input, started (bound, restored, serving) if `start`. Aborts (a harness
// failure, not a finding) if it cannot be made. The library's LLVMFuzzerInitialize turns psd's
// logging off for every target.
std::unique_ptr<server::Server> MakeServer(server::ServerConfig config, bool start);

}  // namespace psd::fuzz

#endif  // PSD_TESTS_FUZZ_FUZZ_SUPPORT_H_
