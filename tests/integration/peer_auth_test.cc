// Shard links cannot be spoofed (issue 11 item 1): against a running 3-shard cluster with a
// cluster secret, every impersonation a worker or an outsider can try — peer messages on a worker
// connection, a peer hello with a wrong secret, a claimed shard index without (or with a wrong,
// reflected or replayed) proof, a proven peer naming another shard as sender — is refused, and
// the cluster carries on unaffected: same term, epoch, chief, step and values, still serving.
// Without a cluster secret (loopback), the sender is still bound to the link's hello index.
#include "net/peer_auth.h"

#include <poll.h>

#include <catch2/catch.hpp>
#include <optional>

#include "support/test_cluster.h"
#include "support/test_server.h"
#include "wire/frame.h"

using namespace psd;
using psd::testing::TestConfig;
namespace pa = psd::server::peer_auth;

namespace {

const std::string kSecret = "the-cluster-secret-0123456789abcdef";

using Cluster = psd::testing::TestCluster;

// P shards, each serving on a socket bound on port 0 for it (no port is guessed).
Cluster StartCluster(server::ServerConfig cfg, int shards) { return psd::testing::StartTestCluster(cfg, shards); }
using psd::testing::ConnectCluster;

std::string Bytes(capnp::Data::Reader d) { return std::string(reinterpret_cast<const char*>(d.begin()), d.size()); }
kj::ArrayPtr<const kj::byte> Data(const std::string& s) {
  return kj::arrayPtr(reinterpret_cast<const kj::byte*>(s.data()), s.size());
}

// A raw connection speaking the wire protocol to one shard, as an attacker would.
struct Raw {
  explicit Raw(const std::string& address) : socket(io) {
    size_t colon = address.rfind(':');
    socket.connect(tcp::endpoint(asio::ip::make_address(address.substr(0, colon)),
                                 static_cast<uint16_t>(std::stoi(address.substr(colon + 1)))));
  }
  void Send(wire::OutFrame& f) {
    // A write may fail once psd has closed the connection: that is an outcome the test checks.
    (void)wire::WriteFrame(socket, f, std::chrono::steady_clock::now() + std::chrono::seconds(10));
  }
  void WorkerHello() {
    wire::OutFrame f;
    auto h = f.builder.initRoot<proto::Request>().initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setWorkerName("mallory");
    Send(f);
    REQUIRE(ReadReply() == Code::kOk);
  }
  void PeerHello(uint32_t claim, uint32_t shards, const std::string& nonce) {
    wire::OutFrame f;
    auto h = f.builder.initRoot<proto::Request>().initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setPeer(true);
    h.setShardIndex(claim);
    h.setClusterSize(shards);
    if (!nonce.empty()) h.setPeerNonce(Data(nonce));
    Send(f);
  }
  void Proof(const std::string& proof) {
    wire::OutFrame f;
    f.builder.initRoot<proto::Request>().setPeerProof(Data(proof));
    Send(f);
  }
  // A chief's order at a higher term to start over empty: acted on, it would change the term and
  // wipe every variable.
  void Restore(uint32_t from, uint64_t term) {
    wire::OutFrame f;
    auto m = f.builder.initRoot<proto::Request>().initPeer();
    m.setFrom(from);
    m.setTerm(term);
    auto r = m.initRestore();
    r.setEpoch(term);
    r.setStep(-1);
    Send(f);
  }
  // Reads one reply (its hello fields into the members); nullopt if the connection was closed.
  std::optional<Code> ReadReply() {
    last = wire::ReadFrame(socket, in, 1 << 20, std::chrono::steady_clock::now() + std::chrono::seconds(10));
    if (!last.ok()) return std::nullopt;
    auto reader = in.Reader();
    auto resp = reader->getRoot<proto::Response>();
    message = resp.getMessage();
    if (resp.which() == proto::Response::HELLO) {
      shard_index = resp.getHello().getShardIndex();
      nonce = Bytes(resp.getHello().getPeerNonce());
      proof = Bytes(resp.getHello().getPeerProof());
    }
    return wire::FromWire(resp.getCode());
  }
  // True once psd closed the connection (after replies still in flight); false if it stays open.
  bool Closed() {
    while (ReadReply().has_value()) {
    }
    return last.code() == Code::kUnavailable;
  }
  asio::io_context io;
  tcp::socket socket;
  wire::InFrame in;
  Status last;
  std::string message, nonce, proof;
  uint32_t shard_index = 0;
};

struct Snapshot {
  std::vector<server::ClusterCoordinator::View> views;
  std::vector<int64_t> steps;
  float w = 0;
};

Snapshot Take(Cluster& c, psclient::Client& worker) {
  Snapshot s;
  for (auto& shard : c.shards) {
    s.views.push_back(shard->coordinator()->Describe());
    s.steps.push_back(shard->engine()->global_step());
  }
  REQUIRE(worker.Pull({{"w", {&s.w, DType::kFloat32, {}, MemoryKind::kHost}}}).ok());
  return s;
}

void RequireSame(const Snapshot& a, const Snapshot& b) {
  REQUIRE(a.views.size() == b.views.size());
  for (size_t k = 0; k < a.views.size(); ++k) {
    INFO("shard " << k);
    CHECK(a.views[k].term == b.views[k].term);
    CHECK(a.views[k].epoch == b.views[k].epoch);
    CHECK(a.views[k].chief == b.views[k].chief);
    CHECK(a.views[k].state == b.views[k].state);
    CHECK(a.steps[k] == b.steps[k]);
  }
  CHECK(a.w == b.w);
}

// One synchronous step by the only training worker (R = 1, N = 2: a slot is left for the
// attacker's worker hello, and each step releases two tokens, both taken here): the cluster
// still serves.
int64_t Step(psclient::Client& worker, int64_t local) {
  float g = 1;
  auto out = worker.Push(local, {{"w", {&g, DType::kFloat32, {}, MemoryKind::kHost}}}, {}, true, 10000);
  REQUIRE(out.ok());
  REQUIRE(out->token_status.ok());
  auto second = worker.WaitToken(10000);
  REQUIRE(second.ok());
  REQUIRE(*second == out->token);
  return out->token;
}

}  // namespace

