// PSD_EXPORT marks libpsclient's public API. libpsclient is built with hidden visibility (as
// leveldb's LEVELDB_EXPORT does it), so only what carries this mark is visible to the programs that
// load it: its own Cap'n Proto, KJ, Asio and fmt stay private and cannot clash with other copies in
// the same process (a PyTorch interpreter, say). The daemon links the same code statically, where
// the mark changes nothing.
#ifndef PSD_EXPORT_H_
#define PSD_EXPORT_H_

#if defined(_WIN32)
#define PSD_EXPORT
#else
#define PSD_EXPORT __attribute__((visibility("default")))
#endif

#endif  // PSD_EXPORT_H_
