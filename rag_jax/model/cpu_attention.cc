// Fused flash-attention forward for XLA:CPU (FlashAttention, Dao et al., NeurIPS 2022, Alg. 1), called through
// jax.ffi by rag_jax/model/cpu_kernel.py. One task = one (batch row, KV head, block of QB query rows); tasks run
// on all cores of the process (std::thread, an atomic task counter). Per task, every KV tile of KB keys that
// the structural mask reaches is visited once for all query heads of the KV head's group: the mask (the
// predicate of rag_jax/model/masks.py, skipped for tiles a range test proves empty or full), QK^T on
// register-blocked tiles, the online softmax (row max, exp, row sum, rescale) and PV, all in L1/L2.
// Vectors: GCC/Clang vector extensions (16 floats; AVX-512, AVX2 or NEON as the compiler targets).
#include "cpu_simd.h"

constexpr int QB = 64;   // query rows per task
constexpr int KB = 128;  // keys per tile
constexpr int RB = 4;    // rows per register block of the products with v (pv_rows)
constexpr float MASK_VALUE = -0.7f * 3.4028234663852886e38f;

// acc_row = alpha * acc_row + sum_c p[c] * v[c, :] for DV vectors of 16 (head_dim = 16 DV) kept in registers.
template <int DV>
static inline void pv_row(float* ar, const float* pr, const float* vh, int64_t cols, float alpha) {
  v16 r[DV];
  for (int j = 0; j < DV; ++j) r[j] = load(ar + 16 * j) * alpha;
  for (int64_t c = 0; c < cols; ++c) {
    const float pc = pr[c];
    const float* vr = vh + c * 16 * DV;
    for (int j = 0; j < DV; ++j) r[j] += pc * load(vr + 16 * j);
  }
  for (int j = 0; j < DV; ++j) store(ar + 16 * j, r[j]);
}

// pv_row for RB consecutive rows (acc rows 16 DV apart; p[x, c] at pr[x * rs + c * cs], so a transposed p
// needs no copy): each v row loaded once for all RB. alpha: per-row rescale of acc (nullptr: none).
template <int DV>
static inline void pv_rows(float* ar, const float* pr, const float* vh, int64_t cols, const float* alpha,
                           int64_t rs = KB, int64_t cs = 1) {
  v16 r[RB][DV];
  for (int x = 0; x < RB; ++x)
    for (int j = 0; j < DV; ++j) r[x][j] = alpha ? load(ar + x * 16 * DV + 16 * j) * alpha[x] : load(ar + x * 16 * DV + 16 * j);
  for (int64_t c = 0; c < cols; ++c) {
    v16 vv[DV];
    for (int j = 0; j < DV; ++j) vv[j] = load(vh + c * 16 * DV + 16 * j);
    for (int x = 0; x < RB; ++x) {
      const float pc = pr[x * rs + c * cs];
      for (int j = 0; j < DV; ++j) r[x][j] += pc * vv[j];
    }
  }
  for (int x = 0; x < RB; ++x)
    for (int j = 0; j < DV; ++j) store(ar + x * 16 * DV + 16 * j, r[x][j]);
}

static void pv_any(float* ar, const float* pr, const float* vh, int64_t cols, float alpha, int64_t dv) {
  switch (dv) {
    case 1: return pv_row<1>(ar, pr, vh, cols, alpha);
    case 2: return pv_row<2>(ar, pr, vh, cols, alpha);
    case 4: return pv_row<4>(ar, pr, vh, cols, alpha);
    case 8: return pv_row<8>(ar, pr, vh, cols, alpha);
  }
  for (int64_t j = 0; j < dv; ++j) store(ar + 16 * j, load(ar + 16 * j) * alpha);
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t j = 0; j < dv; ++j) store(ar + 16 * j, load(ar + 16 * j) + pr[c] * load(vh + c * 16 * dv + 16 * j));
}

