// Decode attention over paged KV for the CPU, called by XLA through its FFI (jax.ffi).
//
// One query row per sequence (a decode step). XLA:CPU runs the jnp form of this as gathers of
// whole pages into a new buffer followed by dots: the gathers move every context byte twice and
// run at a third of the memory bandwidth a plain read gets. Here each sequence walks its own pages
// in place: for every page, the scores of all its heads against the page's tokens, then one online
// softmax update per head. A page is ps * KVH * D contiguous values, read once for all heads.
// Sequences are spread over XLA's intra-op thread pool, longest first. Attention sinks (gpt-oss:
// one value-less logit per q head) start each head's online softmax: max = sink, sum = 1.
//
// Built at first use by cpu_decode_attention.py (the host's compiler, -O3 -march=native).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float widen(float x) { return x; }
inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Problem {
  const float* q;              // [S, H, D]
  const void* k;               // [P, ps, KVH, D]
  const void* v;               // [P, ps, KVH, D]
  const float* k_scales;       // [P, KVH, ps] (8-bit pages) or null
  const float* v_scales;
  const float* sinks;          // [H] or null
  const int32_t* ctx;          // [S]: context length of a decode row, 0 for rows that are not decodes
  const int32_t* tables;       // [S, MP]
  float* out;                  // [S, H, D]
  int64_t H, KVH, D, ps, MP, P;
  float sm_scale, soft_cap;    // soft_cap 0: none
  int32_t window;              // 0: none
};

// Floats per vector: 8 (one AVX register) wherever AVX exists, 4 (SSE, NEON) elsewhere. GCC/clang
// vector types then map onto registers one to one (wider ones are split through the stack on AVX2:
// 4x slower); on AVX-512 machines 16 lanes measured slower than 8 at head sizes 32 and 128 (more
// lanes to add per score, fewer independent sums), level at 64. Written as vector types because
// the compiler's own vectorization of these loops adds lanes one by one and leaves exp() scalar.
#if defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
typedef float fvec __attribute__((vector_size(kLanes * 4)));
typedef int32_t ivec __attribute__((vector_size(kLanes * 4)));
typedef uint32_t uvec __attribute__((vector_size(kLanes * 4)));
typedef uint16_t u16vec __attribute__((vector_size(kLanes * 2)));
typedef int8_t i8vec __attribute__((vector_size(kLanes)));

template <typename V, typename From>
inline V bitcast(const From& x) {
  static_assert(sizeof(V) == sizeof(From));
  V v;
  std::memcpy(&v, &x, sizeof v);
  return v;
}

