// The live status page served at / by the ops endpoint: one self-contained HTML document (inline
// CSS and JS, no external resources) that polls /status.json. Its source is daemon/status_page.html.
#ifndef PSD_SERVER_DAEMON_STATUS_PAGE_H_
#define PSD_SERVER_DAEMON_STATUS_PAGE_H_

namespace psd::server::ops {

extern const char kStatusPageHtml[];

}  // namespace psd::server::ops

#endif  // PSD_SERVER_DAEMON_STATUS_PAGE_H_