// s [QB, KB] = q [QB, d] (zero rows past `rows`) times kt [d, KB]: QR rows x 16 QV columns in registers (8 x 32:
// 16 accumulators, 2 key loads and 8 query broadcasts per step; 4% faster than 4 x 32 and 4 x 64 at 8K tokens).
constexpr int QR = 8, QV = 2;
static_assert(QB % QR == 0 && KB % (16 * QV) == 0, "qk_tile's register block must tile QB x KB");
static inline void qk_tile(const float* qg, const float* kt, float* s, int64_t rows, int64_t d) {
  for (int64_t r0 = 0; r0 < rows; r0 += QR) {
    for (int64_t c0 = 0; c0 < KB; c0 += 16 * QV) {
      v16 a[QR][QV] = {};
      for (int64_t p = 0; p < d; ++p) {
        v16 kv[QV];
        for (int j = 0; j < QV; ++j) kv[j] = load(kt + p * KB + c0 + 16 * j);
        for (int x = 0; x < QR; ++x) {
          const float qv = qg[(r0 + x) * d + p];
          for (int j = 0; j < QV; ++j) a[x][j] += qv * kv[j];
        }
      }
      for (int x = 0; x < QR; ++x)
        for (int j = 0; j < QV; ++j) store(s + (r0 + x) * KB + c0 + 16 * j, a[x][j]);
    }
  }
}

// acc rows [n, d] += p [n, cols] times v rows [cols, d], p[x, c] at p[x * rs + c * cs] (RB rows at a time where
// the head size allows).
static void axpy_rows(float* acc, const float* p, int64_t rs, int64_t cs, const float* v, int64_t n, int64_t cols,
                      int64_t d) {
  const int64_t dv = d / 16;
  for (int64_t r = 0; r < n; r += RB) {
    if (r + RB <= n && dv == 4) { pv_rows<4>(acc + r * d, p + r * rs, v, cols, nullptr, rs, cs); continue; }
    if (r + RB <= n && dv == 2) { pv_rows<2>(acc + r * d, p + r * rs, v, cols, nullptr, rs, cs); continue; }
    if (r + RB <= n && dv == 8) { pv_rows<8>(acc + r * d, p + r * rs, v, cols, nullptr, rs, cs); continue; }
    for (int64_t x = r; x < std::min<int64_t>(r + RB, n); ++x)
      for (int64_t c = 0; c < cols; ++c) {
        const float pc = p[x * rs + c * cs];
        if (pc == 0.f) continue;
        for (int64_t j = 0; j < dv; ++j) store(acc + x * d + 16 * j, load(acc + x * d + 16 * j) + pc * load(v + c * d + 16 * j));
      }
  }
}

struct Fields {  // [batch, len] int32 each
  const int32_t *seg, *order, *pos, *glob;
};

struct Problem {
  const float *q, *k, *v;  // q [b, h, g, Lq, d] scaled by 1/sqrt(d); k, v [b, h, Lk, d]
  float *out, *lse;        // out [b, h, g, Lq, d], lse [b, h, g, Lq]
  Fields qf, kf;
  int64_t b, h, g, lq, lk, d, mode, window;  // mode: 0 causal, 1 bidirectional, 2 block; window < 0: none
};

static inline bool allowed(const Problem& P, int64_t bi, int64_t qi, int64_t ki) {
  const int64_t qo = bi * P.lq + qi, ko = bi * P.lk + ki;
  const int32_t qs = P.qf.seg[qo], ks = P.kf.seg[ko];
  bool ok = qs != 0 && ks != 0;
  if (P.mode == 1) {
    ok = ok && qs == ks;
  } else {
    ok = ok && P.kf.order[ko] <= P.qf.order[qo];
    if (P.mode == 2) ok = ok && (qs == ks || P.qf.glob[qo] != 0);
  }
  if (P.window >= 0) ok = ok && (int64_t)P.qf.pos[qo] - P.kf.pos[ko] < P.window;
  return ok;
}

