// MagicPIG's sampling step (rag_jax/inference/magicpig.py, MagicPIGDecode with bucket tables) for XLA:CPU, called
// through jax.ffi by rag_jax/model/cpu_kernel.py. Per query row: walk the query's bucket in each of the L tables
// (at most `bucket_size` slots each, in the table's slot order), count each slot's collisions in a per-thread
// counter array, and collect the slots whose count reaches `min_collisions` and that `keep` allows; the first
// `max_sampled` of them in slot order are written out. The work is O(L * bucket_size) per row where XLA's
// scatter-add over a [rows, n] count array and the prefix-sum compaction cost O(n) per row (MagicPIG §5: the CPU
// side reads only the buckets). Rows over all cores (std::thread, an atomic counter) when there is enough work.
#include "cpu_simd.h"

static void sample_rows(const int32_t* codes, const int32_t* order, const int32_t* offsets, const uint8_t* keep,
                        int32_t* idx, int32_t* count, int64_t r0, int64_t r1, int64_t L, int64_t n, int64_t buckets,
                        int64_t group, int64_t heads, int64_t bucket_size, int64_t max_sampled,
                        int64_t min_collisions, std::vector<int32_t>& hits, std::vector<int32_t>& touched,
                        std::vector<int32_t>& found) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t bh = r / group, b = bh / heads;  // rows are (batch, kv head, query in the group)
    const uint8_t* kb = keep + b * n;
    touched.clear();
    found.clear();
    for (int64_t t = 0; t < L; ++t) {
      const int32_t c = codes[r * L + t];
      const int32_t* off = offsets + (bh * L + t) * (buckets + 1);
      const int32_t* ord = order + (bh * L + t) * n;
      const int64_t s = off[c], e = std::min<int64_t>(off[c + 1], s + bucket_size);
      for (int64_t j = s; j < e; ++j) {
        const int32_t slot = ord[j];
        const int32_t h = ++hits[slot];
        if (h == 1) touched.push_back(slot);
        if (h == min_collisions && kb[slot]) found.push_back(slot);
      }
    }
    for (int32_t slot : touched) hits[slot] = 0;
    const int64_t m = std::min<int64_t>((int64_t)found.size(), max_sampled);
    std::partial_sort(found.begin(), found.begin() + m, found.end());
    int32_t* out = idx + r * max_sampled;
    for (int64_t i = 0; i < m; ++i) out[i] = found[i];
    for (int64_t i = m; i < max_sampled; ++i) out[i] = (int32_t)(n - 1);  // as _compact pads: the last slot
    count[r] = (int32_t)m;
  }
}

static ffi::Error LshSample(ffi::Buffer<ffi::S32> codes, ffi::Buffer<ffi::S32> order, ffi::Buffer<ffi::S32> offsets,
                            ffi::Buffer<ffi::U8> keep, ffi::ResultBuffer<ffi::S32> idx,
                            ffi::ResultBuffer<ffi::S32> count, int64_t bucket_size, int64_t min_collisions) {
  auto cd = codes.dimensions(), od = order.dimensions(), fd = offsets.dimensions(), kd = keep.dimensions();
  if (cd.size() != 4 || od.size() != 4 || fd.size() != 4 || kd.size() != 2 || idx->dimensions().size() != 2)
    return ffi::Error::InvalidArgument(
        "rag_jax_lsh_sample: codes [b, h, g, L], order [b, h, L, n], offsets [b, h, L, buckets + 1], keep [b, n]");
  const int64_t B = cd[0], H = cd[1], G = cd[2], L = cd[3], n = od[3], buckets = fd[3] - 1;
  const int64_t R = B * H * G, max_sampled = idx->dimensions()[1];
  if (od[0] != B || od[1] != H || od[2] != L || fd[0] != B || fd[1] != H || fd[2] != L || kd[0] != B ||
      kd[1] != n || idx->dimensions()[0] != R)
    return ffi::Error::InvalidArgument("rag_jax_lsh_sample: inconsistent shapes");
  const int64_t rows_per_task = 4, tasks = (R + rows_per_task - 1) / rows_per_task;
  // a thread pays off past ~1e5 bucket reads (a thread start costs about what 1e4 reads do)
  const int threads = R * L * std::min(bucket_size, n) < 100000 ? 1 : (int)workers(tasks);
  std::atomic<int64_t> next{0};
  run_threads(threads, [&](int) {
    std::vector<int32_t> hits(n, 0), touched, found;
    for (int64_t i; (i = next.fetch_add(1)) < tasks;)
      sample_rows(codes.typed_data(), order.typed_data(), offsets.typed_data(), keep.typed_data(),
                  idx->typed_data(), count->typed_data(), i * rows_per_task, std::min(R, (i + 1) * rows_per_task),
                  L, n, buckets, G, H, bucket_size, max_sampled, min_collisions, hits, touched, found);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RagJaxLshSample, LshSample,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("min_collisions"));
