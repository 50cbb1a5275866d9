// TLS on the data port: certificates made here by deploy/make_tls_certs.sh; workers and tools
// connect with TLS, verify psd's certificate, and present their own with mutual TLS.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "support/captured_log.h"
#include "support/eventually.h"
#include "support/test_cluster.h"
#include "support/test_server.h"
#include "wire/frame.h"

using namespace psd;
using psd::testing::CapturedLog;
using psd::testing::Eventually;
using psd::testing::StartServer;
using psd::testing::StartTestCluster;
using psd::testing::TestConfig;

namespace {

// A fresh directory with a CA, a server and a client certificate.
std::string MakeCerts() {
  char tmpl[] = "/tmp/psd-tls-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  std::string dir = tmpl;
  std::string cmd = std::string("bash ") + PSD_SOURCE_DIR + "/deploy/make_tls_certs.sh " + dir + " >/dev/null";
  REQUIRE(std::system(cmd.c_str()) == 0);
  return dir;
}

struct Certs {
  Certs() : dir(MakeCerts()), other(MakeCerts()) {}
  ~Certs() {
    std::filesystem::remove_all(dir);
    std::filesystem::remove_all(other);
  }
  std::string dir;    // the cluster's CA and certificates
  std::string other;  // another CA's: not trusted by psd
};

server::ServerConfig TlsConfig(const Certs& c, bool mutual) {
  auto cfg = TestConfig(1, 4, 0);
  cfg.tls_cert_file = c.dir + "/server.pem";
  cfg.tls_key_file = c.dir + "/server.key";
  cfg.tls_ca_file = c.dir + "/ca.pem";
  cfg.tls_require_client_cert = mutual;
  return cfg;
}

psclient::ClientOptions TlsClient(uint16_t port, const std::string& name, const std::string& ca) {
  psclient::ClientOptions o;
  o.port = port;
  o.worker_name = name;
  o.connect_timeout_ms = 5000;
  o.tls_ca_file = ca;
  return o;
}

}  // namespace

TEST_CASE("TLS mismatches are logged saying what to fix", "[tls]") {
  Certs certs;
  CapturedLog log;  // outlives the daemons below
  SECTION("a TLS client at a daemon that does not speak TLS") {
    auto server = StartServer(TestConfig(1, 4, 0));
    auto o = TlsClient(server->port(), "w0", certs.dir + "/ca.pem");
    o.connect_timeout_ms = 2000;
    CHECK_FALSE(psclient::Client::Connect(o).ok());
    // Before: "frame has 16843543 segments (limit 65536)".
    CHECK(Eventually([&] { return log.Has("a TLS handshake at a port that does not speak TLS"); }));
  }
  SECTION("mutual TLS: a client certificate that does not allow client authentication") {
    // Signed by the right CA, but for servers only (extendedKeyUsage serverAuth), as some
    // corporate CAs issue them: before, both sides said the certificate did not name the host.
    const std::string d = certs.dir;
    const std::string cmd = "cd " + d +
                            " && openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=w0 "
                            "-keyout serveronly.key -out serveronly.csr 2>/dev/null"
                            " && printf 'extendedKeyUsage=serverAuth\\n' > serveronly.ext"
                            " && openssl x509 -req -in serveronly.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2"
                            " -extfile serveronly.ext -out serveronly.pem 2>/dev/null";
    REQUIRE(std::system(cmd.c_str()) == 0);
    auto server = StartServer(TlsConfig(certs, true));
    auto o = TlsClient(server->port(), "w0", d + "/ca.pem");
    o.tls_cert_file = d + "/serveronly.pem";
    o.tls_key_file = d + "/serveronly.key";
    auto c = psclient::Client::Connect(o);
    REQUIRE_FALSE(c.ok());
    CHECK_THAT(c.status().message(), Catch::Contains("clientAuth"));
    CHECK(Eventually([&] { return log.Has("the client's certificate: unsuitable certificate purpose"); }));
  }
}