// 0: no pair of the tile allowed, 2: every pair allowed, 1: evaluate the mask. Conservative bounds of the same
// predicate, as MaskSpec.chunk_classes: validity, order, segment range, global flags and the window.
static int tile_class(const Problem& P, int64_t bi, int64_t q0, int64_t rows, int64_t k0, int64_t cols) {
  const int64_t qo0 = bi * P.lq + q0, ko0 = bi * P.lk + k0;
  const int32_t big = 2147483647;
  int32_t qomin = big, qomax = -big, komin = big, komax = -big, qsmin = big, qsmax = -big, ksmin = big, ksmax = -big;
  int32_t qpmin = big, qpmax = -big, kpmin = big, kpmax = -big;
  bool qall = true, kall = true, qany = false, kany = false, gall = true, gany = false;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t sg = P.qf.seg[qo0 + r];
    const bool glob = P.mode == 2 && P.qf.glob[qo0 + r] != 0;
    gall = gall && glob;
    if (!sg) { qall = false; continue; }
    qany = true;
    gany = gany || glob;
    qomin = std::min(qomin, P.qf.order[qo0 + r]); qomax = std::max(qomax, P.qf.order[qo0 + r]);
    qsmin = std::min(qsmin, sg); qsmax = std::max(qsmax, sg);
    qpmin = std::min(qpmin, P.qf.pos[qo0 + r]); qpmax = std::max(qpmax, P.qf.pos[qo0 + r]);
  }
  for (int64_t c = 0; c < cols; ++c) {
    const int32_t sg = P.kf.seg[ko0 + c];
    if (!sg) { kall = false; continue; }
    kany = true;
    komin = std::min(komin, P.kf.order[ko0 + c]); komax = std::max(komax, P.kf.order[ko0 + c]);
    ksmin = std::min(ksmin, sg); ksmax = std::max(ksmax, sg);
    kpmin = std::min(kpmin, P.kf.pos[ko0 + c]); kpmax = std::max(kpmax, P.kf.pos[ko0 + c]);
  }
  if (!qany || !kany) return 0;
  bool some = true, every = qall && kall;
  const bool overlap = qsmin <= ksmax && ksmin <= qsmax;
  const bool one_segment = qsmin == qsmax && qsmax == ksmin && ksmin == ksmax;
  if (P.mode == 1) {
    some = overlap;
    every = every && one_segment;
  } else {
    some = komin <= qomax;
    every = every && komax <= qomin;
    if (P.mode == 2) {
      some = some && (overlap || gany);
      every = every && (one_segment || gall);
    }
  }
  if (P.window >= 0) {
    some = some && (int64_t)qpmin - kpmax < P.window;
    every = every && (int64_t)qpmax - kpmin < P.window;
  }
  return every ? 2 : (some ? 1 : 0);
}

// One output row from its online-softmax state: o = acc / l and lse = m + log l, or zeros and MASK_VALUE for a row
// that saw no key (l = 0). acc may alias o.
static inline void finish_row(float* o, float* lse, const float* acc, float m, float l, int64_t d) {
  for (int64_t j = 0; j < d; ++j) o[j] = l > 0.f ? acc[j] / l : 0.f;
  *lse = l > 0.f ? m + std::log(l) : MASK_VALUE;
}

// Partial results of one task over a key range (split-K, FlashDecoding): acc unnormalized [G, QB, d], row max m
// and row sum l [G, QB] each; FlashForward merges a query block's partials.
struct Part {
  float *acc, *m, *l;
};

