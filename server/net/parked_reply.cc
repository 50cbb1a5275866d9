#include "net/parked_reply.h"

namespace psd::server {

bool ParkedReply::Answer() {
  if (answered_) return false;
  answered_ = true;
  timer_.cancel();  // its handler runs now (operation_aborted) and lets go of this reply
  return true;
}

void ParkedReply::ArmDeadline(const std::shared_ptr<ParkedReply>& reply, std::chrono::milliseconds after,
                              std::function<void()> expire) {
  reply->timer_.expires_after(after);
  reply->timer_.async_wait([reply, expire = std::move(expire)](boost::system::error_code ec) {
    if (ec || !reply->Answer()) return;
    expire();
  });
}

}  // namespace psd::server
