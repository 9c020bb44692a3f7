// MagicPIG's decode attention over bucket tables (rag_jax/inference/magicpig.py, MagicPIGDecode with bucket_size /
// max_sampled) for XLA:CPU, called through jax.ffi by rag_jax/model/cpu_kernel.py. Per query row:
// 1. walk the query's bucket in each of the L tables (at most `bucket_size` slots each, in the table's slot
//    order), count each slot's collisions in a per-thread counter array and collect the slots whose count
//    reaches `min_collisions` among those `keep` allows; the first `max_sampled` in slot order are the sample
//    (O(L * bucket_size) per row where XLA's scatter-add and prefix-sum compaction cost O(n));
// 2. one softmax over the exact slots (score q.k / sqrt(d)) and the sampled ones (score minus
//    log u, u the analytic inclusion probability at the key's cosine to the query, keys centred by the mean
//    middle key; MagicPIG §4.2), and the weighted sum of their values: only those keys and values are read.
// Rows over all cores (std::thread, an atomic counter) when there is enough work.
#include "cpu_simd.h"

#include <cfloat>

struct Tables {
  const int32_t* codes;    // [R, L] the query rows' buckets
  const int32_t* order;    // [b * h, L, n]
  const int32_t* offsets;  // [b * h, L, buckets + 1]
  const uint8_t* keep;     // [b, n] slots that may be sampled
  int64_t L, n, buckets, group, heads, bucket_size, max_sampled, min_collisions;
};

struct Scratch {
  std::vector<int32_t> hits, touched, found;
  std::vector<float> logits, cosines;
  explicit Scratch(int64_t n) : hits(n, 0) {}
};

// The sample of row r into s.found (sorted, at most max_sampled).
static void sample_row(const Tables& T, int64_t r, Scratch& s) {
  const int64_t bh = r / T.group, b = bh / T.heads;  // rows are (batch, kv head, query in the group)
  const uint8_t* kb = T.keep + b * T.n;
  s.touched.clear();
  s.found.clear();
  for (int64_t t = 0; t < T.L; ++t) {
    const int32_t c = T.codes[r * T.L + t];
    const int32_t* off = T.offsets + (bh * T.L + t) * (T.buckets + 1);
    const int32_t* ord = T.order + (bh * T.L + t) * T.n;
    const int64_t e = std::min<int64_t>(off[c + 1], off[c] + T.bucket_size);
    for (int64_t j = off[c]; j < e; ++j) {
      const int32_t slot = ord[j];
      const int32_t h = ++s.hits[slot];
      if (h == 1) s.touched.push_back(slot);
      if (h == T.min_collisions && kb[slot]) s.found.push_back(slot);
    }
  }
  for (int32_t slot : s.touched) s.hits[slot] = 0;
  const int64_t m = std::min<int64_t>((int64_t)s.found.size(), T.max_sampled);
  std::partial_sort(s.found.begin(), s.found.begin() + m, s.found.end());
  s.found.resize(m);
}

// Rows in tasks of 4 over the cores when the bucket reads are worth a thread (a start costs ~1e4 reads).
template <typename F>
static void over_rows(const Tables& T, int64_t R, F&& row) {
  const int64_t per = 4, tasks = (R + per - 1) / per;
  const int threads = R * T.L * std::min(T.bucket_size, T.n) < 100000 ? 1 : (int)workers(tasks);
  std::atomic<int64_t> next{0};
  run_threads(threads, [&](int) {
    Scratch s(T.n);
    for (int64_t i; (i = next.fetch_add(1)) < tasks;)
      for (int64_t r = i * per; r < std::min(R, (i + 1) * per); ++r) row(r, s);
  });
}

// sqrt, log and arccos of 16 floats, for the inclusion probabilities below (Cephes sqrtf / logf / acosf: relative
// error ~1e-7, as the scalar functions to float32 rounding).
static inline v16 vsqrt(v16 x) {  // x >= 0
#if defined(__AVX512F__)
  return (v16)_mm512_sqrt_ps((__m512)x);
#else
  v16 r;
  for (int i = 0; i < 16; ++i) r[i] = __builtin_sqrtf(x[i]);
  return r;
#endif
}

// log(x) for x in [FLT_MIN, FLT_MAX]: x = m 2^e with m in [sqrt(1/2), sqrt(2)), a degree-8 polynomial in m - 1.
static inline v16 vlog(v16 x) {
  vi16 bits;
  std::memcpy(&bits, &x, sizeof(bits));
  vi16 e = ((bits >> 23) & 0xff) - 126;  // x = f 2^e, f in [0.5, 1)
  bits = (bits & 0x007fffff) | 0x3f000000;
  v16 f;
  std::memcpy(&f, &bits, sizeof(f));
  const vi16 small = f < 0.70710678118654752f;  // -1 there: f doubled, e - 1
  e = e + small;
  const v16 t = f - 1.f + (small ? f : v16{}), z = t * t, ef = __builtin_convertvector(e, v16);
  v16 y = t * 7.0376836292e-2f - 1.1514610310e-1f;
  y = y * t + 1.1676998740e-1f;
  y = y * t - 1.2420140846e-1f;
  y = y * t + 1.4249322787e-1f;
  y = y * t - 1.6668057665e-1f;
  y = y * t + 2.0000714765e-1f;
  y = y * t - 2.4999993993e-1f;
  y = y * t + 3.3333331174e-1f;
  y = y * t * z - 2.12194440e-4f * ef - 0.5f * z;
  return t + y + 0.693359375f * ef;
}