// Task `task`'s query block over the key tiles [tile0, tile1): written normalized to out / lse, or (part given)
// as the unnormalized partial.
static void run_task(const Problem& P, int64_t task, std::vector<float>& buf, int64_t tile0, int64_t tile1,
                     const Part* part) {
  const int64_t d = P.d, nqb = (P.lq + QB - 1) / QB;
  const int64_t qb = task % nqb, hi = (task / nqb) % P.h, bi = task / (nqb * P.h);
  const int64_t q0 = qb * QB, rows = std::min<int64_t>(QB, P.lq - q0), G = P.g, dv = d / 16;
  float* kt = buf.data();                // [d, KB]
  float* s = kt + d * KB;                // [QB, KB]
  float* mk = s + QB * KB;               // [QB, KB]
  float* m = mk + QB * KB;               // [G, QB]
  float* l = m + G * QB;                 // [G, QB]
  float* acc = l + G * QB;               // [G, QB, d]
  float* qbuf = acc + G * QB * d;        // [G, QB, d]: the task's queries, zero rows past the end
  float* alphas = qbuf + G * QB * d;     // [QB]: this tile's rescale factor per row
  std::fill(m, m + G * QB, MASK_VALUE);
  std::fill(l, l + G * QB, 0.f);
  std::fill(acc, acc + G * QB * d, 0.f);
  for (int64_t gi = 0; gi < G; ++gi) {
    const float* qg = P.q + ((bi * P.h + hi) * G + gi) * P.lq * d + q0 * d;
    std::copy(qg, qg + rows * d, qbuf + gi * QB * d);
    std::fill(qbuf + gi * QB * d + rows * d, qbuf + (gi + 1) * QB * d, 0.f);
  }
  const float* kh = P.k + (bi * P.h + hi) * P.lk * d;
  const float* vh = P.v + (bi * P.h + hi) * P.lk * d;
  for (int64_t k0 = tile0 * KB; k0 < std::min(P.lk, tile1 * KB); k0 += KB) {
    const int64_t cols = std::min<int64_t>(KB, P.lk - k0);
    const int cls = tile_class(P, bi, q0, rows, k0, cols);
    if (cls == 0) continue;
    bool any = cls == 2;
    if (cls == 1) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < KB; ++c) {
          const bool ok = c < cols && allowed(P, bi, q0 + r, k0 + c);
          mk[r * KB + c] = ok ? 1.f : 0.f;
          any = any || ok;
        }
      if (!any) continue;
    }
    for (int64_t p = 0; p < d; ++p)
      for (int64_t c = 0; c < KB; ++c) kt[p * KB + c] = c < cols ? kh[(k0 + c) * d + p] : 0.f;
    for (int64_t gi = 0; gi < G; ++gi) {
      const float* qg = qbuf + gi * QB * d;
      qk_tile(qg, kt, s, rows, d);
      float* mg = m + gi * QB;
      float* lg = l + gi * QB;
      float* ag = acc + gi * QB * d;
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = s + r * KB;
        const float* mr = mk + r * KB;
        // masked and padding entries to MASK_VALUE, then the row max over 16 lanes
        v16 mxv = v16{} + mg[r];
        for (int64_t c = 0; c < KB; c += 16) {
          v16 sv = load(sr + c);
          if (cls == 1) {
            sv = load(mr + c) != 0.f ? sv : (v16{} + MASK_VALUE);
            store(sr + c, sv);
          } else if (c + 16 > cols) {
            for (int64_t t = 0; t < 16; ++t) if (c + t >= cols) sv[t] = MASK_VALUE;
            store(sr + c, sv);
          }
          mxv = sv > mxv ? sv : mxv;
        }
        float mx = mxv[0];
        for (int t = 1; t < 16; ++t) mx = std::max(mx, mxv[t]);
        v16 sum = {};
        const v16 mv = v16{} + mx;
        for (int64_t c = 0; c < KB; c += 16) {
          v16 pv = vexp(load(sr + c) - mv);
          if (cls == 1) {
            pv *= load(mr + c);
          } else if (c + 16 > cols) {
            for (int64_t t = 0; t < 16; ++t) if (c + t >= cols) pv[t] = 0.f;
          }
          store(sr + c, pv);
          sum += pv;
        }
        float rowsum = 0.f;
        for (int t = 0; t < 16; ++t) rowsum += sum[t];
        const float alpha = std::exp(mg[r] - mx);
        lg[r] = alpha * lg[r] + rowsum;
        mg[r] = mx;
        alphas[r] = alpha;
      }
      for (int64_t r = 0; r < rows; r += RB) {
        if (r + RB <= rows && (dv == 4 || dv == 2)) {
          if (dv == 4) pv_rows<4>(ag + r * d, s + r * KB, vh + k0 * d, cols, alphas + r);
          else pv_rows<2>(ag + r * d, s + r * KB, vh + k0 * d, cols, alphas + r);
        } else {
          for (int64_t x = r; x < std::min<int64_t>(r + RB, rows); ++x)
            pv_any(ag + x * d, s + x * KB, vh + k0 * d, cols, alphas[x], dv);
        }
      }
    }
  }
  if (part) {
    std::copy(acc, acc + G * QB * d, part->acc);
    std::copy(m, m + G * QB, part->m);
    std::copy(l, l + G * QB, part->l);
    return;
  }
  for (int64_t gi = 0; gi < G; ++gi) {
    const int64_t row0 = ((bi * P.h + hi) * G + gi) * P.lq + q0;
    for (int64_t r = 0; r < rows; ++r)
      finish_row(P.out + (row0 + r) * d, P.lse + row0 + r, acc + (gi * QB + r) * d, m[gi * QB + r], l[gi * QB + r], d);
  }
}