TEST_CASE("peer links: every impersonation of a shard is refused and the cluster is unaffected",
          "[cluster][peer_auth]") {
  auto cfg = TestConfig(1, 2, 0);
  cfg.cluster_secret = kSecret;
  auto cluster = StartCluster(cfg, 3);
  auto worker = ConnectCluster(cluster, "w0");
  float five = 5;
  REQUIRE(worker->CreateVariable("w", {&five, DType::kFloat32, {}, MemoryKind::kHost}).ok());
  int64_t local = Step(*worker, 0);
  local = Step(*worker, local);
  Snapshot before = Take(cluster, *worker);
  REQUIRE(before.steps[0] == 2);
  const int chief = before.views[0].chief;
  REQUIRE(chief >= 0);
  const int victim = (chief + 1) % 3;  // a follower, which obeys the chief's orders
  const int other = (chief + 2) % 3;   // the third shard, whose identity an attacker claims
  const uint64_t higher = before.views[static_cast<size_t>(victim)].term + 5;
  const std::string& at = cluster.addresses[static_cast<size_t>(victim)];

  SECTION("a worker connection can never carry peer messages") {
    Raw r(at);
    r.WorkerHello();
    r.Restore(static_cast<uint32_t>(chief), higher);
    CHECK(r.ReadReply() == Code::kFailedPrecondition);
    CHECK(r.Closed());
    // Nor become a peer by saying a peer hello after its worker hello.
    Raw r2(at);
    r2.WorkerHello();
    r2.PeerHello(static_cast<uint32_t>(chief), 3, *pa::NewNonce());
    CHECK(r2.ReadReply() == Code::kFailedPrecondition);
    r2.Restore(static_cast<uint32_t>(chief), higher);
    CHECK(r2.Closed());
  }
  SECTION("a peer hello without a challenge, or peer messages before the proof, are refused") {
    Raw r(at);
    r.PeerHello(static_cast<uint32_t>(chief), 3, "");
    r.Restore(static_cast<uint32_t>(chief), higher);
    CHECK(r.ReadReply() == Code::kUnauthenticated);
    CHECK_THAT(r.message, Catch::Contains("--cluster-secret-file"));
    CHECK(r.Closed());
    Raw r2(at);
    r2.PeerHello(static_cast<uint32_t>(chief), 3, *pa::NewNonce());
    REQUIRE(r2.ReadReply() == Code::kOk);
    r2.Restore(static_cast<uint32_t>(chief), higher);  // no proof yet: refused and closed
    CHECK(r2.ReadReply() == Code::kFailedPrecondition);
    CHECK_THAT(r2.message, Catch::Contains("proven peer link"));
    CHECK(r2.Closed());
    Raw r3(at);
    r3.PeerHello(static_cast<uint32_t>(chief), 3, *pa::NewNonce());
    REQUIRE(r3.ReadReply() == Code::kOk);
    r3.Proof(std::string(pa::kProofBytes, 'x'));  // nor a made-up proof
    CHECK(r3.ReadReply() == Code::kUnauthenticated);
    CHECK(r3.Closed());
    Raw r4(at);  // nor a peer message before any hello
    r4.Restore(static_cast<uint32_t>(chief), higher);
    CHECK(r4.ReadReply() == Code::kFailedPrecondition);
    CHECK(r4.Closed());
  }
  SECTION("a peer hello with a wrong secret is refused, and what follows it is never read") {
    Raw r(at);
    std::string mine = *pa::NewNonce();
    r.PeerHello(static_cast<uint32_t>(chief), 3, mine);
    REQUIRE(r.ReadReply() == Code::kOk);
    CHECK(r.shard_index == static_cast<uint32_t>(victim));
    pa::Transcript t{3, static_cast<uint32_t>(chief), static_cast<uint32_t>(victim), mine, r.nonce};
    // The shard proved itself (a dialer can tell it reached a real shard)...
    CHECK(pa::Verify(kSecret, pa::Role::kAcceptor, t, r.proof));
    // ...but the attacker's proof is made with the wrong secret.
    r.Proof(pa::Proof("a guessed secret, not the cluster's", pa::Role::kDialer, t));
    r.Restore(static_cast<uint32_t>(chief), higher);  // pipelined behind the proof
    CHECK(r.ReadReply() == Code::kUnauthenticated);
    CHECK_THAT(r.message, Catch::Contains("wrong cluster secret"));
    CHECK(r.Closed());
  }
  SECTION("a reflected proof (the shard's own answer sent back) is refused") {
    Raw r(at);
    std::string mine = *pa::NewNonce();
    r.PeerHello(static_cast<uint32_t>(chief), 3, mine);
    REQUIRE(r.ReadReply() == Code::kOk);
    r.Proof(r.proof);
    r.Restore(static_cast<uint32_t>(chief), higher);
    CHECK(r.ReadReply() == Code::kUnauthenticated);
    CHECK(r.Closed());
    // Nor is it usable on another shard as the same identity: each shard binds its own index.
    Raw r2(cluster.addresses[static_cast<size_t>(other)]);
    r2.PeerHello(static_cast<uint32_t>(chief), 3, mine);
    REQUIRE(r2.ReadReply() == Code::kOk);
    r2.Proof(r.proof);
    CHECK(r2.ReadReply() == Code::kUnauthenticated);
    CHECK(r2.Closed());
  }
  SECTION("a replayed proof (recorded from an earlier link) is refused") {
    // A recorded handshake: the dialer's nonce and its valid proof for the acceptor's nonce then.
    Raw first(at);
    std::string recorded_nonce = *pa::NewNonce();
    first.PeerHello(static_cast<uint32_t>(other), 3, recorded_nonce);
    REQUIRE(first.ReadReply() == Code::kOk);
    pa::Transcript then{3, static_cast<uint32_t>(other), static_cast<uint32_t>(victim), recorded_nonce, first.nonce};
    std::string recorded_proof = pa::Proof(kSecret, pa::Role::kDialer, then);
    // Replayed on a new connection with the same nonce: the shard's new challenge differs.
    Raw replay(at);
    replay.PeerHello(static_cast<uint32_t>(other), 3, recorded_nonce);
    REQUIRE(replay.ReadReply() == Code::kOk);
    CHECK(replay.nonce != first.nonce);
    replay.Proof(recorded_proof);
    replay.Restore(static_cast<uint32_t>(chief), higher);
    CHECK(replay.ReadReply() == Code::kUnauthenticated);
    CHECK(replay.Closed());
  }
  SECTION("a proven peer cannot send messages in another shard's name") {
    // Even a holder of the secret (a real shard's link) is bound to the index it proved.
    Raw r(at);
    std::string mine = *pa::NewNonce();
    r.PeerHello(static_cast<uint32_t>(other), 3, mine);
    REQUIRE(r.ReadReply() == Code::kOk);
    pa::Transcript t{3, static_cast<uint32_t>(other), static_cast<uint32_t>(victim), mine, r.nonce};
    r.Proof(pa::Proof(kSecret, pa::Role::kDialer, t));
    r.Restore(static_cast<uint32_t>(chief), higher);  // names the chief: not the link's shard
    CHECK(r.ReadReply() == Code::kInvalidArgument);
    CHECK(r.Closed());
  }
  SECTION("a peer hello claiming the shard itself, or another cluster size, is refused") {
    Raw r(at);
    r.PeerHello(static_cast<uint32_t>(victim), 3, *pa::NewNonce());
    CHECK(r.ReadReply() == Code::kInvalidArgument);
    CHECK(r.Closed());
    Raw r2(at);
    r2.PeerHello(static_cast<uint32_t>(chief), 4, *pa::NewNonce());
    CHECK(r2.ReadReply() == Code::kInvalidArgument);
    CHECK(r2.Closed());
    Raw r3(at);  // an index that is negative as an int
    r3.PeerHello(0xffffffffu, 3, *pa::NewNonce());
    CHECK(r3.ReadReply() == Code::kInvalidArgument);
    CHECK(r3.Closed());
  }

  // The cluster is unaffected: same term, epoch, chief and step everywhere, same value; and it
  // still serves.
  RequireSame(before, Take(cluster, *worker));
  local = Step(*worker, local);
  CHECK(local == 3);
  CHECK(cluster.shards[0]->engine()->global_step() == 3);
}

