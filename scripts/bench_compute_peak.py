"""The compute limits the kernels are judged against: float32 FMA, bfloat16 dot products and int8 dot products
(VNNI; on AVX2 without it, the kernels' ``vpmaddubsw`` with 16-bit word sums, a ``vpmaddwd`` per four as 5-bit
quants take them), measured on this CPU with 1 thread and with every core, by chains of independent instructions
that never touch memory.

    python -m scripts.bench_compute_peak [--seconds 0.3] [--rounds 5]

A small C++ probe is compiled for this CPU (``g++ -O3 -march=native``) into a temporary folder: per instruction,
twelve independent accumulators (enough to hide each instruction's latency on the CPUs seen here) run the same
instruction in a loop on as many threads as asked, each pinned to nothing. An instruction the compiler's target
lacks (bfloat16 on an AVX2-only CPU, int8 dot products without AVX2) is reported as absent. Printed per instruction
and thread count: the best of ``--rounds`` runs in GFLOP/s (float) or GOP/s (int8: a multiply and an add per byte
pair), beside the CPU model and flags. ``bench_forward.py`` prints the kernels' own rates (matmuls in GOP/s,
attention in GOP/s) to set beside these.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from cpu_kernels.cpu_info import describe_cpu

PROBE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

constexpr int CHAINS = 12;
volatile float sink_f;
volatile int sink_i;

template <typename Step>
double run(int threads, long iterations, Step step) {
  auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&] { step(iterations); });
  for (auto& thread : pool) thread.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

#if defined(__AVX512F__)
void fma_f32(long n) {
  __m512 acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.0001f);
  for (long k = 0; k < n; ++k)
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  float s = 0; for (int i = 0; i < CHAINS; ++i) s += _mm512_reduce_add_ps(acc[i]);
  sink_f = s;
}
constexpr double FMA_OPS = 16 * 2;
#else
void fma_f32(long n) {
  __m256 acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(0.0001f);
  for (long k = 0; k < n; ++k)
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  float lanes[8]; float s = 0;
  for (int i = 0; i < CHAINS; ++i) { _mm256_storeu_ps(lanes, acc[i]); for (float v : lanes) s += v; }
  sink_f = s;
}
constexpr double FMA_OPS = 8 * 2;
#endif

#if defined(__AVX512VNNI__)
void dot_i8(long n) {
  __m512i acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (long k = 0; k < n; ++k)
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  int s = 0; for (int i = 0; i < CHAINS; ++i) s += _mm512_reduce_add_epi32(acc[i]);
  sink_i = s;
}
constexpr double DOT_I8_OPS = 64 * 2;
#elif defined(__AVXVNNI__)
void dot_i8(long n) {
  __m256i acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_set1_epi32(i);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
  for (long k = 0; k < n; ++k)
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], a, b);
  int lanes[8]; int s = 0;
  for (int i = 0; i < CHAINS; ++i) { _mm256_storeu_si256((__m256i*)lanes, acc[i]); for (int v : lanes) s += v; }
  sink_i = s;
}
constexpr double DOT_I8_OPS = 32 * 2;
#elif defined(__AVX2__)
// No VNNI: the AVX2 kernels' form (int8_blocks.h): vpmaddubsw's pair sums added as 16-bit words, one vpmaddwd
// widening four of them to 32 bits (kWordDots<5>: 5-bit quants; 4-bit ones widen every 8, 8-bit ones every one).
void dot_i8(long n) {
  __m256i acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_set1_epi32(i);
  const __m256i b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  const __m256i a0 = _mm256_set1_epi8(3), a1 = _mm256_set1_epi8(5), a2 = _mm256_set1_epi8(7), a3 = _mm256_set1_epi8(9);
  for (long k = 0; k < n; ++k)
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; ++i) {
      const __m256i x = _mm256_add_epi8(b, acc[i]);  // depends on the chain: nothing is hoisted out of the loop
      const __m256i low = _mm256_add_epi16(_mm256_maddubs_epi16(a0, x), _mm256_maddubs_epi16(a1, x));
      const __m256i high = _mm256_add_epi16(_mm256_maddubs_epi16(a2, x), _mm256_maddubs_epi16(a3, x));
      const __m256i words = _mm256_add_epi16(low, high);
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(words, ones));
    }
  int lanes[8]; int s = 0;
  for (int i = 0; i < CHAINS; ++i) { _mm256_storeu_si256((__m256i*)lanes, acc[i]); for (int v : lanes) s += v; }
  sink_i = s;
}
constexpr double DOT_I8_OPS = 4 * 32 * 2;
#else
#define NO_DOT_I8
#endif

#if defined(__AVX512BF16__)
void dot_bf16(long n) {
  __m512 acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3a83);
  for (long k = 0; k < n; ++k)
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  float s = 0; for (int i = 0; i < CHAINS; ++i) s += _mm512_reduce_add_ps(acc[i]);
  sink_f = s;
}
constexpr double DOT_BF16_OPS = 32 * 2;
#else
#define NO_DOT_BF16
#endif

template <typename Step>
void report(const char* name, Step step, double ops_per_instruction, int threads, double seconds, int rounds) {
  long n = 1 << 16;
  while (run(1, n, step) < seconds / 4) n *= 2;
  double best = 0;
  for (int r = 0; r < rounds; ++r) {
    double elapsed = run(threads, n, step);
    double rate = threads * (double)n * CHAINS * ops_per_instruction / elapsed / 1e9;
    if (rate > best) best = rate;
  }
  std::printf("%s %d %.1f\n", name, threads, best);
}

int main(int argc, char** argv) {
  int threads = std::atoi(argv[1]);
  double seconds = std::atof(argv[2]);
  int rounds = std::atoi(argv[3]);
  report("float32_fma", fma_f32, FMA_OPS, threads, seconds, rounds);
#ifndef NO_DOT_BF16
  report("bfloat16_dot", dot_bf16, DOT_BF16_OPS, threads, seconds, rounds);
#else
  std::printf("bfloat16_dot %d absent\n", threads);
#endif
#ifndef NO_DOT_I8
  report("int8_dot", dot_i8, DOT_I8_OPS, threads, seconds, rounds);
#else
  std::printf("int8_dot %d absent\n", threads);
#endif
  return 0;
}
"""


def compile_probe(folder: Path) -> Path:
    """The probe built for this CPU in ``folder``."""
    source, binary = folder / "peak.cpp", folder / "peak"
    source.write_text(PROBE)
    command = ["g++", "-O3", "-march=native", "-std=c++17", "-pthread", str(source), "-o", str(binary)]
    subprocess.run(command, check=True)
    return binary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.3, help="about how long one timed run lasts")
    parser.add_argument("--rounds", type=int, default=5, help="runs per instruction and thread count (the best kept)")
    args = parser.parse_args(argv)
    print(f"CPU: {describe_cpu()}")
    rates: dict[str, dict[int, str]] = {}
    with tempfile.TemporaryDirectory(prefix="compute-peak-") as folder:
        binary = compile_probe(Path(folder))
        for threads in sorted({1, os.cpu_count() or 1}):
            output = subprocess.run(
                [str(binary), str(threads), str(args.seconds), str(args.rounds)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            for line in output.splitlines():
                name, count, rate = line.split()
                rates.setdefault(name, {})[int(count)] = rate
    for name, by_threads in rates.items():
        unit = "GOP/s" if name.startswith("int8") else "GFLOP/s"
        cells = ", ".join(f"{count} thread{'s' if count > 1 else ''} {rate}" for count, rate in by_threads.items())
        print(f"{name:14} {unit:8} {cells}")


if __name__ == "__main__":
    main()