// arccos(x) for x in [-1, 1]: arcsin's odd polynomial on |x| <= 1/2, else arccos|x| = 2 arcsin(sqrt((1 - |x|) / 2)).
static inline v16 vacos(v16 x) {
  const v16 a = x < 0.f ? -x : x;
  const vi16 big = a > 0.5f;
  const v16 s = big ? vsqrt(0.5f * (1.f - a)) : x, z = s * s;
  v16 y = z * 4.2163199048e-2f + 2.4181311049e-2f;
  y = y * z + 4.5470025998e-2f;
  y = y * z + 7.4953002686e-2f;
  y = y * z + 1.6666752422e-1f;
  const v16 asin = y * z * s + s;
  const float pi = (float)M_PI;
  return big ? (x < 0.f ? pi - 2.f * asin : 2.f * asin) : pi / 2 - asin;
}

static inline bool any(vi16 c) {
  int32_t t = 0;
  for (int i = 0; i < 16; ++i) t |= c[i];
  return t != 0;
}

// log P[Binomial(L, r) >= m], r = (1 - arccos(cos) / pi)^bits, for 16 cosines, as magicpig.collision_probability
// in float32, clamped below at log FLT_MIN (the scalar exp, then log of max(u, FLT_MIN)); log_choose[j] =
// log C(L, j) for j <= m, ratio[j] = (L - j) / (j + 1) for j < L. Where L r >= m, 1 - the lower tail; elsewhere
// the upper tail from its first term (in log space) while any lane's terms are above 1e-9 of its sum (JAX sums a
// fixed 16 + 4 sqrt(L) terms: the same to float32 rounding).
static v16 log_inclusion(v16 cos, int64_t bits, int64_t L, int64_t m, const float* log_choose, const float* ratio) {
  cos = cos < -1.f ? v16{} - 1.f : cos;
  cos = cos > 1.f ? v16{} + 1.f : cos;
  v16 p = 1.f - vacos(cos) / (float)M_PI;
  p = p < FLT_MIN ? v16{} + FLT_MIN : p;
  const v16 log_r = (float)bits * vlog(p), r = vexp(log_r), u = 1.f - r;
  const v16 log_1mr = u == 1.f ? -r : vlog(u < FLT_MIN ? v16{} + FLT_MIN : u) * -r / (u - 1.f);  // log1p(-r)
  const vi16 lower_tail = (float)L * r >= (float)m;
  v16 lower{};
  for (int64_t j = 0; j < m; ++j) lower += vexp(log_choose[j] + (float)j * log_r + (float)(L - j) * log_1mr);
  const v16 odds = lower_tail ? v16{} : r / u;
  v16 term = v16{} + 1.f, series = term;
  for (int64_t j = m, end = std::min<int64_t>(L, m + 16 + 4 * (int64_t)std::sqrt((double)L) + 1); j < end; ++j) {
    term *= ratio[j] * odds;
    series += term;
    if (!any(term >= 1e-9f * series)) break;
  }
  const v16 one_minus = 1.f - lower;
  v16 out = lower_tail ? vlog(one_minus < FLT_MIN ? v16{} + FLT_MIN : one_minus)
                       : log_choose[m] + (float)m * log_r + (float)(L - m) * log_1mr + vlog(series);
  const float floor = std::log(FLT_MIN);
  return out < floor ? v16{} + floor : out;
}