TEST_CASE("a worker trains over TLS, psd's certificate is verified", "[tls]") {
  Certs certs;
  auto server = StartServer(TlsConfig(certs, false));
  auto o = TlsClient(server->port(), "w0", certs.dir + "/ca.pem");
  auto w = psclient::Client::Connect(o);
  INFO(w.status().ToString());
  REQUIRE(w.ok());
  std::vector<float> v(300000, 1.0f), g(300000, 0.5f);  // 1.2 MB: many TLS records each way
  REQUIRE((*w)->CreateVariable("v", {v.data(), DType::kFloat32, {int64_t(v.size())}, MemoryKind::kHost}).ok());
  REQUIRE((*w)->Push(0, {{"v", {g.data(), DType::kFloat32, {int64_t(g.size())}, MemoryKind::kHost}}}).ok());
  std::vector<float> out(v.size(), 0);
  REQUIRE((*w)->Pull("v", {out.data(), DType::kFloat32, {int64_t(out.size())}, MemoryKind::kHost}).ok());
  CHECK(out[0] < 1.0f);
  CHECK(out[0] == out[out.size() - 1]);

  SECTION("a client that trusts another CA refuses psd's certificate") {
    auto bad = psclient::Client::Connect(TlsClient(server->port(), "w1", certs.other + "/ca.pem"));
    REQUIRE_FALSE(bad.ok());
    CHECK_THAT(bad.status().message(), Catch::Contains("certificate verify failed"));
  }
  SECTION("a certificate that does not name the host dialled is refused") {
    auto o2 = TlsClient(server->port(), "w1", certs.dir + "/ca.pem");
    o2.tls_server_name = "psd.example.com";
    auto bad = psclient::Client::Connect(o2);
    REQUIRE_FALSE(bad.ok());
    CHECK_THAT(bad.status().message(), Catch::Contains("certificate verify failed"));
  }
  SECTION("a plaintext client gets nowhere and psd keeps serving") {
    psclient::ClientOptions plain;
    plain.port = server->port();
    plain.worker_name = "w1";
    plain.connect_timeout_ms = 2000;
    plain.request_timeout_ms = 5000;
    auto bad = psclient::Client::Connect(plain);
    REQUIRE_FALSE(bad.ok());
  }
  SECTION("garbage bytes on the TLS port are refused and psd keeps serving") {
    asio::io_context io;
    tcp::socket s(io);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), server->port()));
    std::string junk(4096, '\x16');
    boost::system::error_code ec;
    asio::write(s, asio::buffer(junk), ec);
    char c;
    s.read_some(asio::buffer(&c, 1), ec);  // psd answers with an alert or closes
  }
  REQUIRE((*w)->Pull("v", {out.data(), DType::kFloat32, {int64_t(out.size())}, MemoryKind::kHost}).ok());
}

TEST_CASE("a TLS cluster's worker reads the replies of a batch that one TLS read brought", "[tls][cluster]") {
  // An 8 MiB push in 1 MiB frames to two shards: each frame is answered in turn, and a TLS read
  // takes whole records, so the replies after the first are in the stream's buffers, not on the
  // socket. A cluster's client waits for a late reply asking the other shards whether to wait on;
  // it polled the socket for that, saw nothing, and every such push failed at the request deadline
  // with its chunks already added.
  Certs certs;
  auto cfg = TlsConfig(certs, false);
  cfg.total_replicas = 1;
  cfg.slice_bytes = 1 << 20;
  auto cluster = StartTestCluster(cfg, 2);
  auto o = TlsClient(0, "w0", certs.dir + "/ca.pem");
  o.cluster = cluster.addresses;
  o.connect_timeout_ms = 20000;
  o.request_timeout_ms = 20000;
  auto w = psd::testing::ConnectWith(o);
  const int64_t n = 2 << 20;  // 8 MiB of float32
  std::vector<float> v(static_cast<size_t>(n), 1.0f), g(static_cast<size_t>(n), 0.5f);
  REQUIRE(w->CreateVariable("v", {v.data(), DType::kFloat32, {n}, MemoryKind::kHost}).ok());
  int64_t local = 0;
  for (int i = 0; i < 3; ++i) {
    auto out = w->Push(local, {{"v", {g.data(), DType::kFloat32, {n}, MemoryKind::kHost}}}, true, 20000);
    INFO(out.status().ToString());
    REQUIRE(out.ok());
    REQUIRE(out->token_status.ok());
    local = out->token;
  }
  std::vector<float> after(static_cast<size_t>(n), 0.0f);
  REQUIRE(w->Pull("v", {after.data(), DType::kFloat32, {n}, MemoryKind::kHost}).ok());
  CHECK(after[0] == after[static_cast<size_t>(n) - 1]);
  CHECK(after[0] < 1.0f);
}

