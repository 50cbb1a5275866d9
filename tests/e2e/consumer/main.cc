// Connects to a psd that is not running: proves the installed headers and library work and
// that the public API needs neither Cap'n Proto nor Asio headers.
#include <cstdio>

#include "psclient/client.h"
#include "psclient/sync_replicas_optimizer.h"

int main() {
  psclient::ClientOptions o;
  o.port = 1;  // nothing listens there
  o.connect_timeout_ms = 100;
  auto c = psclient::Client::Connect(o);
  std::printf("%s\n", c.status().ToString().c_str());
  return c.status().code() == psclient::Code::kUnavailable ? 0 : 1;
}
