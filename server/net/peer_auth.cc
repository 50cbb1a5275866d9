#include "net/peer_auth.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

namespace psd::server::peer_auth {
namespace {

void PutU32(std::string* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out->push_back(static_cast<char>((v >> shift) & 0xff));
}

}  // namespace

Result<std::string> NewNonce() {
  std::string nonce(kNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) != 1) {
    char why[256];
    ERR_error_string_n(ERR_get_error(), why, sizeof(why));
    return Internal(std::string("OpenSSL RAND_bytes failed: ") + why);
  }
  return nonce;
}

std::string Proof(std::string_view secret, Role who, const Transcript& t) {
  if (t.dialer_nonce.size() != kNonceBytes || t.acceptor_nonce.size() != kNonceBytes) return "";
  // Fixed-length fields after a NUL-terminated label: no two transcripts encode alike.
  std::string msg = "psd-peer-link-v1";
  msg.push_back('\0');
  msg += who == Role::kDialer ? "dialer" : "acceptor";
  msg.push_back('\0');
  PutU32(&msg, t.cluster_size);
  PutU32(&msg, t.dialer);
  PutU32(&msg, t.acceptor);
  msg.append(t.dialer_nonce);
  msg.append(t.acceptor_nonce);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), mac, &len) == nullptr ||
      len != kProofBytes) {
    return "";
  }
  return std::string(reinterpret_cast<const char*>(mac), len);
}

bool Verify(std::string_view secret, Role who, const Transcript& t, std::string_view proof) {
  std::string want = Proof(secret, who, t);
  if (want.size() != kProofBytes || proof.size() != kProofBytes) return false;
  return CRYPTO_memcmp(want.data(), proof.data(), kProofBytes) == 0;
}

std::string LogLimiter::SuppressedNote(int64_t suppressed) {
  return suppressed > 0 ? " (" + std::to_string(suppressed) + " similar lines suppressed)" : "";
}

int64_t LogLimiter::Allow() {
  int64_t now =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
  int64_t start = window_start_ms_.load();
  if (start == INT64_MIN || now - start >= period_ms_) {
    if (window_start_ms_.compare_exchange_strong(start, now)) in_window_ = 0;
  }
  if (in_window_.fetch_add(1) >= burst_) {
    ++suppressed_;
    return -1;
  }
  return suppressed_.exchange(0);
}

}  // namespace psd::server::peer_auth
