// All-gathers between the ranks of one machine through a shared mapping, for tensor parallelism on a CPU host: each
// rank copies its bytes into its slot and publishes the call's sequence number; each then copies every rank's slot
// out in rank order once that rank has published. A gloo collective over loopback costs ~1 ms of wake-ups on a busy
// 2-core machine, and a tensor-parallel forward runs two a layer (docs/benchmarks.md).
//
// The mapping: `size` cache lines of published sequence numbers (one a rank), then two buffers of `size` slots of
// `slot_bytes` each; call s uses buffer s % 2. A rank writes buffer s % 2 at call s only after every rank published
// s - 1 (its own wait in call s - 1), and a rank publishes s - 1 only after reading buffer (s - 2) % 2 in call s - 2:
// no slot is written while a rank may still read it, without a second barrier.
#pragma once

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include <atomic>

namespace shm_gather {

constexpr int64_t kLineBytes = 64;

// A rank's line: the last sequence it published (wrapping at 2^32; compared by signed difference) and how many ranks
// sleep on it.
struct Line {
  std::atomic<uint32_t> published;
  std::atomic<uint32_t> sleepers;
};

inline Line* line(void* region, int32_t rank) {
  return reinterpret_cast<Line*>(static_cast<char*>(region) + rank * kLineBytes);
}

inline bool reached(const Line* of, uint32_t sequence) {
  return static_cast<int32_t>(of->published.load(std::memory_order_acquire) - sequence) >= 0;
}

inline char* slot(void* region, int32_t size, int64_t slot_bytes, uint32_t sequence, int32_t rank) {
  const int64_t buffer = sequence & 1;
  return static_cast<char*>(region) + size * kLineBytes + (buffer * size + rank) * slot_bytes;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A futex shared between processes (the mapping is MAP_SHARED, so not FUTEX_PRIVATE_FLAG); elsewhere than Linux a
// nap of the timeout's length.
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, const timespec* timeout) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, timeout, nullptr, 0);
#else
  (void)word, (void)seen;
  nanosleep(timeout, nullptr);
#endif
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

// Whether process `pid` has ended: no such process, or a zombie its parent has not reaped yet (torchrun reaps a dead
// rank only when it next polls).
inline bool process_is_gone(int32_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* stat = fopen(path, "r");
  if (stat == nullptr) return false;
  char text[512];
  const size_t n = fread(text, 1, sizeof text - 1, stat);
  fclose(stat);
  text[n] = '\0';
  const char* name_end = strrchr(text, ')');  // "pid (name) state ...": the name may hold anything
  return name_end != nullptr && name_end[1] == ' ' && (name_end[2] == 'Z' || name_end[2] == 'X');
}

// Waits until `rank` has published `sequence`: spinning for a few µs (the peer is usually about to), then asleep
// on its line's futex, so that the core goes to the peer or to this rank's other threads (grammar compiles). False
// if the peer's process is gone (checked every 10 ms asleep).
inline bool wait_for(void* region, int32_t rank, uint32_t sequence, int32_t pid) {
  Line* peer = line(region, rank);
  for (int spins = 0; spins < 1024; ++spins) {
    if (reached(peer, sequence)) return true;
    cpu_relax();
  }
  const timespec check_every{0, 10000000};
  while (!reached(peer, sequence)) {
    peer->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = peer->published.load(std::memory_order_seq_cst);
    if (static_cast<int32_t>(seen - sequence) < 0) futex_wait(&peer->published, seen, &check_every);
    peer->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (!reached(peer, sequence) && process_is_gone(pid)) return reached(peer, sequence);
  }
  return true;
}

// out[r * bytes, (r + 1) * bytes) = rank r's src, for every rank r of `size`; every rank calls it with the same
// sequence (1, 2, ...) and bytes (at most slot_bytes). Returns 0, or 1 + the first rank whose process is gone.
inline int32_t all_gather(void* region, int32_t rank, int32_t size, int64_t slot_bytes, int64_t sequence,
                          const void* src, int64_t bytes, void* out, const int32_t* pids) {
  const auto seq = static_cast<uint32_t>(sequence);
  memcpy(slot(region, size, slot_bytes, seq, rank), src, bytes);
  Line* own = line(region, rank);
  own->published.store(seq, std::memory_order_seq_cst);
  if (own->sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&own->published);
  for (int32_t r = 0; r < size; ++r) {
    if (r != rank && !wait_for(region, r, seq, pids[r])) return r + 1;
    memcpy(static_cast<char*>(out) + r * bytes, slot(region, size, slot_bytes, seq, r), bytes);
  }
  return 0;
}

}  // namespace shm_gather
