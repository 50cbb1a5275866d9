#include "wire/tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <fstream>
#include <functional>
#include <memory>

namespace psd::wire {
namespace {

Status Readable(const std::string& path, const char* what) {
  std::ifstream f(path);
  if (!f) return InvalidArgument(std::string(what) + " '" + path + "' cannot be read: check the path and permissions");
  return Status::Ok();
}

std::string OpenSslText(const boost::system::error_code& ec) {
  std::string text = ec.message();
  if (ec.category() == boost::asio::error::get_ssl_category()) {
    char buf[256];
    ERR_error_string_n(static_cast<unsigned long>(ec.value()), buf, sizeof(buf));
    text = buf;
  }
  return text;
}

Status Load(ssl::context& ctx, const TlsFiles& f, const char* who) {
  boost::system::error_code ec;
  bool mismatch = false;
  if (!f.cert_file.empty()) {
    PSD_RETURN_IF_ERROR(Readable(f.cert_file, "the TLS certificate file"));
    ctx.use_certificate_chain_file(f.cert_file, ec);
    if (ec)
      return InvalidArgument(std::string(who) + ": the TLS certificate file '" + f.cert_file +
                             "' is not a PEM certificate chain: " + OpenSslText(ec));
    PSD_RETURN_IF_ERROR(Readable(f.key_file, "the TLS key file"));
    // An encrypted key would have OpenSSL ask for its passphrase on the terminal (a daemon under
    // systemd then fails with a UI error, one on a terminal hangs): no passphrase is given, and
    // the error says what to do.
    auto encrypted = std::make_shared<bool>(false);  // the context keeps the callback
    ctx.set_password_callback([encrypted](size_t, ssl::context::password_purpose) {
      *encrypted = true;
      return std::string();
    });
    ctx.use_private_key_file(f.key_file, ssl::context::pem, ec);
    if (*encrypted) {
      return InvalidArgument(std::string(who) + ": the TLS key file '" + f.key_file +
                             "' is encrypted, and psd reads unencrypted keys only: write it out decrypted "
                             "(openssl pkey -in KEY -out KEY.plain), readable by this user alone (chmod 600)");
    }
    if (ec && OpenSslText(ec).find("key values mismatch") != std::string::npos) {
      mismatch = true;  // a readable key, but not this certificate's
      ec.clear();
    }
    if (ec)
      return InvalidArgument(std::string(who) + ": the TLS key file '" + f.key_file +
                             "' is not a PEM private key: " + OpenSslText(ec));
    if (mismatch || SSL_CTX_check_private_key(ctx.native_handle()) != 1) {
      return InvalidArgument(std::string(who) + ": the TLS key file '" + f.key_file +
                             "' does not match the certificate '" + f.cert_file + "'");
    }
  }
  if (!f.ca_file.empty()) {
    PSD_RETURN_IF_ERROR(Readable(f.ca_file, "the TLS CA file"));
    ctx.load_verify_file(f.ca_file, ec);
    if (ec)
      return InvalidArgument(std::string(who) + ": the TLS CA file '" + f.ca_file +
                             "' holds no PEM certificate: " + OpenSslText(ec));
  }
  return Status::Ok();
}

void Harden(ssl::context& ctx) {
  ctx.set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 | ssl::context::no_sslv3 |
                  ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 | ssl::context::single_dh_use);
  SSL_CTX_set_min_proto_version(ctx.native_handle(), TLS1_2_VERSION);
  SSL_CTX_set_mode(ctx.native_handle(), SSL_MODE_RELEASE_BUFFERS);
}

}  // namespace

Result<std::shared_ptr<ssl::context>> MakeServerTlsContext(const TlsFiles& files, bool require_client_cert) {
  if (files.cert_file.empty() || files.key_file.empty()) {
    return InvalidArgument("TLS needs both --tls-cert-file and --tls-key-file");
  }
  if (require_client_cert && files.ca_file.empty()) {
    return InvalidArgument(
        "--tls-require-client-cert needs --tls-ca-file (the CA that signs the clients' certificates)");
  }
  auto ctx = std::make_shared<ssl::context>(ssl::context::tls_server);
  Harden(*ctx);
  PSD_RETURN_IF_ERROR(Load(*ctx, files, "psd"));
  if (require_client_cert) {
    ctx->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
  }
  return ctx;
}

Result<std::shared_ptr<ssl::context>> MakeClientTlsContext(const TlsFiles& files) {
  if (files.cert_file.empty() != files.key_file.empty()) {
    return InvalidArgument("a TLS client certificate needs both its certificate file and its key file");
  }
  auto ctx = std::make_shared<ssl::context>(ssl::context::tls_client);
  Harden(*ctx);
  if (files.ca_file.empty()) ctx->set_default_verify_paths();
  PSD_RETURN_IF_ERROR(Load(*ctx, files, "TLS client"));
  ctx->set_verify_mode(ssl::verify_peer);
  return ctx;
}

Status SetTlsServerName(ssl::stream<tcp::socket>& stream, const std::string& name) {
  SSL* ssl = stream.native_handle();
  boost::system::error_code ec;
  asio::ip::make_address(name, ec);
  bool is_ip = !ec;
  if (!is_ip && SSL_set_tlsext_host_name(ssl, name.c_str()) != 1) {
    return InvalidArgument("TLS: cannot use '" + name + "' as the server name");
  }
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
  X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
  int ok =
      is_ip ? X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str()) : X509_VERIFY_PARAM_set1_host(param, name.c_str(), 0);
  if (ok != 1) return InvalidArgument("TLS: cannot verify the daemon's certificate against '" + name + "'");
  return Status::Ok();
}

