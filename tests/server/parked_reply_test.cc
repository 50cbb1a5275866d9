// A parked collective's reply and its deadline (issue 11 item 8: the deadline timer used to live
// for its full timeout after the reply).
#include "net/parked_reply.h"

#include <catch2/catch.hpp>

using namespace psd;
using namespace psd::server;

TEST_CASE("answering a parked reply cancels its deadline: the loop runs out of work at once", "[net][races]") {
  asio::io_context io;
  auto reply = std::make_shared<ParkedReply>(io.get_executor());
  int expired = 0;
  ParkedReply::ArmDeadline(reply, std::chrono::hours(1), [&] { ++expired; });
  CHECK(reply->Answer());
  CHECK_FALSE(reply->Answer());  // exactly once
  // With the timer still pending the loop would have work for an hour: run_for would return at
  // its bound with the loop not stopped. Cancelled, it runs the aborted handler and stops.
  io.run_for(std::chrono::seconds(30));
  CHECK(io.stopped());
  CHECK(expired == 0);
  CHECK(reply.use_count() == 1);  // the handler let go of it
}

TEST_CASE("a deadline that passes first answers the reply once, a late completion is ignored", "[net][races]") {
  asio::io_context io;
  auto reply = std::make_shared<ParkedReply>(io.get_executor());
  int expired = 0;
  ParkedReply::ArmDeadline(reply, std::chrono::milliseconds(1), [&] { ++expired; });
  io.run();
  CHECK(expired == 1);
  CHECK(reply->answered());
  CHECK_FALSE(reply->Answer());
}