TEST_CASE("mutual TLS: psd refuses clients without a certificate signed by its CA", "[tls]") {
  Certs certs;
  auto server = StartServer(TlsConfig(certs, true));
  auto o = TlsClient(server->port(), "w0", certs.dir + "/ca.pem");
  SECTION("no client certificate") {
    auto c = psclient::Client::Connect(o);
    REQUIRE_FALSE(c.ok());
  }
  SECTION("a certificate from another CA") {
    o.tls_cert_file = certs.other + "/client.pem";
    o.tls_key_file = certs.other + "/client.key";
    auto c = psclient::Client::Connect(o);
    REQUIRE_FALSE(c.ok());
  }
  SECTION("the cluster's client certificate") {
    o.tls_cert_file = certs.dir + "/client.pem";
    o.tls_key_file = certs.dir + "/client.key";
    auto c = psclient::Client::Connect(o);
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    float x = 3;
    REQUIRE((*c)->CreateVariable("x", {&x, DType::kFloat32, {}, MemoryKind::kHost}).ok());
  }
}

TEST_CASE("TLS settings are checked at start and say what to fix", "[tls]") {
  Certs certs;
  auto cfg = TlsConfig(certs, false);
  SECTION("a key that does not match the certificate") {
    cfg.tls_key_file = certs.other + "/server.key";
    auto s = server::Server::Create(cfg);
    REQUIRE_FALSE(s.ok());
    CHECK_THAT(s.status().message(), Catch::Contains("does not match the certificate"));
  }
  SECTION("an encrypted key: refused at start, never a passphrase prompt") {
    const std::string enc = certs.dir + "/server-encrypted.key";
    const std::string cmd = "openssl pkey -in " + certs.dir + "/server.key -aes256 -passout pass:secret123 -out " + enc;
    REQUIRE(std::system(cmd.c_str()) == 0);
    cfg.tls_key_file = enc;
    auto s = server::Server::Create(cfg);  // before, OpenSSL asked on the terminal (or failed with a UI error)
    REQUIRE_FALSE(s.ok());
    CHECK_THAT(s.status().message(), Catch::Contains("is encrypted") && Catch::Contains("openssl pkey"));
  }
  SECTION("a missing file") {
    cfg.tls_cert_file = certs.dir + "/nope.pem";
    auto s = server::Server::Create(cfg);
    REQUIRE_FALSE(s.ok());
    CHECK_THAT(s.status().message(), Catch::Contains("cannot be read"));
  }
  SECTION("mutual TLS without a CA") {
    cfg.tls_ca_file.clear();
    cfg.tls_require_client_cert = true;
    auto s = server::Server::Create(cfg);
    REQUIRE_FALSE(s.ok());
    CHECK_THAT(s.status().message(), Catch::Contains("--tls-require-client-cert needs --tls-ca-file"));
  }
  SECTION("a client's TLS handshake with a daemon that never answers ends at its deadline") {
    asio::io_context io;
    tcp::acceptor silent(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    auto o = TlsClient(silent.local_endpoint().port(), "w0", certs.dir + "/ca.pem");
    o.connect_timeout_ms = 300;
    auto c = psclient::Client::Connect(o);  // the kernel accepts; nobody answers the ClientHello
    REQUIRE_FALSE(c.ok());
    CHECK(c.status().code() == Code::kDeadlineExceeded);
  }
}