namespace {

// Runs one async operation on the stream's io_context until it completes or the deadline passes
// (then the socket is closed and the aborted operation drained). `stall_check` (if set) is asked
// every `check_ms` while the operation is pending: a non-OK verdict ends it the same way, with
// that status.
template <typename StartOp>
Status RunUntil(ssl::stream<tcp::socket>& stream, Deadline deadline, const char* what, StartOp start,
                const std::function<Status()>& stall_check = {}, int64_t check_ms = 0) {
  auto& io = static_cast<asio::io_context&>(stream.get_executor().context());
  bool done = false;
  boost::system::error_code result;
  start([&](const boost::system::error_code& ec, size_t = 0) {
    result = ec;
    done = true;
  });
  io.restart();
  Status verdict;
  while (!done) {
    Deadline until = deadline;
    if (stall_check) until = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(check_ms));
    size_t ran = until == kNoDeadline ? io.run_one() : io.run_one_until(until);
    if (ran > 0 || done) continue;
    if (!stall_check || std::chrono::steady_clock::now() >= deadline) break;
    verdict = stall_check();
    if (!verdict.ok()) break;
    io.restart();  // run_one_until returned for the slice's end: run on
  }
  if (!done) {
    boost::system::error_code ignored;
    stream.lowest_layer().close(ignored);
    io.restart();
    while (!done && io.run_one() > 0) {
    }
    if (!verdict.ok()) return verdict;
    return DeadlineExceeded("no answer from psd before the deadline");
  }
  if (result) {
    if (result == asio::error::eof || result == asio::error::connection_reset ||
        result == ssl::error::stream_truncated) {
      return Unavailable(std::string("connection lost: ") + result.message());
    }
    return Unavailable(std::string(what) + " failed: " + TlsErrorText(result, stream.native_handle()));
  }
  return Status::Ok();
}

}  // namespace

Status TlsHandshake(ssl::stream<tcp::socket>& stream, Deadline deadline) {
  return RunUntil(stream, deadline, "TLS handshake", [&](auto done) {
    stream.async_handshake(ssl::stream_base::client, [done](const boost::system::error_code& ec) mutable { done(ec); });
  });
}

Status WriteFrame(ssl::stream<tcp::socket>& stream, OutFrame& frame, Deadline deadline) {
  auto buffers = frame.Buffers();
  return RunUntil(stream, deadline, "TLS write", [&](auto done) { asio::async_write(stream, buffers, done); });
}

Status ReadFrame(ssl::stream<tcp::socket>& stream, InFrame& in, uint64_t max_frame_bytes, Deadline deadline,
                 const std::string& limit_name, const Landing* landing, const std::function<Status()>& stall_check,
                 int64_t check_ms) {
  // The wait for the frame's first bytes is where stall_check is asked: the stream's own buffers may
  // hold them already (a TLS read takes whole records), so the socket is not polled for them.
  bool first = true;
  auto read = [&](void* p, size_t n) {
    const std::function<Status()> none;
    const bool check = first;
    first = false;
    return RunUntil(
        stream, deadline, "TLS read", [&](auto done) { asio::async_read(stream, asio::buffer(p, n), done); },
        check ? stall_check : none, check_ms);
  };
  return ReadFrameWith(read, in, max_frame_bytes, limit_name, landing);
}

std::string TlsErrorText(const boost::system::error_code& ec, const SSL* ssl) {
  std::string text = OpenSslText(ec);
  const long verified = ssl != nullptr ? SSL_get_verify_result(ssl) : X509_V_OK;
  if (text.find("certificate verify failed") != std::string::npos && ssl != nullptr && SSL_is_server(ssl) == 1) {
    text += std::string(" (the client's certificate: ") +
            (verified != X509_V_OK ? X509_verify_cert_error_string(verified) : "refused") +
            "; it must be signed by the CA in --tls-ca-file and allow client authentication — extendedKeyUsage "
            "clientAuth; a shard's certificate, which it also presents when it dials the others, needs both "
            "serverAuth and clientAuth)";
  } else if (text.find("certificate verify failed") != std::string::npos) {
    text += std::string(" (") + (verified != X509_V_OK ? X509_verify_cert_error_string(verified) : "verification") +
            ": the other side's certificate is not signed by the CA file given, has expired, does not name the "
            "host dialled, or is not for a server (extendedKeyUsage serverAuth): check --tls-ca-file / "
            "tls_ca_file, tls_server_name and the certificate)";
  } else if (text.find("unsupported certificate") != std::string::npos) {
    text +=
        " (the other side refused a certificate for its purpose: a daemon's certificate needs extendedKeyUsage "
        "serverAuth, a client's or a dialing shard's clientAuth, a shard's both)";
  } else if (text.find("unknown ca") != std::string::npos) {
    text += " (the other side does not trust this side's certificate: sign it with the CA in its --tls-ca-file)";
  } else if (text.find("wrong version number") != std::string::npos ||
             text.find("packet length too long") != std::string::npos) {
    text += " (one side speaks TLS and the other does not: give both the TLS settings, or neither)";
  } else if (text.find("certificate required") != std::string::npos ||
             text.find("peer did not return a certificate") != std::string::npos) {
    text += " (psd runs with --tls-require-client-cert: give the client a certificate and key)";
  }
  return text;
}

bool LooksLikeTlsHandshake(const void* first_bytes, size_t n) {
  // A TLS record: content type 22 (handshake), then the protocol version's major byte 3.
  const auto* b = static_cast<const uint8_t*>(first_bytes);
  return n >= 3 && b[0] == 0x16 && b[1] == 0x03 && b[2] <= 0x04;
}

}  // namespace psd::wire
