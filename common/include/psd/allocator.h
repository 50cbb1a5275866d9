// How psd's processes (the daemon, the bench) have glibc's malloc keep big buffers.
//
// By default glibc maps every buffer above its (dynamic) mmap threshold fresh from the kernel and
// trims freed memory back to it: a buffer of a few MiB freed and allocated again per step — a
// serialized replica copy, a receive buffer, a value copied on write — comes back as zeroed pages,
// one page fault each (a quarter of a replicated shard's CPU in psd_bench). TuneAllocator has
// buffers of up to 32 MiB come from the heap and keeps up to 256 MiB of freed heap.
#ifndef PSD_ALLOCATOR_H_
#define PSD_ALLOCATOR_H_

namespace psd {

// Call once, first thing in main(). Does nothing when the operator tuned malloc already
// (GLIBC_TUNABLES, MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ in the environment) or with a
// libc other than glibc.
void TuneAllocator();

}  // namespace psd

#endif  // PSD_ALLOCATOR_H_
