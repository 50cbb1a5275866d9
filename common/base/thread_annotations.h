// Clang thread-safety annotations (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html): with
// -Wthread-safety clang checks at compile time that state marked GUARDED_BY(mu) is only touched
// with `mu` held, that a function marked REQUIRES(mu) is only called with it held, and so on. The
// macros expand to nothing on other compilers (gcc builds are unaffected). Use them with the
// annotated Mutex of base/mutex.h: libstdc++'s std::mutex carries no annotations.
//
// The daemon's threads and locks, and the order they are taken in: docs/THREADING.md. The CI's
// clang build (tests/thread_safety/build.sh) fails on a -Wthread-safety warning.
#ifndef PSD_COMMON_BASE_THREAD_ANNOTATIONS_H_
#define PSD_COMMON_BASE_THREAD_ANNOTATIONS_H_

#if defined(__clang__)
#define PSD_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define PSD_THREAD_ANNOTATION(x)
#endif

// A class that is a lock (Mutex).
#define CAPABILITY(name) PSD_THREAD_ANNOTATION(capability(name))
// An RAII class that holds a lock for its lifetime (MutexLock).
#define SCOPED_CAPABILITY PSD_THREAD_ANNOTATION(scoped_lockable)
// A member read or written only with the lock held.
#define GUARDED_BY(mu) PSD_THREAD_ANNOTATION(guarded_by(mu))
// A pointer member whose pointee is read or written only with the lock held.
#define PT_GUARDED_BY(mu) PSD_THREAD_ANNOTATION(pt_guarded_by(mu))
// The caller holds the lock(s) (the *Locked functions).
#define REQUIRES(...) PSD_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
// The caller must not hold the lock(s): the function takes them itself (or runs callbacks that may).
#define EXCLUDES(...) PSD_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
// The function takes the lock and returns holding it / is called holding it and releases it.
#define ACQUIRE(...) PSD_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) PSD_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
// The function takes the lock if it returns `result`.
#define TRY_ACQUIRE(...) PSD_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
// Tells the analysis the lock is held from here on (a lock taken where it cannot see, e.g. in a
// vector of locks).
#define ASSERT_CAPABILITY(mu) PSD_THREAD_ANNOTATION(assert_capability(mu))
// The function returns a reference to the lock (an accessor).
#define RETURN_CAPABILITY(mu) PSD_THREAD_ANNOTATION(lock_returned(mu))
// Turns the analysis off for one function: only for the lock wrappers themselves.
#define NO_THREAD_SAFETY_ANALYSIS PSD_THREAD_ANNOTATION(no_thread_safety_analysis)

#endif  // PSD_COMMON_BASE_THREAD_ANNOTATIONS_H_