static ffi::Error FlashForward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                               ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> q_order,
                               ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> q_glob,
                               ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> kv_order,
                               ffi::Buffer<ffi::S32> kv_pos, int64_t mode, int64_t window,
                               ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || qd[4] % 16 != 0)
    return ffi::Error::InvalidArgument("rag_jax_flash_forward: q [b, h, g, Lq, d], k/v [b, h, Lk, d], d % 16 == 0");
  Problem P{q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(), lse->typed_data(),
            {q_seg.typed_data(), q_order.typed_data(), q_pos.typed_data(), q_glob.typed_data()},
            {kv_seg.typed_data(), kv_order.typed_data(), kv_pos.typed_data(), nullptr},
            qd[0], qd[1], qd[2], qd[3], kd[2], qd[4], mode, window};
  const int64_t tasks = P.b * P.h * ((P.lq + QB - 1) / QB), tiles = (P.lk + KB - 1) / KB;
  const size_t floats = P.d * KB + 2 * QB * KB + 2 * P.g * QB + 2 * P.g * QB * P.d + QB;
  // Few query blocks (a Block-Attention last block, a short prompt over a long cache): each one's key tiles are
  // split into `splits` ranges, so there are about 8 tasks per core (3 KV heads on 2 cores otherwise leave one
  // core idle half the time), and the partials merged (FlashDecoding, Dao et al. 2023).
  const int64_t splits = tasks >= 2 * cores() ? 1 : std::min(tiles, (8 * cores() + tasks - 1) / tasks);
  std::atomic<int64_t> next{0};
  if (splits == 1) {
    run_threads((int)workers(tasks), [&](int) {
      std::vector<float> buf(floats);
      for (int64_t t; (t = next.fetch_add(1)) < tasks;) run_task(P, t, buf, 0, tiles, nullptr);
    });
    return ffi::Error::Success();
  }
  const int64_t part_floats = P.g * QB * (P.d + 2);
  std::vector<float> parts(tasks * splits * part_floats);
  auto part_of = [&](int64_t i) {
    float* base = parts.data() + i * part_floats;
    return Part{base, base + P.g * QB * P.d, base + P.g * QB * (P.d + 1)};
  };
  run_threads((int)workers(tasks * splits), [&](int) {
    std::vector<float> buf(floats);
    for (int64_t i; (i = next.fetch_add(1)) < tasks * splits;) {
      const Part part = part_of(i);
      const int64_t t = i / splits, sp = i % splits;
      run_task(P, t, buf, sp * tiles / splits, (sp + 1) * tiles / splits, &part);
    }
  });
  const int64_t nqb = (P.lq + QB - 1) / QB, d = P.d, G = P.g;
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t qb = t % nqb, hi = (t / nqb) % P.h, bi = t / (nqb * P.h);
    const int64_t q0 = qb * QB, rows = std::min<int64_t>(QB, P.lq - q0);
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t row0 = ((bi * P.h + hi) * G + gi) * P.lq + q0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t x = gi * QB + r;
        float mx = MASK_VALUE;
        for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, part_of(t * splits + sp).m[x]);
        float lr = 0.f;
        float* o = P.out + (row0 + r) * d;
        std::fill(o, o + d, 0.f);
        for (int64_t sp = 0; sp < splits; ++sp) {
          const Part part = part_of(t * splits + sp);
          if (part.l[x] <= 0.f) continue;
          const float w = std::exp(part.m[x] - mx);
          lr += w * part.l[x];
          for (int64_t j = 0; j < d; ++j) o[j] += w * part.acc[x * d + j];
        }
        finish_row(o, P.lse + row0 + r, o, mx, lr, d);
      }
    }
  }
  return ffi::Error::Success();
}

