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
  std::vector<float> logits;
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

// P[Binomial(L, r) >= m], r = (1 - arccos(cos) / pi)^bits, as magicpig.collision_probability, in float32 as
// there; log_choose[j] = log C(L, j) for j <= m, ratio[j] = (L - j) / (j + 1) for j < L.
static float inclusion(float cos, int64_t bits, int64_t L, int64_t m, const float* log_choose, const float* ratio) {
  const float p = 1.f - std::acos(std::min(1.f, std::max(-1.f, cos))) / (float)M_PI;
  const float log_r = (float)bits * std::log(p), r = std::exp(log_r), log_1mr = std::log1p(-r);
  if (L * r >= m) {
    float lower = 0.f;
    for (int64_t j = 0; j < m; ++j) lower += std::exp(log_choose[j] + j * log_r + (L - j) * log_1mr);
    return 1.f - lower;
  }
  // the upper tail from its first term; the terms shrink geometrically here, so stop once they are below 1e-9
  // of the sum (JAX sums a fixed 16 + 4 sqrt(L) terms: the same to float32 rounding)
  const float odds = r / (1.f - r);
  float term = 1.f, series = 1.f;
  for (int64_t j = m, end = std::min<int64_t>(L, m + 16 + 4 * (int64_t)std::sqrt((double)L) + 1); j < end; ++j) {
    term *= ratio[j] * odds;
    series += term;
    if (term < 1e-9f * series) break;
  }
  return std::exp(log_choose[m] + m * log_r + (L - m) * log_1mr) * series;
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
      if (i >= ne) {  // sampled: minus log of its inclusion probability at the centred key's cosine
        const float u = inclusion(sum16(qc) / (qn * std::max(std::sqrt(sum16(cc)), 1e-30f)), bits, L,
                                  min_collisions, log_choose.data(), ratio.data());
        logits[i] -= std::log(std::max(u, FLT_MIN));
      }
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
