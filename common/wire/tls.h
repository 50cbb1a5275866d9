// TLS for psd's links (OpenSSL through Asio's SSL support): the contexts the daemon, its peer
// links and the client use, built from PEM files. Not a public header.
//
// Policy: TLS 1.2 or newer; a client always verifies the daemon's certificate against the CA file
// (or the system's trust store when none is given) and the host name it dialled (or
// `server_name`); a daemon asks for a client certificate, verified against its CA file, when
// told to require one (mutual TLS).
#ifndef PSD_WIRE_TLS_H_
#define PSD_WIRE_TLS_H_

#include <boost/asio/ssl.hpp>
#include <functional>
#include <memory>
#include <string>

#include "psd/status.h"
#include "wire/asio.h"
#include "wire/frame.h"

namespace psd::wire {

namespace ssl = boost::asio::ssl;

struct TlsFiles {
  std::string cert_file;  // PEM certificate chain (a daemon: required; a client: for mutual TLS)
  std::string key_file;   // its PEM private key
  std::string ca_file;    // PEM CA certificates to verify the other side ("" : the system's)
};

// A daemon's context: presents cert_file/key_file; with `require_client_cert`, a client must
// present a certificate signed by ca_file (required then). Errors name the file and the flag.
Result<std::shared_ptr<ssl::context>> MakeServerTlsContext(const TlsFiles& files, bool require_client_cert);
// A client's context (a worker, a tool, a shard dialling another shard): verifies the daemon
// against ca_file; presents cert_file/key_file when both are given.
Result<std::shared_ptr<ssl::context>> MakeClientTlsContext(const TlsFiles& files);
// Sets SNI and the host name the daemon's certificate must carry (DNS name or IP address).
Status SetTlsServerName(ssl::stream<tcp::socket>& stream, const std::string& name);

// Blocking helpers over a TLS stream for the client, with the same contract as frame.h's socket
// versions: nothing outlives `deadline`; past it the socket is closed (the stream is out of step)
// and the result is DEADLINE_EXCEEDED. They run the stream's io_context on the calling thread,
// which must not run it anywhere else.
Status TlsHandshake(ssl::stream<tcp::socket>& stream, Deadline deadline);
Status WriteFrame(ssl::stream<tcp::socket>& stream, OutFrame& frame, Deadline deadline = kNoDeadline);
// `stall_check` (if set) is asked every `check_ms` while the frame's first bytes have not come: a
// non-OK verdict ends the read with it (the socket closed), as the deadline would.
Status ReadFrame(ssl::stream<tcp::socket>& stream, InFrame& in, uint64_t max_frame_bytes,
                 Deadline deadline = kNoDeadline, const std::string& limit_name = "psd's --max-frame-bytes",
                 const Landing* landing = nullptr, const std::function<Status()>& stall_check = {},
                 int64_t check_ms = 0);

// An OpenSSL error queue / Asio SSL error as text that says what to check. `ssl` (the
// connection's, if known) adds why a certificate failed verification, and which side's it was.
std::string TlsErrorText(const boost::system::error_code& ec, const SSL* ssl = nullptr);

// Whether the first bytes a plain-TCP listener read are a TLS handshake record (a TLS client at
// a daemon that does not speak TLS).
bool LooksLikeTlsHandshake(const void* first_bytes, size_t n);

}  // namespace psd::wire

#endif  // PSD_WIRE_TLS_H_
