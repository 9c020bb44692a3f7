// Softmax cross-entropy and its logit gradient in one pass per row for XLA:CPU, called through jax.ffi by
// rag_jax/model/cpu_kernel.py for the fused vocab head (rag_jax/train/objectives/nll.py). Per row of V logits
// (a SmolLM2 row is 49,152 floats, 192 KB: it stays in L2 between the passes) the row max, exp(l - max) written
// to the output and summed, then the output scaled to w * softmax and w subtracted at the target: the logits are
// read from memory once and the gradient written once, where XLA's loop fusions make a memory pass per step
// (max, exp-sum, gradient, target gather). Rows in blocks over all cores (std::thread, an atomic counter).
#include "cpu_simd.h"

#include <limits>

constexpr int64_t ROWS = 8;  // rows per task

static void xent_rows(const float* logits, const int32_t* targets, const float* weights, float* dlogits,
                      float* stats, int64_t r0, int64_t r1, int64_t V) {
  const int64_t vv = V / 16 * 16;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t r = r0; r < r1; ++r) {
    const float* l = logits + r * V;
    float* o = dlogits + r * V;  // may alias l: each entry is read before it is written
    const int32_t t = targets[r];
    const bool valid = t >= 0 && t < V;
    const float target = valid ? l[t] : std::numeric_limits<float>::quiet_NaN();
    v16 mv = v16{} - inf;
    for (int64_t c = 0; c < vv; c += 16) {
      const v16 x = load(l + c);
      mv = x > mv ? x : mv;
    }
    float m = -inf;
    for (int j = 0; j < 16; ++j) m = std::max(m, mv[j]);
    for (int64_t c = vv; c < V; ++c) m = std::max(m, l[c]);
    v16 sv{};
    for (int64_t c = 0; c < vv; c += 16) {
      const v16 e = vexp(load(l + c) - m);
      store(o + c, e);
      sv += e;
    }
    float s = 0.f;
    for (int j = 0; j < 16; ++j) s += sv[j];
    for (int64_t c = vv; c < V; ++c) {
      o[c] = std::exp(l[c] - m);
      s += o[c];
    }
    const float w = weights[r], scale = w / s;
    for (int64_t c = 0; c < vv; c += 16) store(o + c, load(o + c) * scale);
    for (int64_t c = vv; c < V; ++c) o[c] *= scale;
    if (valid) o[t] -= w;
    stats[3 * r] = m + std::log(s);
    stats[3 * r + 1] = target;
    stats[3 * r + 2] = m;
  }
}

static ffi::Error SoftmaxXent(ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> targets,
                              ffi::Buffer<ffi::F32> weights, ffi::ResultBuffer<ffi::F32> dlogits,
                              ffi::ResultBuffer<ffi::F32> stats) {
  auto ld = logits.dimensions();
  if (ld.size() != 2 || targets.dimensions().size() != 1 || targets.dimensions()[0] != ld[0] ||
      weights.dimensions().size() != 1 || weights.dimensions()[0] != ld[0])
    return ffi::Error::InvalidArgument("rag_jax_softmax_xent: logits [rows, vocab], targets and weights [rows]");
  const int64_t R = ld[0], V = ld[1], tasks = (R + ROWS - 1) / ROWS;
  std::atomic<int64_t> next{0};
  run_threads((int)workers(tasks), [&](int) {
    for (int64_t i; (i = next.fetch_add(1)) < tasks;)
      xent_rows(logits.typed_data(), targets.typed_data(), weights.typed_data(), dlogits->typed_data(),
                stats->typed_data(), i * ROWS, std::min(R, (i + 1) * ROWS), V);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RagJaxSoftmaxXent, SoftmaxXent,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