// The mask fields (q: segment, order, position, global; kv: segment, order, position) and attributes both
// kernels take after their float buffers.
#define MASK_BINDINGS                                                                                         \
  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()                    \
      .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()                \
      .Arg<ffi::Buffer<ffi::S32>>().Attr<int64_t>("mode").Attr<int64_t>("window")

XLA_FFI_DEFINE_HANDLER_SYMBOL(RagJaxFlashForward, FlashForward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  MASK_BINDINGS
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// ---- Backward (FlashAttention-2, Dao 2023, Alg. 2; dS = P o (dP - delta), delta = rowsum(dO o O) - d_lse) ----
// One task = one (batch row, KV head, block of KB keys): its dK, dV rows stay in the task's buffers while it
// visits every block of QB queries (all query heads of the group) the mask lets reach it, recomputing
// P = exp(q k^T - lse) and dP = dO v^T; dQ accumulates in one buffer per thread, summed at the end.

struct BwdProblem {
  Problem f;                            // q, k, v, lse (out unused), fields and shape as the forward
  const float *dout, *delta;            // [b, h, g, Lq, d], [b, h, g, Lq]
  float *dk, *dv;                       // [b, h, Lk, d]
};

static void run_bwd_task(const BwdProblem& B, int64_t task, std::vector<float>& buf, float* dq) {
  const Problem& P = B.f;
  const int64_t d = P.d, nkb = (P.lk + KB - 1) / KB, G = P.g;
  const int64_t kb = task % nkb, hi = (task / nkb) % P.h, bi = task / (nkb * P.h);
  const int64_t k0 = kb * KB, cols = std::min<int64_t>(KB, P.lk - k0);
  float* kt = buf.data();                // [d, KB]
  float* vt = kt + d * KB;               // [d, KB]
  float* pm = vt + d * KB;               // [QB, KB] P
  float* ds = pm + QB * KB;              // [QB, KB] dP, then dS
  float* mk = ds + QB * KB;              // [QB, KB] mask
  float* qb = mk + QB * KB;              // [QB, d] queries, zero rows past the end
  float* ob = qb + QB * d;               // [QB, d] dO, zero rows past the end
  float* dka = ob + QB * d;              // [KB, d]
  float* dva = dka + KB * d;             // [KB, d]
  const float* kh = P.k + (bi * P.h + hi) * P.lk * d + k0 * d;
  const float* vh = P.v + (bi * P.h + hi) * P.lk * d + k0 * d;
  for (int64_t p = 0; p < d; ++p)
    for (int64_t c = 0; c < KB; ++c) {
      kt[p * KB + c] = c < cols ? kh[c * d + p] : 0.f;
      vt[p * KB + c] = c < cols ? vh[c * d + p] : 0.f;
    }
  std::fill(dka, dka + 2 * KB * d, 0.f);
  for (int64_t q0 = 0; q0 < P.lq; q0 += QB) {
    const int64_t rows = std::min<int64_t>(QB, P.lq - q0);
    const int cls = tile_class(P, bi, q0, rows, k0, cols);
    if (cls == 0) continue;
    bool any = cls == 2;
    for (int64_t r = 0; r < QB; ++r)
      for (int64_t c = 0; c < KB; ++c) {
        const bool ok = r < rows && c < cols && (cls == 2 || allowed(P, bi, q0 + r, k0 + c));
        mk[r * KB + c] = ok ? 1.f : 0.f;
        any = any || ok;
      }
    if (!any) continue;
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t row0 = ((bi * P.h + hi) * G + gi) * P.lq + q0;
      std::copy(P.q + row0 * d, P.q + (row0 + rows) * d, qb);
      std::fill(qb + rows * d, qb + QB * d, 0.f);
      std::copy(B.dout + row0 * d, B.dout + (row0 + rows) * d, ob);
      std::fill(ob + rows * d, ob + QB * d, 0.f);
      qk_tile(qb, kt, pm, QB, d);        // s
      qk_tile(ob, vt, ds, QB, d);        // dP
      for (int64_t r = 0; r < QB; ++r) {
        const v16 lse = v16{} + (r < rows ? P.lse[row0 + r] : 0.f);
        const v16 dl = v16{} + (r < rows ? B.delta[row0 + r] : 0.f);
        for (int64_t c = 0; c < KB; c += 16) {
          const v16 m = load(mk + r * KB + c);
          const v16 pv = vexp(load(pm + r * KB + c) - lse) * m;
          store(pm + r * KB + c, pv);
          store(ds + r * KB + c, pv * (load(ds + r * KB + c) - dl));
        }
      }
      axpy_rows(dva, pm, 1, KB, ob, KB, QB, d);              // dV += P^T dO
      axpy_rows(dka, ds, 1, KB, qb, KB, QB, d);              // dK += dS^T q
      axpy_rows(dq + row0 * d, ds, KB, 1, kh, rows, cols, d);  // dQ += dS k
    }
  }
  float* dk = B.dk + (bi * P.h + hi) * P.lk * d + k0 * d;
  float* dv = B.dv + (bi * P.h + hi) * P.lk * d + k0 * d;
  std::copy(dka, dka + cols * d, dk);
  std::copy(dva, dva + cols * d, dv);
}