static ffi::Error LshAttend(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                            ffi::Buffer<ffi::F32> key_mean, ffi::Buffer<ffi::S32> codes, ffi::Buffer<ffi::S32> order,
                            ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::U8> keep, ffi::Buffer<ffi::U8> exact,
                            ffi::ResultBuffer<ffi::F32> out, int64_t bucket_size, int64_t max_sampled,
                            int64_t min_collisions, int64_t bits) {
  auto qd = q.dimensions(), kd = k.dimensions(), cd = codes.dimensions(), od = order.dimensions(),
       fd = offsets.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || cd.size() != 4 || od.size() != 4 || fd.size() != 4)
    return ffi::Error::InvalidArgument("rag_jax_lsh_attend: q [b, h, g, d], k / v [b, h, n, d], codes [b, h, g, L]");
  const int64_t B = qd[0], H = qd[1], G = qd[2], D = qd[3], n = kd[2], L = cd[3], R = B * H * G;
  auto vd = v.dimensions(), md = key_mean.dimensions(), ked = keep.dimensions(), exd = exact.dimensions();
  if (kd[0] != B || kd[1] != H || kd[3] != D || D % 16 || vd.size() != 4 || vd[0] != B || vd[1] != H ||
      vd[2] != n || vd[3] != D || md.size() != 4 || md[0] != B || md[1] != H || md[2] != 1 || md[3] != D ||
      cd[0] != B || cd[1] != H || cd[2] != G || od[0] != B || od[1] != H || od[2] != L || od[3] != n ||
      fd[0] != B || fd[1] != H || fd[2] != L || ked.size() != 2 || ked[0] != B || ked[1] != n || exd.size() != 2 ||
      exd[0] != B || exd[1] != n)
    return ffi::Error::InvalidArgument("rag_jax_lsh_attend: inconsistent shapes (head_dim a multiple of 16)");
  const Tables T{codes.typed_data(), order.typed_data(), offsets.typed_data(), keep.typed_data(), L, n,
                 fd[3] - 1, G, H, bucket_size, max_sampled, min_collisions};
  std::vector<std::vector<int32_t>> exact_slots(B);  // the same for every head of a batch row
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < n; ++j)
      if (exact.typed_data()[b * n + j]) exact_slots[b].push_back((int32_t)j);
  const float scale = 1.0f / std::sqrt((float)D);
  std::vector<float> log_choose(min_collisions + 1);
  for (int64_t j = 0; j <= min_collisions; ++j)
    log_choose[j] = (float)(std::lgamma(L + 1.0) - std::lgamma(j + 1.0) - std::lgamma(L - j + 1.0));
  std::vector<float> ratio(L);
  for (int64_t j = 0; j < L; ++j) ratio[j] = (float)(L - j) / (j + 1);
  over_rows(T, R, [&](int64_t r, Scratch& s) {
    sample_row(T, r, s);
    const int64_t bh = r / G;
    const float* qr = q.typed_data() + r * D;
    const float* kh = k.typed_data() + bh * n * D;
    const float* vh = v.typed_data() + bh * n * D;
    const float* mean = key_mean.typed_data() + bh * D;
    const std::vector<int32_t>& ex = exact_slots[bh / H];
    auto sum16 = [](v16 a) { float t = 0.f; for (int j = 0; j < 16; ++j) t += a[j]; return t; };
    // the sampled keys are scattered over the cache: fetched PF keys ahead (a miss per key otherwise)
    auto prefetch = [&](const float* p) { for (int64_t x = 0; x < D; x += 16) __builtin_prefetch(p + x); };
    constexpr size_t PF = 8;
    v16 qq{};
    for (int64_t x = 0; x < D; x += 16) qq += load(qr + x) * load(qr + x);
    const float qn = std::max(std::sqrt(sum16(qq)), 1e-30f);
    const size_t ne = ex.size(), ns = s.found.size();
    auto slot = [&](size_t i) { return i < ne ? ex[i] : s.found[i - ne]; };
    std::vector<float>& logits = s.logits;  // reused across the thread's rows
    logits.resize(ne + ns);
    s.cosines.resize(ns + 16);
    std::fill(s.cosines.begin() + ns, s.cosines.end(), 0.f);  // the last vector's unused lanes
    for (size_t i = 0; i < ne + ns; ++i) {
      if (i + PF < ne + ns) prefetch(kh + slot(i + PF) * D);
      const float* kr = kh + slot(i) * D;
      v16 qk{}, qc{}, cc{};
      for (int64_t x = 0; x < D; x += 16) {
        const v16 kv = load(kr + x), c = kv - load(mean + x), qv = load(qr + x);
        qk += qv * kv;
        qc += qv * c;
        cc += c * c;
      }
      logits[i] = sum16(qk) * scale;
      if (i >= ne) s.cosines[i - ne] = sum16(qc) / (qn * std::max(std::sqrt(sum16(cc)), 1e-30f));  // centred key
    }
    // sampled keys: minus the log of their inclusion probability, 16 at a time
    for (size_t i = 0; i < ns; i += 16) {
      const v16 log_u = log_inclusion(load(s.cosines.data() + i), bits, L, min_collisions, log_choose.data(),
                                      ratio.data());
      for (size_t j = 0; j < std::min<size_t>(16, ns - i); ++j) logits[ne + i + j] -= log_u[j];
    }
    float mx = -INFINITY;
    for (float x : logits) mx = std::max(mx, x);
    float* o = out->typed_data() + r * D;
    std::fill(o, o + D, 0.f);
    double total = 0.0;
    for (size_t i = 0; i < ne + ns; ++i) {
      if (i + PF < ne + ns) prefetch(vh + slot(i + PF) * D);
      const float w = std::exp(logits[i] - mx);
      total += w;
      const float* vr = vh + slot(i) * D;
      for (int64_t x = 0; x < D; x += 16) store(o + x, load(o + x) + w * load(vr + x));
    }
    const float inv = total > 0 ? (float)(1.0 / total) : 0.f;  // no key at all: zeros
    for (int64_t x = 0; x < D; ++x) o[x] *= inv;
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RagJaxLshAttend, LshAttend,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("max_sampled")
                                  .Attr<int64_t>("min_collisions")
                                  .Attr<int64_t>("bits"));
