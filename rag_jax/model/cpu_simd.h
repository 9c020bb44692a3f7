// Shared by the fused CPU kernels (cpu_attention.cc, cpu_xent.cc, cpu_lsh.cc): 16-float vectors (GCC/Clang vector
// extensions: AVX-512, AVX2 or NEON as the compiler targets), a vectorized exp and the process's core count.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));  // unaligned loads / stores

static inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
static inline void store(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }

#if defined(__AVX512F__)
#include <immintrin.h>
// exp(x) (Cephes expf: x = n ln 2 + r, n = round(x / ln 2), |r| <= ln 2 / 2, degree-5 polynomial in r; relative
// error ~1e-7), x clamped to [-87, 88]: callers need exp(x) for x <= 0 and multiply masked entries (whose x may
// be huge either way) by 0. AVX-512's roundscale and scalef (the polynomial times 2^n) replace the integer
// exponent arithmetic: 15 instead of 22 vector ops.
static inline v16 vexp(v16 x) {
  __m512 xv = _mm512_min_ps(_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xv);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_fmadd_ps(r, _mm512_set1_ps(1.9875691500e-4f), _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return (v16)_mm512_scalef_ps(y, n);
}
#else
// exp(x) without AVX-512 (Cephes expf: range reduction by log 2, degree-5 polynomial; relative error ~1e-7); x clamped to
// [-87, 88]: callers need exp(x) for x <= 0 and multiply masked entries by 0.
static inline v16 vexp(v16 x) {
  x = x < -87.f ? (v16{} - 87.f) : x;
  x = x > 88.f ? (v16{} + 88.f) : x;
  v16 fx = x * 1.44269504088896341f + 0.5f;
  v16 tf = __builtin_convertvector(__builtin_convertvector(fx, vi16), v16);
  v16 fl = tf + __builtin_convertvector(tf > fx, v16);  // floor: true lanes are -1
  x = x - fl * 0.693359375f - fl * -2.12194440e-4f;
  v16 y = x * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.f;
  vi16 e = (__builtin_convertvector(fl, vi16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return y * scale;
}

#endif

// Cores this process may run on (its CPU affinity), at least 1.
static inline int cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// Threads for `tasks` tasks of equal cost: one per core, or one per task where there are fewer than two per core,
// so the OS shares the cores among all of them (3 tasks on 2 cores then take 1.5 task-times, not 2: a
// Block-Attention last block of 50 queries over 3 KV heads, issue 28).
static inline int64_t workers(int64_t tasks) {
  const int64_t c = cores();
  return std::max<int64_t>(1, tasks < 2 * c ? tasks : c);
}

// work(i) on n threads, i = 0 (the caller) .. n - 1; returns when all are done.
template <typename F>
static void run_threads(int n, F&& work) {
  std::vector<std::thread> helpers;
  for (int i = 1; i < n; ++i) helpers.emplace_back(work, i);
  work(0);
  for (auto& t : helpers) t.join();
}
