// The daemon's PeerNetwork (cluster/peer_network.h): one outgoing link to every other shard
// over TCP (TLS with --tls-cert-file), the cluster-secret handshake (cluster/peer_auth.h), peer
// messages encoded by service/peer_codec.h. Incoming links are the acceptor's connections
// (net/connection.h): they decode what arrives and hand it to the coordinator's events.
//
// Thread-safety: Send/SendStream/SendToAll from any thread; each link's I/O runs on its own strand. A
// message to this shard itself is posted to the io_context and delivered from there.
#ifndef PSD_SERVER_SERVICE_TCP_PEER_NETWORK_H_
#define PSD_SERVER_SERVICE_TCP_PEER_NETWORK_H_

#include <memory>
#include <string>
#include <vector>

#include "cluster/peer_network.h"
#include "wire/asio.h"
#include "wire/tls.h"

namespace psd::server {

class PeerLink;

class TcpPeerNetwork : public PeerNetwork {
 public:
  struct Options {
    std::vector<std::string> addresses;  // every shard's host:port
    int me = 0;
    std::string auth_token;      // the workers' token (psd checks it in every hello)
    std::string cluster_secret;  // empty: no challenge
    // Null: plain TCP; else the shard's client context (verifies the other shard's certificate
    // against --tls-ca-file and the host of its address, presents this shard's).
    std::shared_ptr<wire::ssl::context> tls;
  };
  TcpPeerNetwork(asio::io_context& io, Options options);
  ~TcpPeerNetwork() override;

  // Where this shard's messages to itself go (the coordinator; set before Start, must outlive the
  // io_context's handlers).
  void set_events(PeerEvents* events) { events_ = events; }
  // Opens the links (each reconnects every 100 ms while the other shard is down).
  void Start();
  // Closes the links after up to ~1 s for queued messages (a seal, the last commit) to leave.
  void Stop();

  void Send(int shard, const peer::Message& message) override;
  // Each link encodes the stream's next message when it has written the one before.
  void SendStream(int shard, MessageStream next) override;
  void Retarget(int shard, const std::string& address) override;
  void SendToAll(const peer::Message& message, bool include_self, int shards, int me) override;

 private:
  asio::io_context& io_;
  const Options options_;
  PeerEvents* events_ = nullptr;
  std::vector<std::shared_ptr<PeerLink>> links_;  // [shard]; null for this shard
};

}  // namespace psd::server

#endif  // PSD_SERVER_SERVICE_TCP_PEER_NETWORK_H_