static ffi::Error FlashBackward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                                ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout, ffi::Buffer<ffi::F32> delta,
                                ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> q_order,
                                ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> q_glob,
                                ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> kv_order,
                                ffi::Buffer<ffi::S32> kv_pos, int64_t mode, int64_t window,
                                ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                                ffi::ResultBuffer<ffi::F32> dv) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || qd[4] % 16 != 0)
    return ffi::Error::InvalidArgument("rag_jax_flash_backward: q [b, h, g, Lq, d], k/v [b, h, Lk, d], d % 16 == 0");
  BwdProblem B{{q.typed_data(), k.typed_data(), v.typed_data(), nullptr, const_cast<float*>(lse.typed_data()),
                {q_seg.typed_data(), q_order.typed_data(), q_pos.typed_data(), q_glob.typed_data()},
                {kv_seg.typed_data(), kv_order.typed_data(), kv_pos.typed_data(), nullptr},
                qd[0], qd[1], qd[2], qd[3], kd[2], qd[4], mode, window},
               dout.typed_data(), delta.typed_data(), dk->typed_data(), dv->typed_data()};
  const Problem& P = B.f;
  const int64_t tasks = P.b * P.h * ((P.lk + KB - 1) / KB), dq_size = P.b * P.h * P.g * P.lq * P.d;
  const size_t floats = 2 * P.d * KB + 3 * QB * KB + 2 * QB * P.d + 2 * KB * P.d;
  const int n = (int)workers(tasks);
  float* out = dq->typed_data();
  std::vector<std::vector<float>> partial(n - 1);   // thread 0 accumulates into the output itself
  std::atomic<int64_t> next{0};
  auto work = [&](int t) {
    std::vector<float> buf(floats);
    float* acc = out;
    if (t > 0) { partial[t - 1].assign(dq_size, 0.f); acc = partial[t - 1].data(); }
    for (int64_t i; (i = next.fetch_add(1)) < tasks;) run_bwd_task(B, i, buf, acc);
  };
  std::fill(out, out + dq_size, 0.f);
  run_threads(n, work);
  for (const auto& part : partial)
    for (int64_t i = 0; i < dq_size; i += 16) {
      if (i + 16 <= dq_size) store(out + i, load(out + i) + load(part.data() + i));
      else for (int64_t j = i; j < dq_size; ++j) out[j] += part[j];
    }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RagJaxFlashBackward, FlashBackward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  MASK_BINDINGS
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
