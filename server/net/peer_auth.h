// Peer-link authentication of a psd cluster (README "Running a cluster", "Protected mode"): a
// mutual challenge-response over the cluster secret (--cluster-secret-file), as pure functions
// (Connection and the coordinator's PeerLink run the exchange; tests check the rules directly).
//
// The exchange on a link from shard d (the dialer) to shard a (the acceptor) of a P-shard cluster:
//   d -> a   Hello{peer, shardIndex = d, clusterSize = P, peerNonce = Nd}
//   a -> d   HelloReply{shardIndex = a, shards = P, peerNonce = Na, peerProof = Proof(acceptor)}
//   d -> a   PeerProof{proof = Proof(dialer)}        (then d's peer messages, pipelined)
// Proof(who) = HMAC-SHA256(secret, "psd-peer-link-v1" | who | P | d | a | Nd | Na), so it binds the
// cluster size, both shard indexes, both fresh 32-byte nonces (RAND_bytes) and the direction: an
// acceptor's proof can never pass as a dialer's (no reflection), and a recorded proof is useless
// on another link (the other side's nonce is new). Only after the dialer's proof does the acceptor
// take the link's messages, and every message's sender must be d.
//
// What it does not do: encrypt, or authenticate each message after the exchange (an attacker who
// can inject into an established TCP stream can still forge messages on it; TLS does that).
//
// Thread-safety: the functions are pure apart from NewNonce (OpenSSL's generator is thread-safe);
// LogLimiter is safe from any thread.
#ifndef PSD_SERVER_NET_PEER_AUTH_H_
#define PSD_SERVER_NET_PEER_AUTH_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "psd/status.h"

namespace psd::server::peer_auth {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kProofBytes = 32;  // SHA-256

enum class Role { kDialer, kAcceptor };

// What a proof binds. Nonces must be kNonceBytes long (Proof/Verify refuse others).
struct Transcript {
  uint32_t cluster_size = 0;
  uint32_t dialer = 0;    // the shard that opened the link
  uint32_t acceptor = 0;  // the shard it dialed
  std::string_view dialer_nonce;
  std::string_view acceptor_nonce;
};

// kNonceBytes fresh random bytes (OpenSSL RAND_bytes); an error if the generator fails.
Result<std::string> NewNonce();

// `who`'s proof over `t` (kProofBytes); empty if a nonce has the wrong length.
std::string Proof(std::string_view secret, Role who, const Transcript& t);

// Whether `proof` is `who`'s proof over `t`, compared in constant time (CRYPTO_memcmp).
bool Verify(std::string_view secret, Role who, const Transcript& t, std::string_view proof);

// Rate limit for security logs fed by the network (spoofing attempts): at most `burst` lines per
// `period`; Allow() returns how many were suppressed since the last allowed line (>= 0), or -1
// when this one must be suppressed too.
class LogLimiter {
 public:
  explicit LogLimiter(int burst = 5, std::chrono::milliseconds period = std::chrono::seconds(10))
      : burst_(burst), period_ms_(period.count()) {}
  int64_t Allow();
  // What a line Allow() let through adds for those suppressed before it: "" or " (N similar lines
  // suppressed)".
  static std::string SuppressedNote(int64_t suppressed);

 private:
  const int burst_;
  const int64_t period_ms_;
  std::atomic<int64_t> window_start_ms_{INT64_MIN};
  std::atomic<int> in_window_{0};
  std::atomic<int64_t> suppressed_{0};
};

}  // namespace psd::server::peer_auth

#endif  // PSD_SERVER_NET_PEER_AUTH_H_