TEST_CASE("peer links without a cluster secret (loopback): the sender is the link's hello index",
          "[cluster][peer_auth]") {
  auto cfg = TestConfig(1, 2, 0);
  auto cluster = StartCluster(cfg, 3);
  auto worker = ConnectCluster(cluster, "w0");
  float five = 5;
  REQUIRE(worker->CreateVariable("w", {&five, DType::kFloat32, {}, MemoryKind::kHost}).ok());
  int64_t local = Step(*worker, 0);
  Snapshot before = Take(cluster, *worker);
  const int chief = before.views[0].chief;
  const int victim = (chief + 1) % 3, other = (chief + 2) % 3;
  Raw r(cluster.addresses[static_cast<size_t>(victim)]);
  r.PeerHello(static_cast<uint32_t>(other), 3, "");
  REQUIRE(r.ReadReply() == Code::kOk);
  r.Restore(static_cast<uint32_t>(chief), before.views[static_cast<size_t>(victim)].term + 5);
  CHECK(r.ReadReply() == Code::kInvalidArgument);
  CHECK(r.Closed());
  Raw w(cluster.addresses[static_cast<size_t>(victim)]);
  w.WorkerHello();
  w.Restore(static_cast<uint32_t>(chief), before.views[static_cast<size_t>(victim)].term + 5);
  CHECK(w.ReadReply() == Code::kFailedPrecondition);
  CHECK(w.Closed());
  RequireSame(before, Take(cluster, *worker));
  CHECK(Step(*worker, local) == 2);
}