inline fvec load(const float* x) {
  fvec v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
inline fvec load(const uint16_t* x) {  // bfloat16: the high half of a float
  u16vec h;
  std::memcpy(&h, x, sizeof h);
  return bitcast<fvec>(__builtin_convertvector(h, uvec) << 16);
}
inline fvec load(const int8_t* x) {
  i8vec b;
  std::memcpy(&b, x, sizeof b);
  return __builtin_convertvector(b, fvec);
}

// The sum of a vector's lanes, pairwise: halves until four are left.
template <int64_t N>
inline float lane_sum(const float* x) {
  if constexpr (N == 4) {
    return (x[0] + x[2]) + (x[1] + x[3]);
  } else {
    typedef float half __attribute__((vector_size(N * 2)));
    half lo, hi;
    std::memcpy(&lo, x, sizeof lo);
    std::memcpy(&hi, x + N / 2, sizeof hi);
    const half s = lo + hi;
    return lane_sum<N / 2>(reinterpret_cast<const float*>(&s));
  }
}
inline float hsum(fvec x) { return lane_sum<kLanes>(reinterpret_cast<const float*>(&x)); }

inline float hmax(fvec x) {
  float top = x[0];
  for (int i = 1; i < kLanes; ++i) top = std::max(top, x[i]);
  return top;
}

// exp(x) for x <= 0 (a score minus its running maximum), a vector at a time: 2^n * e^r with n = round(x / ln 2)
// and a degree-6 polynomial for e^r on |r| <= ln(2) / 2 (within 2 ulp of std::exp); 0 below -87, where
// a float underflows (and for the -inf of a masked slot).
inline fvec exp_nonpositive(fvec x) {
  const fvec floor = fvec{} - 87.0f;
  const auto underflow = x < floor;
  x = underflow ? floor : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, kept in the low bits
  const fvec shifted = x * 1.44269504088896341f + magic;
  const fvec n = shifted - magic;
  const fvec r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts: r exact
  fvec y = fvec{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const ivec e = (bitcast<ivec>(shifted) - bitcast<ivec>(fvec{} + magic) + 127) << 23;
  return underflow ? fvec{} : y * bitcast<fvec>(e);
}

// Row s's attention into p.out[s]. Scratch: scores [H, W] (W = ps rounded up to kLanes), m/l [H], acc [H, D].
template <typename T>
void attend(const Problem& p, int64_t s, std::vector<float>& scratch) {
  const int64_t H = p.H, D = p.D, ps = p.ps, KVH = p.KVH, G = H / KVH;
  const int64_t W = (ps + kLanes - 1) / kLanes * kLanes;
  float* out = p.out + s * H * D;
  const int64_t n = std::min<int64_t>(p.ctx[s], p.MP * p.ps);  // a table holds no more
  if (n <= 0) {
    std::fill(out, out + H * D, 0.0f);
    return;
  }
  scratch.resize(H * W + 2 * H + H * D);
  float* scores = scratch.data();
  float* m = scores + H * W;
  float* l = m + H;
  float* acc = l + H;
  for (int64_t h = 0; h < H; ++h) {  // a sink is a first key whose value vector is zero
    m[h] = p.sinks ? p.sinks[h] : -INFINITY;
    l[h] = p.sinks ? 1.0f : 0.0f;
  }
  std::fill(acc, acc + H * D, 0.0f);
  const float* q = p.q + s * H * D;
  const T* k_all = static_cast<const T*>(p.k);
  const T* v_all = static_cast<const T*>(p.v);
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, n - p.window) : 0;
  const int64_t page_stride = ps * KVH * D;
  const int64_t row = KVH * D;  // a token's values of every KV head: the page is read in order
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(T));
  const int64_t DV = D - D % kLanes;  // head values in whole vectors; the rest one by one

  for (int64_t first = lo - lo % ps; first < n; first += ps) {
    const int64_t page = std::clamp<int64_t>(p.tables[s * p.MP + first / ps], 0, p.P - 1);
    const int64_t t0 = std::max(first, lo) - first, t1 = std::min(first + ps, n) - first;  // slots of this page
    const T* kp = k_all + page * page_stride;
    const T* vp = v_all + page * page_stride;
    // The next page lies elsewhere in the pool: each token's row here prefetches the same row there.
    const bool more = first + ps < n;
    const char* next_k = nullptr;
    const char* next_v = nullptr;
    if (more) {
      const int64_t next = std::clamp<int64_t>(p.tables[s * p.MP + first / ps + 1], 0, p.P - 1);
      next_k = reinterpret_cast<const char*>(k_all + next * page_stride);
      next_v = reinterpret_cast<const char*>(v_all + next * page_stride);
    }
    // Slots outside [t0, t1) score -inf: their weights are 0 in whole-vector passes.
    for (int64_t h = 0; h < H; ++h) {
      std::fill(scores + h * W, scores + h * W + t0, -INFINITY);
      std::fill(scores + h * W + t1, scores + (h + 1) * W, -INFINITY);
    }
    for (int64_t t = t0; t < t1; ++t) {
      const T* kt = kp + t * row;
      if (more) {
        for (int64_t b = 0; b < row_bytes; b += 64) {
          __builtin_prefetch(next_k + t * row_bytes + b);
          __builtin_prefetch(next_v + t * row_bytes + b);
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const float* qh = q + h * D;
        const T* kr = kt + (h / G) * D;
        fvec part = {};
        for (int64_t d = 0; d < DV; d += kLanes) part += load(qh + d) * load(kr + d);
        float dot = hsum(part);
        for (int64_t d = DV; d < D; ++d) dot += qh[d] * widen(kr[d]);
        scores[h * W + t] = dot;
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / G;
      float* sc = scores + h * W;
      const float* ks = p.k_scales ? p.k_scales + (page * KVH + kvh) * ps : nullptr;
      for (int64_t t = t0; t < t1; ++t) {
        float x = (ks ? sc[t] * ks[t] : sc[t]) * p.sm_scale;
        if (p.soft_cap > 0.0f) x = p.soft_cap * std::tanh(x / p.soft_cap);
        sc[t] = x;
      }
      fvec top_v = fvec{} + m[h];
      for (int64_t t = 0; t < W; t += kLanes) {
        const fvec x = load(sc + t);
        top_v = x > top_v ? x : top_v;
      }
      const float top = hmax(top_v);
      const float alpha = std::exp(m[h] - top);  // exp(-inf) = 0 on the first page
      fvec sum = {};
      for (int64_t t = 0; t < W; t += kLanes) {
        const fvec w = exp_nonpositive(load(sc + t) - top);
        sum += w;
        std::memcpy(sc + t, &w, sizeof w);
      }
      if (p.v_scales) {
        const float* vs = p.v_scales + (page * KVH + kvh) * ps;
        for (int64_t t = t0; t < t1; ++t) sc[t] *= vs[t];
      }
      m[h] = top;
      l[h] = l[h] * alpha + hsum(sum);
      // acc[h] = alpha * acc[h] + sum_t w_t v_t, one vector of head values at a time kept in a register
      float* ah = acc + h * D;
      const T* vh = vp + kvh * D;
      for (int64_t d = 0; d < DV; d += kLanes) {
        fvec a = load(ah + d) * alpha;
        for (int64_t t = t0; t < t1; ++t) a += sc[t] * load(vh + t * row + d);
        std::memcpy(ah + d, &a, sizeof a);
      }
      for (int64_t d = DV; d < D; ++d) {
        float a = ah[d] * alpha;
        for (int64_t t = t0; t < t1; ++t) a += sc[t] * widen(vh[t * row + d]);
        ah[d] = a;
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = acc[h * D + d] * inv;
  }
}

// Shared by the calling thread and the tasks it schedules. A task that starts after every row is
// claimed touches only this state (kept alive by its shared_ptr), never the call's buffers.
struct Work {
  Problem problem;
  void (*attend_row)(const Problem&, int64_t, std::vector<float>&);
  std::vector<int64_t> order;  // live rows, longest context first
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;

  void run() {
    thread_local std::vector<float> scratch;
    const int64_t total = static_cast<int64_t>(order.size());
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      attend_row(problem, order[i], scratch);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
    }
  }
};

template <typename T>
void attend_any(const Problem& p, int64_t s, std::vector<float>& scratch) {
  attend<T>(p, s, scratch);
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                           ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                           ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> ctx, ffi::Buffer<ffi::S32> tables,
                           ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap, int32_t sliding_window,
                           bool scaled, bool has_sinks) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || ctx.element_count() != qd[0] || td[0] != qd[0]) {
    return ffi::Error::InvalidArgument("cpu decode attention: expected q [S, H, D], pages [P, ps, KVH, D], "
                                       "ctx [S] and tables [S, MP]");
  }
  if (k_pages.element_type() != v_pages.element_type() || kd[3] != qd[2] || qd[1] % kd[2] != 0) {
    return ffi::Error::InvalidArgument("cpu decode attention: K/V pages disagree with q");
  }
  if (has_sinks && sinks.element_count() != qd[1]) {
    return ffi::Error::InvalidArgument("cpu decode attention: sinks must be [H]");
  }
  auto work = std::make_shared<Work>();
  Problem& p = work->problem;
  p = Problem{q.typed_data(), k_pages.untyped_data(), v_pages.untyped_data(),
              scaled ? k_scales.typed_data() : nullptr, scaled ? v_scales.typed_data() : nullptr,
              has_sinks ? sinks.typed_data() : nullptr, ctx.typed_data(), tables.typed_data(), out->typed_data(),
              qd[1], kd[2], qd[2], kd[1], td[1], kd[0], sm_scale, soft_cap, sliding_window};
  switch (k_pages.element_type()) {
    case ffi::DataType::F32: work->attend_row = attend_any<float>; break;
    case ffi::DataType::BF16: work->attend_row = attend_any<uint16_t>; break;
    case ffi::DataType::S8: work->attend_row = attend_any<int8_t>; break;
    default: return ffi::Error::InvalidArgument("cpu decode attention: pages must be float32, bfloat16 or int8");
  }
  if (k_pages.element_type() == ffi::DataType::S8 && !scaled) {
    return ffi::Error::InvalidArgument("cpu decode attention: int8 pages need their scales");
  }
  const int64_t scale_count = kd[0] * kd[2] * kd[1];  // [P, KVH, ps]
  if (scaled && (k_scales.element_count() != scale_count || v_scales.element_count() != scale_count)) {
    return ffi::Error::InvalidArgument("cpu decode attention: scales must be [P, KVH, ps]");
  }
  const int64_t S = qd[0];
  for (int64_t s = 0; s < S; ++s) {
    if (p.ctx[s] > 0) work->order.push_back(s);
    else std::fill(p.out + s * p.H * p.D, p.out + (s + 1) * p.H * p.D, 0.0f);
  }
  std::stable_sort(work->order.begin(), work->order.end(),
                   [&](int64_t a, int64_t b) { return p.ctx[a] > p.ctx[b]; });
  const int64_t total = static_cast<int64_t>(work->order.size());
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1) - 1, total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  std::unique_lock<std::mutex> lock(work->mu);
  work->finished.wait(lock, [&] { return work->done.load() == total; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q rows [S, H, D]
                                  .Arg<ffi::AnyBuffer>()          // k pages
                                  .Arg<ffi::AnyBuffer>()          // v pages
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k scales [P, KVH, ps] or [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v scales
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks [H] or [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ctx [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page tables [S, MP]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [S, H, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<bool>("scaled")         // false: the scales are [1] placeholders
                                  .Attr<bool>("has_sinks"));    // false: the sinks are a [1] placeholder
