// ParkedReply: the reply to a parked collective request (reduce_to, a replica-context update),
// answered exactly once — by the collective's completion or by its deadline, whichever comes
// first. Answering cancels the deadline timer at once, so a reply sent early holds nothing (the
// connection, the engine, the timer) for the rest of the timeout.
//
// Thread-safety: none; every member is touched on one strand (the connection's), which must be
// the executor the ParkedReply was made with.
#ifndef PSD_SERVER_NET_PARKED_REPLY_H_
#define PSD_SERVER_NET_PARKED_REPLY_H_

#include <chrono>
#include <functional>
#include <memory>

#include "wire/asio.h"

namespace psd::server {

class ParkedReply {
 public:
  explicit ParkedReply(const asio::any_io_executor& executor) : timer_(executor) {}
  ParkedReply(const ParkedReply&) = delete;
  ParkedReply& operator=(const ParkedReply&) = delete;

  // Claims the right to answer: true the first time (the caller sends the reply), false after.
  // Cancels the deadline.
  bool Answer();
  bool answered() const { return answered_; }

  // Arms the deadline: unless `reply` is answered first, `expire` runs on the executor after
  // `after` (and the reply counts as answered). The pending wait keeps `reply` alive.
  static void ArmDeadline(const std::shared_ptr<ParkedReply>& reply, std::chrono::milliseconds after,
                          std::function<void()> expire);

 private:
  bool answered_ = false;
  asio::steady_timer timer_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_NET_PARKED_REPLY_H_