TEST_CASE("with a cluster secret a shard's hello carries no auth token, and the cluster serves",
          "[cluster][peer_auth]") {
  // The workers' token went out in a shard's first hello, before the listener at the other shard's
  // address proved anything: whoever answered there (a reused address) collected it.
  auto cfg = TestConfig(1, 1, 0);
  cfg.cluster_secret = kSecret;
  cfg.auth_token = "the-workers-token";
  SECTION("what a shard sends to whoever answers at a peer's address") {
    SocketAddress mine, fake;
    auto fd = ListenTcp("127.0.0.1", 0, &mine);
    auto listener = ListenTcp("127.0.0.1", 0, &fake);
    REQUIRE(fd.ok());
    REQUIRE(listener.ok());
    server::ServerConfig shard = cfg;
    shard.cluster = {mine.ToString(), fake.ToString()};
    shard.shard_index = 0;
    shard.host = mine.ip;
    shard.port = mine.port;
    shard.listen_fd = *fd;
    auto s = server::Server::Create(shard);
    if (!s.ok()) ::close(*fd);
    REQUIRE(s.ok());
    REQUIRE((*s)->Start().ok());
    asio::io_context io;
    tcp::acceptor acceptor(io, tcp::v4(), *listener);
    pollfd p{*listener, POLLIN, 0};
    REQUIRE(::poll(&p, 1, 20000) == 1);  // the shard dials its peer
    tcp::socket peer(io);
    acceptor.accept(peer);
    wire::InFrame in;
    REQUIRE(wire::ReadFrame(peer, in, 1 << 20, std::chrono::steady_clock::now() + std::chrono::seconds(10)).ok());
    auto reader = in.Reader();
    auto req = reader->getRoot<proto::Request>();
    REQUIRE(req.which() == proto::Request::HELLO);
    auto h = req.getHello();
    CHECK(h.getPeer());
    CHECK(h.getPeerNonce().size() == pa::kNonceBytes);
    CHECK(h.getAuthToken().size() == 0);  // the proof, answered first by the listener, stands for it
  }
  SECTION("shards prove themselves with the secret alone; workers still need the token") {
    auto cluster = StartCluster(cfg, 2);
    psclient::ClientOptions o;
    o.cluster = cluster.addresses;
    o.worker_name = "w0";
    o.connect_timeout_ms = 20000;
    o.auth_token = cfg.auth_token;
    auto worker = psd::testing::ConnectWith(o);
    float five = 5;
    REQUIRE(worker->CreateVariable("w", {&five, DType::kFloat32, {}, MemoryKind::kHost}).ok());
    float g = 1;
    auto out = worker->Push(0, {{"w", {&g, DType::kFloat32, {}, MemoryKind::kHost}}}, {}, true, 10000);
    REQUIRE(out.ok());
    REQUIRE(out->token_status.ok());
    CHECK(out->token == 1);
    // A peer hello without the token gets nowhere but its challenge: a request before the proof is
    // refused as unauthenticated.
    Raw r(cluster.addresses[1]);
    r.PeerHello(0, 2, *pa::NewNonce());
    REQUIRE(r.ReadReply() == Code::kOk);
    wire::OutFrame f;
    f.builder.initRoot<proto::Request>().setStatus();
    r.Send(f);
    CHECK(r.ReadReply() == Code::kUnauthenticated);
  }
}
