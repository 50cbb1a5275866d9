// The one place psd includes Boost.Asio. Boost 1.74's Asio under -std=c++20 with g++ 12 uses
// std::exchange in awaitable.hpp without including <utility>; including it first fixes that.
#ifndef PSD_WIRE_ASIO_H_
#define PSD_WIRE_ASIO_H_

// clang-format off
#include <utility>  // must come first, see above
#include <boost/asio.hpp>
// clang-format on

namespace psd {
namespace asio = boost::asio;
using tcp = boost::asio::ip::tcp;
}  // namespace psd

#endif  // PSD_WIRE_ASIO_H_
