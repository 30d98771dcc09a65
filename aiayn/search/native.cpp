// aiayn's native beam search on the CPU: the encoder, the decoder steps, their key/value cache and the search's
// bookkeeping in one C++ loop, so that a step is arithmetic, not Python between a few hundred small PyTorch operations.
//
// It computes what aiayn.search.beam.beam_search computes (the same candidates, pools, stop rules, length penalties,
// banned ids and min_len), for the post-LN and pre-LN encoder-decoder of aiayn.model with additive positions
// (sinusoidal or learned) and ReLU / GELU / swish. Products run on weights packed once (Linear: fp32, bf16 on the
// AVX512-BF16 unit, int8 on the VNNI unit, else widened on the fly); each step's keys/values are written once and
// read through each beam's ancestors (Cache). Threads: T, the caller's count as torch.set_num_threads sets it; a batch
// of at least 2T sentences is T groups, the caller's thread and T - 1 of the call's own each searching one
// (Decoder::search); fewer sentences, one group whose loops the caller's OpenMP threads split (parallel_for, built
// with -fopenmp, the OpenMP of PyTorch's CPU builds).
//
// Shapes: R rows (live sentences x beams), D model width, H heads, K key width per head (d_k), Q value width per head
// (d_v), F the FFN's inner width, V the vocabulary, L decoder layers, S source length, C the batch's most steps.
// Built by aiayn/search/native.py (torch.utils.cpp_extension) with -O3 -fopenmp -march=native for the CPU it runs on.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// A thread that searches a group of sentences (Decoder::search) runs every loop inline.
thread_local bool in_group = false;

struct InGroup {  // marks this thread as a group's for its scope
  InGroup() { in_group = true; }
  ~InGroup() { in_group = false; }
};

// The search's parallel loops: at::parallel_for's split (each of the caller's OpenMP threads one contiguous chunk of at
// least ``grain`` items; inline on one thread, for a loop of one chunk, inside a parallel region or on a group's
// thread) without its first step. at::parallel_for begins with at::internal::lazy_init_num_threads, an inline function
// whose thread_local "done" flag this module holds a copy of: on a thread where PyTorch had set its count already, this
// module's first loop set the thread's count again, to the count last set by any thread. A serve worker set to one
// thread (uneven --workers shares) then ran its searches on another worker's count: its OpenMP team grew, and once the
// teams hold more threads than there are CPUs, GNU OpenMP's waiting threads sleep at once instead of spinning, and
// every multi-threaded search in the process waited for a wake-up at each loop (seen in scratch runs). Each search
// starts with at::get_num_threads() instead, PyTorch's own copy of that first step: a thread PyTorch has not set yet
// gets its count as it would in PyTorch.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  if (n <= grain || n == 1 || in_group || omp_in_parallel() || omp_get_max_threads() == 1) {
    f(begin, end);
    return;
  }
  std::exception_ptr error;
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
#pragma omp parallel
  {
    int64_t threads = omp_get_num_threads();
    if (grain > 0) threads = std::min<int64_t>(threads, (n + grain - 1) / grain);
    const int64_t chunk = (n + threads - 1) / threads, b = begin + omp_get_thread_num() * chunk;
    if (b < end) {
      try {
        f(b, std::min(end, b + chunk));
      } catch (...) {
        if (!failed.test_and_set()) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

#if defined(__AVX512F__)
constexpr int W = 16;  // floats per vector register
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load(const uint16_t* p) {  // bf16 -> fp32: the bf16 bits are the fp32's top half
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

typedef int8_t vb __attribute__((vector_size(W)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
inline vf load(const int8_t* p) {  // int8 -> int32 -> fp32 (the scale is applied to the sums)
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vb q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(__builtin_convertvector(q, vi), vf);
#endif
}

// y[r, n] (row stride ldy) = (sum_k x[r, k] w[n, k]) * scale[n] + b[n] for R = 1..ROWS rows and the column blocks
// nb0..nb1 of a packed weight: block nb holds columns nb*W .. nb*W + W-1 as (K, W), so one vector load brings W
// columns' weights for one k, multiplied into all R rows (no horizontal sums). Two blocks at a time: 2R sums in flight.
template <typename T, int R>
void block(const float* x, int64_t K, const T* wp, const float* scale, const float* b, float* y, int64_t ldy,
           int64_t nb0, int64_t nb1, int64_t N) {
  auto put = [&](const vf* acc, int64_t nb) {
    const int64_t n0 = nb * W, cols = std::min<int64_t>(W, N - n0);
    if (cols == W) {  // whole vectors
      const vf s = scale ? load(scale + n0) : vf{} + 1.f, bias = b ? load(b + n0) : vf{};
      for (int r = 0; r < R; ++r) {
        const vf v = acc[r] * s + bias;
        std::memcpy(y + r * ldy + n0, &v, sizeof v);
      }
      return;
    }
    for (int r = 0; r < R; ++r) {
      float* yr = y + r * ldy + n0;
      for (int64_t j = 0; j < cols; ++j) yr[j] = acc[r][j] * (scale ? scale[n0 + j] : 1.f) + (b ? b[n0 + j] : 0.f);
    }
  };
  int64_t nb = nb0;
  for (; nb + 1 < nb1; nb += 2) {
    const T* w0 = wp + nb * K * W;
    const T* w1 = w0 + K * W;
    vf a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = vf{};
    for (int64_t k = 0; k < K; ++k) {
      const vf v0 = load(w0 + k * W), v1 = load(w1 + k * W);
      for (int r = 0; r < R; ++r) {
        const float xs = x[r * K + k];
        a0[r] += v0 * xs;
        a1[r] += v1 * xs;
      }
    }
    put(a0, nb);
    put(a1, nb + 1);
  }
  for (; nb < nb1; ++nb) {
    const T* w0 = wp + nb * K * W;
    vf a0[R];
    for (int r = 0; r < R; ++r) a0[r] = vf{};
    for (int64_t k = 0; k < K; ++k) {
      const vf v0 = load(w0 + k * W);
      for (int r = 0; r < R; ++r) a0[r] += v0 * x[r * K + k];
    }
    put(a0, nb);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define AIAYN_VNNI 1
// Dynamic int8 on the CPU's int8 dot-product unit (AVX512-VNNI): rows quantized to int8 per row, stored as u8 (+128);
// weights int8 packed (blocks, K4, 16, 4); acc - 128 * colsum is the exact int32 sum of xq * wq, then
// y = float(sum) * row scale * column scale + b: the arithmetic of aiayn.linear.Int8Linear (torch._int_mm).
template <int R>
void block_vnni(const uint8_t* xu, int64_t K4, const int8_t* wp, const int32_t* comp, const float* xs,
                const float* ws, const float* b, float* y, int64_t ldy, int64_t nb0, int64_t nb1, int64_t N) {
  auto put = [&](const __m512i* acc, int64_t nb) {
    const int64_t n0 = nb * 16;
    const __mmask16 cols = N - n0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
    const __m512i c = _mm512_maskz_loadu_epi32(cols, comp + n0);
    const __m512 s = _mm512_maskz_loadu_ps(cols, ws + n0), bias = b ? _mm512_maskz_loadu_ps(cols, b + n0) : __m512{};
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], c)),
                                                   _mm512_set1_ps(xs[r])), s);
      _mm512_mask_storeu_ps(y + r * ldy + n0, cols, _mm512_add_ps(v, bias));
    }
  };
  int64_t nb = nb0;
  for (; nb < nb1; nb += 2) {
    const bool two = nb + 1 < nb1;
    const int8_t* w0 = wp + nb * K4 * 64;
    const int8_t* w1 = two ? w0 + K4 * 64 : w0;
    __m512i a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K4; ++k) {
      const __m512i v0 = _mm512_loadu_si512(w0 + k * 64), v1 = _mm512_loadu_si512(w1 + k * 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xu + r * K4 * 4 + k * 4, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        a0[r] = _mm512_dpbusd_epi32(a0[r], xb, v0);
        a1[r] = _mm512_dpbusd_epi32(a1[r], xb, v1);
      }
    }
    put(a0, nb);
    if (two) put(a1, nb + 1);
  }
}
#endif

inline uint32_t bf16_bits(float f) {  // round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

#if defined(__AVX512BF16__)
#define AIAYN_DPBF16 1
// bf16 products on the CPU's bf16 dot-product unit (AVX512-BF16): rows rounded to bf16 (to nearest even), weights
// bf16 packed (blocks, K2, 16, 2); each instruction adds two k's products for 16 columns in fp32.
template <int R>
void block_dpbf16(const uint32_t* xp, int64_t K2, const int16_t* wp, const float* b, float* y, int64_t ldy,
                  int64_t nb0, int64_t nb1, int64_t N) {
  auto put = [&](const __m512* acc, int64_t nb) {
    const int64_t n0 = nb * 16;
    const __mmask16 cols = N - n0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
    const __m512 bias = b ? _mm512_maskz_loadu_ps(cols, b + n0) : __m512{};
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, cols, _mm512_add_ps(acc[r], bias));
  };
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const bool two = nb + 1 < nb1;
    const int16_t* w0 = wp + nb * K2 * 32;
    const int16_t* w1 = two ? w0 + K2 * 32 : w0;
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K2; ++k) {
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + k * 32), v1 = (__m512bh)_mm512_loadu_si512(w1 + k * 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(int32_t(xp[r * K2 + k]));
        a0[r] = _mm512_dpbf16_ps(a0[r], xb, v0);
        a1[r] = _mm512_dpbf16_ps(a1[r], xb, v1);
      }
    }
    put(a0, nb);
    if (two) put(a1, nb + 1);
  }
}

#endif

enum Kind : int64_t { FP32 = 0, BF16 = 1, INT8 = 2 };

// Rows a weight is read for at once: each column block's weights come from memory once per ROWS rows (2 blocks x ROWS
// rows of sums stay in registers).
constexpr int64_t ROWS = 8;

// f(std::integral_constant<int, r>) for r = rows (1 .. ROWS): the kernels' row count as a template argument.
template <typename F>
void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// exp of W values at once (Cephes' expf: 2^n e^r, |r| <= ln2 / 2, a degree-6 polynomial; ~1 ulp), for x <= 0 (a
// softmax's x - max); below -87 it gives exp(-87) (~1.6e-38), nothing a sum of probabilities can see.
inline vf vexp(vf x) {
  x = x < -87.f ? vf{} - 87.f : x;
  const vf t = x * 1.44269504088896341f;
  const vi n = __builtin_convertvector(t - 0.5f, vi);  // round half away from zero, t <= 0
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
  vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi bits = (n + 127) << 23;
  vf two;
  std::memcpy(&two, &bits, sizeof two);
  return p * two;
}

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

// sum(exp(row - m)) of a row (V,), m its largest value (finite).
float sum_exp(const float* row, int64_t V, float m) {
  const int64_t Vv = V / W * W;
  vf acc = vf{};
  for (int64_t v = 0; v < Vv; v += W) acc += vexp(load(row + v) - m);
  float sum = hsum(acc);
  for (int64_t v = Vv; v < V; ++v) sum += std::exp(row[v] - m);
  return sum;
}

#if defined(__AVX512F__)
// r[i] = the sum of v[i]'s 16 lanes, for i < 16, in the lane order 0 4 8 12 1 5 9 13 2 6 10 14 3 7 11 15 (a 4 x 4
// transpose puts it right): 45 shuffles and adds for the 16 sums.
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s two halves added; 8-15: v[2i + 1]'s
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // each 128-bit block: one v's quarter sums
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}
#endif

// The lanes of x greater than t, as bits.
inline uint32_t greater(vf x, float t) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(t), _CMP_GT_OQ);
#elif defined(__AVX__)
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps((__m256)x, _mm256_set1_ps(t), _CMP_GT_OQ)));
#else
  uint32_t bits = 0;
  for (int i = 0; i < W; ++i) bits |= uint32_t(x[i] > t) << i;
  return bits;
#endif
}

// A linear layer's weight (N, K), packed in blocks of W columns ((N / W, K, W), zero-padded), as fp32, bf16 or
// int8 with a scale per column (aiayn.linear.quantize_rows' symmetric rows), and its bias (N,) or none.
struct Linear {
  torch::Tensor w, b, scale, comp;
  int64_t N = 0, K = 0, blocks = 0, K4 = 0, K2 = 0;
  Kind kind = FP32;

  Linear() = default;
  Linear(torch::Tensor weight, torch::Tensor bias, int64_t how) : N(weight.size(0)), K(weight.size(1)) {
    kind = Kind(how);
    blocks = (N + W - 1) / W;
    auto w32 = weight.to(torch::kFloat32);
    torch::Tensor v = w32;
    if (kind == INT8) {  // as aiayn.linear.quantize_rows
      auto amax = w32.abs().amax(1);
      scale = torch::where(amax > 0, amax / 127.0, torch::ones_like(amax)).contiguous();
      v = torch::div(w32, scale.unsqueeze(1)).round_().clamp_(-127, 127).to(torch::kInt8);
    } else if (kind == BF16) {
      v = w32.to(torch::kBFloat16);
    }
#ifdef AIAYN_VNNI
    if (kind == INT8) {  // (blocks, K4, 16, 4) and 128 * each column's sum
      K4 = (K + 3) / 4;
      comp = (v.to(torch::kInt32).sum(1) * 128).to(torch::kInt32);
      comp = torch::constant_pad_nd(comp, {0, blocks * W - N}).contiguous();
      auto p = torch::constant_pad_nd(v, {0, K4 * 4 - K, 0, blocks * W - N});
      w = p.view({blocks, W, K4, 4}).permute({0, 2, 1, 3}).contiguous();
      if (bias.defined() && bias.numel()) b = bias.to(torch::kFloat32).contiguous();
      return;
    }
#endif
#ifdef AIAYN_DPBF16
    if (kind == BF16) {  // (blocks, K2, 16, 2)
      K2 = (K + 1) / 2;
      auto p = torch::constant_pad_nd(v, {0, K2 * 2 - K, 0, blocks * W - N});
      w = p.view({blocks, W, K2, 2}).permute({0, 2, 1, 3}).contiguous().view(torch::kInt16);
      if (bias.defined() && bias.numel()) b = bias.to(torch::kFloat32).contiguous();
      return;
    }
#endif
    v = torch::constant_pad_nd(v, {0, 0, 0, blocks * W - N});  // (blocks * W, K)
    w = v.view({blocks, W, K}).transpose(1, 2).contiguous();  // (blocks, K, W)
    if (kind == BF16) w = w.view(torch::kInt16);
    if (bias.defined() && bias.numel()) b = bias.to(torch::kFloat32).contiguous();
  }

  // y (M, N) = x (M, K) W^T + b; column blocks split over the intra-op threads, rows taken ROWS at a time.
  void operator()(const float* x, int64_t M, float* y) const {
    const float* bias = b.defined() ? b.data_ptr<float>() : nullptr;
    const float* sc = scale.defined() ? scale.data_ptr<float>() : nullptr;
    // a thread takes at least ~256k multiply-adds (a few microseconds): fewer are not worth waking it for
    const int64_t grain = std::max<int64_t>(2, (1 << 18) / std::max<int64_t>(1, K * W * M));
    const int64_t row_grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, K));  // rows quantized or rounded
#ifdef AIAYN_VNNI
    if (kind == INT8) {
      // each row: scale = max |x| / 127 (at least 1e-30 / 127), xq = round(x / scale), stored + 128
      std::vector<uint8_t> xu(M * K4 * 4, 128);
      std::vector<float> xs(M);
      const int64_t Kv = K / 16 * 16;
      parallel_for(0, M, row_grain, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
          const float* xr = x + m * K;
          uint8_t* q = xu.data() + m * K4 * 4;
          __m512 mx = _mm512_setzero_ps();
          for (int64_t k = 0; k < Kv; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xr + k)));
          float amax = _mm512_reduce_max_ps(mx);
          for (int64_t k = Kv; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
          const float s = std::max(amax, 1e-30f) / 127.f;
          xs[m] = s;
          const __m512 sv = _mm512_set1_ps(s);
          const __m512i off = _mm512_set1_epi32(128);
          for (int64_t k = 0; k < Kv; k += 16)  // x / s rounded to nearest even (the default rounding, as nearbyint)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k),
                             _mm512_cvtepi32_epi8(_mm512_add_epi32(
                                 _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(xr + k), sv)), off)));
          for (int64_t k = Kv; k < K; ++k) q[k] = uint8_t(int(std::nearbyint(xr[k] / s)) + 128);
        }
      });
      const int32_t* cp = comp.data_ptr<int32_t>();
      const int8_t* wp = w.data_ptr<int8_t>();
      parallel_for(0, blocks, grain, [&](int64_t nb0, int64_t nb1) {
        for (int64_t m = 0; m < M; m += ROWS) {
          const uint8_t* xm = xu.data() + m * K4 * 4;
          float* ym = y + m * N;
          with_rows(std::min<int64_t>(ROWS, M - m), [&](auto r) {
            block_vnni<decltype(r)::value>(xm, K4, wp, cp, xs.data() + m, sc, bias, ym, N, nb0, nb1, N);
          });
        }
      });
      return;
    }
#endif
#ifdef AIAYN_DPBF16
    if (kind == BF16) {  // each row rounded to bf16, in pairs of k
      std::vector<uint32_t> xp(M * K2, 0);
      const int64_t Kv = K / 32 * 32;
      parallel_for(0, M, row_grain, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
          const float* xr = x + m * K;
          for (int64_t k = 0; k < Kv; k += 32)  // 32 values to bf16 (nearest even), k's order: k even low, odd high
            _mm512_storeu_si512(xp.data() + m * K2 + k / 2,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k)));
          for (int64_t k = Kv; k < K; ++k) xp[m * K2 + k / 2] |= bf16_bits(xr[k]) << (16 * (k & 1));
        }
      });
      const int16_t* wp = w.data_ptr<int16_t>();
      parallel_for(0, blocks, grain, [&](int64_t nb0, int64_t nb1) {
        for (int64_t m = 0; m < M; m += ROWS) {
          const uint32_t* xm = xp.data() + m * K2;
          float* ym = y + m * N;
          with_rows(std::min<int64_t>(ROWS, M - m), [&](auto r) {
            block_dpbf16<decltype(r)::value>(xm, K2, wp, bias, ym, N, nb0, nb1, N);
          });
        }
      });
      return;
    }
#endif
    std::vector<float> rounded;
    if (kind == BF16) {  // rows rounded to bf16 as the bf16 unit's kernel rounds them: the same products on every CPU
      rounded.resize(M * K);
      for (int64_t i = 0; i < M * K; ++i) {
        const uint32_t u = bf16_bits(x[i]) << 16;
        std::memcpy(&rounded[i], &u, 4);
      }
      x = rounded.data();
    }
    parallel_for(0, blocks, grain, [&](int64_t nb0, int64_t nb1) {
      for (int64_t m = 0; m < M; m += ROWS) {
        const int64_t rows = std::min<int64_t>(ROWS, M - m);
        if (kind == BF16) {
          run(reinterpret_cast<const uint16_t*>(w.data_ptr<int16_t>()), x + m * K, rows, sc, bias, y + m * N, nb0, nb1);
        } else if (kind == INT8) {
          run(w.data_ptr<int8_t>(), x + m * K, rows, sc, bias, y + m * N, nb0, nb1);
        } else {
          run(w.data_ptr<float>(), x + m * K, rows, sc, bias, y + m * N, nb0, nb1);
        }
      }
    });
  }

  template <typename T>
  void run(const T* wp, const float* x, int64_t rows, const float* sc, const float* bias, float* y, int64_t nb0,
           int64_t nb1) const {
    with_rows(rows, [&](auto r) { block<T, decltype(r)::value>(x, K, wp, sc, bias, y, N, nb0, nb1, N); });
  }
};

struct Norm {
  torch::Tensor w, b;
  float eps = 1e-5f;
  // x (M, D) -> out (M, D) = (x - mean) / sqrt(var + eps) * w + b, per row; out may be x.
  void operator()(const float* x, int64_t M, int64_t D, float* out) const {
    const float* g = w.data_ptr<float>();
    const float* bb = b.data_ptr<float>();
    const int64_t Dv = D / W * W;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * D;
      float* o = out + m * D;
      vf acc = vf{};
      for (int64_t d = 0; d < Dv; d += W) acc += load(xr + d);
      float mean = hsum(acc);
      for (int64_t d = Dv; d < D; ++d) mean += xr[d];
      mean /= float(D);
      acc = vf{};
      for (int64_t d = 0; d < Dv; d += W) {
        const vf c = load(xr + d) - mean;
        acc += c * c;
      }
      float var = hsum(acc);
      for (int64_t d = Dv; d < D; ++d) var += (xr[d] - mean) * (xr[d] - mean);
      var /= float(D);
      const float inv = 1.f / std::sqrt(var + eps);
      for (int64_t d = 0; d < Dv; d += W) {
        const vf v = (load(xr + d) - mean) * inv * load(g + d) + load(bb + d);
        std::memcpy(o + d, &v, sizeof v);
      }
      for (int64_t d = Dv; d < D; ++d) o[d] = (xr[d] - mean) * inv * g[d] + bb[d];
    }
  }
};

struct Layer {
  Norm n_self, n_cross, n_ffn;
  Linear qkv, self_out, cross_q, cross_out, fc1, fc2, cross_kv;
};

struct EncoderLayer {
  Norm n_attn, n_ffn;
  Linear qkv, out, fc1, fc2;
};

// softmax(q . key(j) * scale, j < T) . val(j) for one query q (K,): key(j) -> (K,), val(j) -> (Q,) (any layout: a
// source's rows, or a beam's cached steps found through its ancestors); out (Q,). scores: room for T rounded up to W.
template <typename Keys, typename Vals>
void attend(const float* q, Keys key, Vals val, int64_t T, int64_t K, int64_t Q, float scale, float* scores,
            float* out) {
  const int64_t Kv = K / W * W, Qv = Q / W * W, Tv = (T + W - 1) / W * W;
#if defined(__AVX512F__)
  if (Kv == K) {  // 16 keys' dot products at once, summed across lanes together (reduce16)
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    for (int64_t j0 = 0; j0 < T; j0 += 16) {
      __m512 acc[16];
      const int64_t n = std::min<int64_t>(16, T - j0);
      for (int64_t jj = 0; jj < n; ++jj) {
        const float* kj = key(j0 + jj);
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kj));
        for (int64_t i = 16; i < K; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(kj + i), a);
        acc[jj] = a;
      }
      for (int64_t jj = n; jj < 16; ++jj) acc[jj] = _mm512_setzero_ps();
      _mm512_storeu_ps(scores + j0,
                       _mm512_mul_ps(_mm512_permutexvar_ps(order, reduce16(acc)), _mm512_set1_ps(scale)));
    }
  } else
#endif
  {
    for (int64_t j = 0; j < T; ++j) {
      const float* kj = key(j);
      vf acc = vf{};
      for (int64_t i = 0; i < Kv; i += W) acc += load(q + i) * load(kj + i);
      float s = hsum(acc);
      for (int64_t i = Kv; i < K; ++i) s += q[i] * kj[i];
      scores[j] = s * scale;
    }
  }
  for (int64_t j = T; j < Tv; ++j) scores[j] = NEG_INF;  // exp: ~1e-38 (vexp's floor), nothing next to exp(0) = 1
  vf top = vf{} + NEG_INF;
  for (int64_t j = 0; j < Tv; j += W) {
    const vf v = load(scores + j);
    top = v > top ? v : top;
  }
  float mx = NEG_INF;
  for (int i = 0; i < W; ++i) mx = std::max(mx, top[i]);
  vf sum = vf{};
  for (int64_t j = 0; j < Tv; j += W) {
    const vf e = vexp(load(scores + j) - mx);
    std::memcpy(scores + j, &e, sizeof e);
    sum += e;
  }
  const float inv = 1.f / hsum(sum);
  for (int64_t i = 0; i < Qv; i += W) {
    vf o = vf{};
    for (int64_t j = 0; j < T; ++j) o += load(val(j) + i) * scores[j];
    o *= inv;
    std::memcpy(out + i, &o, sizeof o);
  }
  for (int64_t i = Qv; i < Q; ++i) {
    float o = 0.f;
    for (int64_t j = 0; j < T; ++j) o += val(j)[i] * scores[j];
    out[i] = o * inv;
  }
}

double denominator(int64_t length, double alpha, int64_t kind) {  // aiayn.search.common.length_penalty_denominator
  if (kind == 0) return std::pow((5.0 + double(length)) / 6.0, alpha);  // gnmt
  if (kind == 1) return std::pow(double(length), alpha);  // power
  return 1.0;  // none
}

struct Finished {  // one finished hypothesis of a sentence's pool
  double score;
  float logprob;
  std::vector<int64_t> tokens;
};

struct Candidate {
  float lp;
  int64_t beam, tok;
};

struct Rules {  // the search's options
  int64_t N, nbest, penalty, stop_rule, eos;  // beam; hypotheses returned; 0 gnmt 1 power 2 none; 0 exact 1 hf 2 first
  double alpha;
};

struct Cache {  // the decoder's keys and values of every step (see Decoder::search)
  std::vector<std::unique_ptr<float[]>> blocks;  // step t: (L, rows[t], H K + H Q)
  std::vector<int64_t> rows;  // rows at step t
  std::vector<int32_t> anc;  // (rows now, stride): each row's ancestor at each step
  int64_t stride;
};

}  // namespace

// The decoder of one model, its weights prepared once (fp32, or bf16 for the products).
class Decoder {
 public:
  Decoder(std::vector<torch::Tensor> t, std::vector<int64_t> ints, std::vector<double> floats) {
    // ints: D, H, K, Q, L, post_ln, activation (0 relu, 1 gelu, 2 swish), the products' Kind, encoder layers;
    // floats: eps, embedding scale
    D = ints[0], H = ints[1], K = ints[2], Q = ints[3], L = ints[4];
    post_ln = ints[5] != 0, act = ints[6];
    const int64_t how = ints[7];  // Kind of the products
    const float eps = float(floats[0]);
    emb_scale = float(floats[1]);
    size_t i = 0;
    auto next = [&]() { return t.at(i++); };
    emb = next().to(torch::kFloat32).contiguous();
    pe = next().to(torch::kFloat32).contiguous();  // (P, D): the positions' encodings added to the embeddings
    auto norm = [&]() {
      Norm n;
      n.w = next().to(torch::kFloat32).contiguous();
      n.b = next().to(torch::kFloat32).contiguous();
      n.eps = eps;
      return n;
    };
    auto norm_or_none = [&]() {  // empty tensors: none (post-LN has no final norm)
      Norm n = norm();
      if (n.w.numel() == 0) n.w = torch::Tensor();
      return n;
    };
    auto lin = [&]() {
      auto w = next();
      auto b = next();
      return Linear(w, b, how);
    };
    auto sublayer = [&](Norm& n, Linear& in, Linear& out) {  // its norm, then its two products
      n = norm();
      in = lin();
      out = lin();
    };
    for (int64_t l = 0; l < L; ++l) {
      Layer y;
      sublayer(y.n_self, y.qkv, y.self_out);
      sublayer(y.n_cross, y.cross_q, y.cross_out);
      sublayer(y.n_ffn, y.fc1, y.fc2);
      layers.push_back(std::move(y));
    }
    final_norm = norm_or_none();
    auto ow = next();
    auto ob = next();
    out = Linear(ow, ob, how);
    V = out.N;
    F = layers.empty() ? 0 : layers[0].fc1.N;
    // the encoder: embeddings, positions, layers, final norm (pre-LN); then each decoder layer's K|V rows of its
    // cross-attention, which project the encoder's output once per batch
    enc_emb = next().to(torch::kFloat32).contiguous();
    enc_pe = next().to(torch::kFloat32).contiguous();
    const int64_t Le = ints.at(8);
    for (int64_t l = 0; l < Le; ++l) {
      EncoderLayer y;
      sublayer(y.n_attn, y.qkv, y.out);
      sublayer(y.n_ffn, y.fc1, y.fc2);
      enc_layers.push_back(std::move(y));
    }
    enc_final = norm_or_none();
    for (auto& y : layers) y.cross_kv = lin();
  }

  // Beam search over B sources src (B * S ids, right-padded), src_len (B,) their real lengths, limits (B,) their step
  // limits. Returns, per sentence, up to nbest (tokens, score, logprob), best first, and whether ``stop`` (called once
  // a step, if not None, on the caller's thread) ended it early. how: beam N, nbest, length penalty (0 gnmt, 1 power,
  // 2 none), stop rule (0 exact, 1 hf, 2 first), BOS, EOS, min_len, and optionally the sentences' groups (0 or absent:
  // group_count's; tests and benchmarks set it).
  //
  // Threads: with T of them and at least 2T sentences (group_count), the sentences are split into T groups of about
  // equal source length and each thread searches its group alone (its products, attention and top-k on one thread):
  // a step then has no point where threads wait for each other, where one step on T threads has ~30 (a product's
  // column blocks, the attention's heads, the rows' top-k). A thread whose core is taken by other work (the server's
  // HTTP thread, its clients, another process) then slows its own group only. Fewer sentences: one group, its loops
  // split over the threads. A sentence's hypotheses do not depend on its group (each row's arithmetic is the same).
  std::tuple<std::vector<std::vector<std::tuple<std::vector<int64_t>, double, double>>>, bool> search(
      std::vector<int64_t> src, std::vector<int64_t> src_len, std::vector<int64_t> limits, std::vector<int64_t> how,
      double alpha, std::vector<int64_t> banned, py::object stop) {
    const Rules rules{how.at(0), how.at(1), how.at(2), how.at(3), how.at(5), alpha};
    const Batch batch{src, src_len, limits, int64_t(limits.size()), how.at(4), how.at(6), banned};
    const int64_t forced = how.size() > 7 ? how.at(7) : 0;
    Results results(batch.B);
    bool stopped = false;
    {
      py::gil_scoped_release nogil;
      const int64_t T = at::get_num_threads();  // the thread's count as PyTorch sets it (parallel_for)
      auto ask = [&]() {  // the caller's stop, on the caller's thread
        py::gil_scoped_acquire gil;
        return stop().cast<bool>();
      };
      const int64_t G_wanted = forced > 0 ? forced : group_count(batch.B, rules.N, T);
      const std::vector<std::vector<int64_t>> groups = split(batch, G_wanted);
      if (groups.size() == 1) {
        search_group(rules, batch, groups[0], [&]() { return !stop.is_none() && ask(); }, results, stopped);
      } else {
        // thread 0 (the caller's) asks ``stop`` at each of its steps and, once its group is done, every millisecond
        // until the others are; the others read its answer
        const int64_t G = int64_t(groups.size());
        std::atomic<bool> halt{false};
        int64_t left = G;  // groups not done yet (under ``done``)
        std::mutex done;
        std::condition_variable finished;
        std::exception_ptr error;
        std::atomic_flag failed = ATOMIC_FLAG_INIT;
        auto fail = [&]() {
          if (!failed.test_and_set()) error = std::current_exception();
          halt = true;
        };
        auto asked = [&]() {
          if (!halt && !stop.is_none() && ask()) halt = true;
          return bool(halt);
        };
        // the groups' threads: the caller's and nt - 1 of their own, which end with the call (an OpenMP team's would
        // spin on their cores after it, while the server answers the call's requests and reads the next ones)
        const int64_t nt = std::min(G, T);
        auto run_groups = [&](int64_t tid) {
          InGroup inline_loops;
          for (int64_t g = tid; g < G; g += nt) {
            bool mine = false;
            try {
              if (tid == 0) search_group(rules, batch, groups[g], asked, results, mine);
              else search_group(rules, batch, groups[g], [&]() { return bool(halt); }, results, mine);
            } catch (...) {
              fail();
            }
            std::lock_guard<std::mutex> hold(done);
            if (--left == 0) finished.notify_all();
          }
        };
        std::vector<std::thread> helpers;
        int64_t started = 1;
        try {
          for (; started < nt; ++started) helpers.emplace_back(run_groups, started);
        } catch (const std::system_error&) {  // no thread to be had: the caller searches those groups too
        }
        run_groups(0);
        for (int64_t tid = started; tid < nt; ++tid) run_groups(tid);
        {  // the caller's thread: asks ``stop`` until every group is done
          std::unique_lock<std::mutex> hold(done);
          while (left > 0) {
            if (stop.is_none()) {
              finished.wait(hold);
              continue;
            }
            finished.wait_for(hold, std::chrono::milliseconds(1));
            hold.unlock();
            try {
              asked();
            } catch (...) {
              fail();
            }
            hold.lock();
          }
        }
        for (auto& helper : helpers) helper.join();
        if (error) std::rethrow_exception(error);
        stopped = halt;
      }
    }
    return {results, stopped};
  }

  // How many groups B sentences of N rows each (the beam) are searched in on T threads (search's comment): T where
  // each thread has at least two sentences and ROWS rows (fewer rows make its products slower than a share of every
  // row's columns: fp32 at 4 rows ran at ~70% of its unit's peak, BENCHMARKS.md "The native search's products"),
  // else one.
  static int64_t group_count(int64_t B, int64_t N, int64_t T) {
    if (T <= 1 || in_group || omp_in_parallel() || B < T * std::max<int64_t>(2, (ROWS + N - 1) / N)) return 1;
    return T;
  }

 private:
  typedef std::vector<std::vector<std::tuple<std::vector<int64_t>, double, double>>> Results;
  struct Batch {  // search's arguments: B sources of S ids (right-padded), their lengths and step limits
    const std::vector<int64_t>& src;
    const std::vector<int64_t>& src_len;
    const std::vector<int64_t>& limits;
    int64_t B;
    int64_t bos, min_len;
    const std::vector<int64_t>& banned;
    int64_t S() const { return B ? int64_t(src.size()) / B : 0; }
  };

  // The sentences (their indices) in G groups of about equal summed source length: longest first, each to the group
  // with the least so far; each group in the sentences' order. G = 1: all of them, in order.
  static std::vector<std::vector<int64_t>> split(const Batch& batch, int64_t G) {
    G = std::max<int64_t>(1, std::min(G, batch.B));
    std::vector<std::vector<int64_t>> groups(G);
    if (G == 1) {
      for (int64_t b = 0; b < batch.B; ++b) groups[0].push_back(b);
      return groups;
    }
    std::vector<int64_t> order(batch.B), load(G, 0);
    for (int64_t b = 0; b < batch.B; ++b) order[b] = b;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t p, int64_t q) { return batch.src_len[p] > batch.src_len[q]; });
    for (int64_t b : order) {
      const int64_t g = std::min_element(load.begin(), load.end()) - load.begin();
      groups[g].push_back(b);
      load[g] += batch.src_len[b] + 1;
    }
    for (auto& g : groups) std::sort(g.begin(), g.end());
    return groups;
  }

  // The beam search of the sentences ``which`` of ``batch`` (their results into results[b]); ``halted()`` is asked once
  // a step: true ends the search and sets ``stopped``.
  template <typename Halted>
  void search_group(const Rules& rules, const Batch& batch, const std::vector<int64_t>& which, Halted&& halted,
                    Results& results, bool& stopped) const {
    const int64_t N = rules.N, bos = batch.bos, eos = rules.eos, min_len = batch.min_len;
    const int64_t B = int64_t(which.size()), S_all = batch.S();
    if (B == 0) return;  // no sentence: nothing to search (and no step limit to take the largest of)
    // the group's sources, src_len and limits, padded to its longest source
    std::vector<int64_t> src_len(B), limits(B);
    int64_t S = 1;
    for (int64_t b = 0; b < B; ++b) {
      src_len[b] = batch.src_len[which[b]];
      limits[b] = batch.limits[which[b]];
      S = std::max(S, src_len[b]);
    }
    std::vector<int64_t> src(B * S, 0);
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(src.data() + b * S, batch.src.data() + which[b] * S_all, sizeof(int64_t) * src_len[b]);
    const std::vector<int64_t>& banned = batch.banned;
    std::vector<std::vector<float>> cross_k, cross_v;
    std::vector<const float*> ck(L), cv(L);
    encode(src, B, S, src_len, cross_k, cross_v);
    for (int64_t l = 0; l < L; ++l) {
      ck[l] = cross_k[l].data();
      cv[l] = cross_v[l].data();
    }
    const int64_t C = *std::max_element(limits.begin(), limits.end());  // steps at most
    // the key/value cache: step t's block (L, rows at t, keys (H K) | values (H Q)), written once and never moved;
    // a row reads its earlier steps through its ancestors: anc[r * (C + 1) + j] = the row at step j its prefix
    // continues (a beam's reorder is a copy of those indices, not of keys and values)
    Cache cache{{}, {}, std::vector<int32_t>(B * N * (C + 1)), C + 1};
    // live sentences (their index in the group), their beams' summed logprobs (n, N), pools, limits
    std::vector<int64_t> sent(B);
    for (int64_t b = 0; b < B; ++b) sent[b] = b;
    std::vector<float> scores(B * N, NEG_INF);
    for (int64_t b = 0; b < B; ++b) scores[b * N] = 0.f;
    std::vector<std::vector<Finished>> pools(B);
    std::vector<int64_t> tokens(B * (C + 1), bos), new_tokens;  // (rows, t + 1) prefixes, BOS first; stride C + 1
    std::vector<int32_t> new_anc;
    int64_t R = B, per_sent = 1;  // rows; rows per sentence (1 on the first step, then N)
    const int64_t rows_max = B * N, T_room = (std::max(C, S) + W - 1) / W * W;
    std::vector<float> x(rows_max * D), h(rows_max * std::max({D, 3 * std::max(K, Q) * H, F})),
        a(rows_max * H * Q), y(rows_max * D), logits(rows_max * V), sc(rows_max * H * T_room);
    const float scale = 1.f / std::sqrt(float(K));
    for (int64_t t = 0;; ++t) {
      if (halted()) {
        stopped = true;
        break;
      }
      cache.blocks.emplace_back(new float[L * R * (H * K + H * Q)]);
      cache.rows.push_back(R);
      for (int64_t r = 0; r < R; ++r) cache.anc[r * cache.stride + t] = int32_t(r);
      step(t, R, per_sent, tokens, C, sent, ck, cv, S, src_len, cache, x, h, a, y, logits, sc, T_room, scale);
      // banned ids and min_len at -inf; each row's best k (k = 2N) of the logits, less the row's log-sum-exp: its k
      // best log-probabilities (log_softmax of the row, computed for those k only)
      const int64_t k = std::min<int64_t>(2 * N, V);
      std::vector<float> top_v(R * k);
      std::vector<int64_t> top_i(R * k);
      parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          float* lg = logits.data() + r * V;
          for (int64_t id : banned) lg[id] = NEG_INF;
          const float eos_lg = lg[eos];  // in the log-sum-exp even where min_len bars it
          if (t < min_len) lg[eos] = NEG_INF;
          row_top(lg, k, top_v.data() + r * k, top_i.data() + r * k);
          const float m = std::max(top_v[r * k], eos_lg);
          const float sum = sum_exp(lg, V, m) + (t < min_len ? std::exp(eos_lg - m) : 0.f);
          const float lse = m + std::log(sum);
          for (int64_t j = 0; j < k; ++j) top_v[r * k + j] -= lse;
        }
      });
      const int64_t n = int64_t(sent.size());
      std::vector<int64_t> keep_rows;  // next rows: the row each continues
      std::vector<int64_t> keep_tok;
      std::vector<float> keep_scores;
      std::vector<int64_t> live;
      for (int64_t s = 0; s < n; ++s) {
        const int64_t b = sent[s], first = s * per_sent;
        const std::vector<Candidate> next =
            sentence_step(rules, top_v.data() + first * k, top_i.data() + first * k, k, scores.data() + s * N,
                          per_sent, tokens.data() + first * (C + 1), C + 1, t, limits[b], pools[b]);
        if (next.empty()) continue;  // done
        live.push_back(b);
        for (const Candidate& c : next) {
          keep_rows.push_back(first + c.beam);
          keep_tok.push_back(c.tok);
          keep_scores.push_back(c.lp);
        }
      }
      if (live.empty()) break;
      // the next rows: each continues a row's prefix and ancestors (the beams' reorder, finished sentences dropped)
      const int64_t R2 = int64_t(keep_rows.size());
      new_tokens.assign(R2 * (C + 1), 0);
      new_anc.assign(R2 * cache.stride, 0);
      for (int64_t r = 0; r < R2; ++r) {
        const int64_t p = keep_rows[r];
        std::memcpy(new_tokens.data() + r * (C + 1), tokens.data() + p * (C + 1), sizeof(int64_t) * (t + 1));
        new_tokens[r * (C + 1) + t + 1] = keep_tok[r];
        std::memcpy(new_anc.data() + r * cache.stride, cache.anc.data() + p * cache.stride,
                    sizeof(int32_t) * (t + 1));
      }
      tokens.swap(new_tokens);
      cache.anc.swap(new_anc);
      sent = live;
      scores = keep_scores;
      R = R2;
      per_sent = N;
    }
    for (int64_t b = 0; b < B; ++b) {
      auto& pool = pools[b];
      for (int64_t j = 0; j < std::min<int64_t>(rules.nbest, int64_t(pool.size())); ++j)
        results[which[b]].emplace_back(pool[j].tokens, pool[j].score, double(pool[j].logprob));
    }
  }

 private:
  int64_t D = 0, H = 0, K = 0, Q = 0, L = 0, V = 0, F = 0, act = 0;
  bool post_ln = true;
  float emb_scale = 1.f;
  torch::Tensor emb, pe, enc_emb, enc_pe;
  std::vector<Layer> layers;
  std::vector<EncoderLayer> enc_layers;
  Norm final_norm, enc_final;
  Linear out;

  // The encoder over B sources of S ids (right-padded; src_len real ids each: only those are computed), then every
  // decoder layer's cross-attention keys (B, H, S, K) and values (B, H, S, Q) of its output (a source's first
  // src_len positions written), into ck[l] and cv[l].
  void encode(const std::vector<int64_t>& src, int64_t B, int64_t S, const std::vector<int64_t>& src_len,
              std::vector<std::vector<float>>& ck, std::vector<std::vector<float>>& cv) const {
    // the sources' real tokens only, packed: sentence b's rows are first[b] .. first[b] + src_len[b] - 1
    std::vector<int64_t> first(B + 1, 0), sent_of;
    for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + src_len[b];
    const int64_t M = first[B], qw = H * K, vw = H * Q, w3 = 2 * qw + vw;
    for (int64_t b = 0; b < B; ++b) sent_of.insert(sent_of.end(), src_len[b], b);
    const int64_t Fe = enc_layers.empty() ? 0 : enc_layers[0].fc1.N;
    const int64_t Sp = (S + W - 1) / W * W;  // a query's scores: S rounded up to whole vectors
    std::vector<float> x(M * D), y(M * D), h(M * std::max({w3, Fe, D})), a(M * vw), sc(M * H * Sp);
    const float* E = enc_emb.data_ptr<float>();
    const float* P = enc_pe.data_ptr<float>();
    for (int64_t r = 0; r < M; ++r) {
      const int64_t b = sent_of[r], pos = r - first[b];
      for (int64_t d = 0; d < D; ++d) x[r * D + d] = E[src[b * S + pos] * D + d] * emb_scale + P[pos * D + d];
    }
    const float scale = 1.f / std::sqrt(float(K));
    for (const EncoderLayer& ly : enc_layers) {
      const float* in = x.data();
      if (!post_ln) {
        ly.n_attn(x.data(), M, D, y.data());
        in = y.data();
      }
      ly.qkv(in, M, h.data());
      parallel_for(0, M * H, heads_grain(S), [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t r = i / H, hh = i % H, b = sent_of[r];
          const float* keys = h.data() + first[b] * w3 + qw + hh * K;  // from the sentence's first row
          const float* vals = h.data() + first[b] * w3 + 2 * qw + hh * Q;
          attend(h.data() + r * w3 + hh * K, [&](int64_t j) { return keys + j * w3; },
                 [&](int64_t j) { return vals + j * w3; }, src_len[b], K, Q, scale, sc.data() + i * Sp,
                 a.data() + r * vw + hh * Q);
        }
      });
      ly.out(a.data(), M, y.data());
      residual(x.data(), y.data(), M, ly.n_attn);
      feed_forward(ly.n_ffn, ly.fc1, ly.fc2, x.data(), M, y.data(), h.data());
    }
    if (enc_final.w.defined()) enc_final(x.data(), M, D, x.data());
    ck.assign(L, std::vector<float>(B * H * S * K));
    cv.assign(L, std::vector<float>(B * H * S * Q));
    for (int64_t l = 0; l < L; ++l) {
      layers[l].cross_kv(x.data(), M, h.data());  // (M, qw + vw)
      for (int64_t r = 0; r < M; ++r) {
        const int64_t b = sent_of[r], s = r - first[b];
        for (int64_t hh = 0; hh < H; ++hh) {
          std::memcpy(ck[l].data() + ((b * H + hh) * S + s) * K, h.data() + r * (qw + vw) + hh * K, sizeof(float) * K);
          std::memcpy(cv[l].data() + ((b * H + hh) * S + s) * Q, h.data() + r * (qw + vw) + qw + hh * Q,
                      sizeof(float) * Q);
        }
      }
    }
  }

  // One live sentence's step (aiayn.search.beam's rules): its 2N best (beam, token) candidates from its ``rows`` rows'
  // best k log-probabilities top_v / ids top_i (rows, k) and its beams' summed log-probabilities ``beam_scores``; the
  // finished among the first N (EOS, or all of them at the sentence's ``limit``) offered to its ``pool``, best first,
  // an equal score after those already there; then its next N beams, or none when it is done (at its limit, nothing
  // live, or the stop rule's bound). ``prefixes``: its rows' tokens, BOS first, row stride ``stride``.
  std::vector<Candidate> sentence_step(const Rules& o, const float* top_v, const int64_t* top_i, int64_t k,
                                       const float* beam_scores, int64_t rows, const int64_t* prefixes, int64_t stride,
                                       int64_t t, int64_t limit, std::vector<Finished>& pool) const {
    constexpr double DONE = -std::numeric_limits<double>::infinity();
    std::vector<Candidate> cand;
    for (int64_t rb = 0; rb < rows; ++rb)
      for (int64_t j = 0; j < k; ++j) cand.push_back({beam_scores[rb] + top_v[rb * k + j], rb, top_i[rb * k + j]});
    std::stable_sort(cand.begin(), cand.end(), [](const Candidate& p, const Candidate& q) { return p.lp > q.lp; });
    cand.resize(std::min<size_t>(2 * o.N, cand.size()));
    const int64_t length = t + 1;
    const bool at_limit = limit <= length;
    const double den = denominator(length, o.alpha, o.penalty);
    for (int64_t j = 0; j < std::min<int64_t>(o.N, int64_t(cand.size())); ++j) {
      const Candidate& c = cand[j];
      const bool is_eos = c.tok == o.eos;
      if (!(is_eos || at_limit) || !(c.lp > NEG_INF)) continue;
      Finished f{double(c.lp) / den, c.lp, {}};
      const int64_t* prefix = prefixes + c.beam * stride + 1;
      f.tokens.assign(prefix, prefix + t);
      if (!is_eos) f.tokens.push_back(c.tok);
      auto at = std::upper_bound(pool.begin(), pool.end(), f.score,
                                 [](double v, const Finished& e) { return v > e.score; });
      if (at - pool.begin() < o.N) {
        pool.insert(at, std::move(f));
        if (int64_t(pool.size()) > o.N) pool.pop_back();
      }
    }
    std::vector<Candidate> next;  // the N best non-EOS candidates, in order; EOS ones at -inf fill a shortfall
    for (const Candidate& c : cand)
      if (c.tok != o.eos && int64_t(next.size()) < o.N) next.push_back(c);
    for (const Candidate& c : cand)
      if (c.tok == o.eos && int64_t(next.size()) < o.N) next.push_back({NEG_INF, c.beam, c.tok});
    const float best = next.empty() ? NEG_INF : next[0].lp;
    double bound;  // the best penalized score a live beam can still finish with
    if (o.stop_rule == 2) bound = DONE;  // first
    else if (o.stop_rule == 1) bound = double(best) / denominator(length, o.alpha, o.penalty);  // hf
    else bound = std::max(double(best) / denominator(length + 1, o.alpha, o.penalty),
                          double(best) / denominator(limit, o.alpha, o.penalty));  // exact
    const int64_t kth = o.stop_rule == 0 ? o.nbest : o.N;  // exact: the nbest-th, others: a full pool
    const double cut = int64_t(pool.size()) >= kth ? pool[kth - 1].score : DONE;
    if (at_limit || best == NEG_INF || (cut > DONE && bound <= cut) || int64_t(next.size()) < o.N) return {};
    return next;
  }

  // The k largest of row (V,), best first; equal values: the lower id first. Once k are held, a vector of W values
  // is looked at only where one of them beats the k-th.
  void row_top(const float* row, int64_t k, float* vals, int64_t* ids) const {
    int64_t n = 0;
    auto offer = [&](int64_t v) {
      const float x = row[v];
      if (n == k && !(x > vals[k - 1])) return;
      int64_t j = n < k ? n++ : k - 1;
      while (j > 0 && vals[j - 1] < x) {
        vals[j] = vals[j - 1];
        ids[j] = ids[j - 1];
        --j;
      }
      vals[j] = x;
      ids[j] = v;
    };
    int64_t v = 0;
    for (; v < V && n < k; ++v) offer(v);
    for (; v + W <= V; v += W)
      for (uint32_t bits = greater(load(row + v), vals[k - 1]); bits; bits &= bits - 1) offer(v + __builtin_ctz(bits));
    for (; v < V; ++v) offer(v);
    for (; n < k; ++n) vals[n] = NEG_INF, ids[n] = 0;
  }

  void activation(float* v, int64_t n) const {
    if (act == 0) {
      for (int64_t i = 0; i < n; ++i) v[i] = v[i] > 0.f ? v[i] : 0.f;
    } else if (act == 1) {
      for (int64_t i = 0; i < n; ++i) v[i] = 0.5f * v[i] * (1.f + std::erf(v[i] * float(M_SQRT1_2)));
    } else {
      for (int64_t i = 0; i < n; ++i) v[i] = v[i] / (1.f + std::exp(-v[i]));
    }
  }

  // One decoder step of R rows at position t: the last tokens' logits into ``logits`` (R, V); each row's keys/values
  // written into the cache's block for t. Rows s * per_sent .. belong to live sentence s (original index sent[s]).
  // sc: room for T_room scores per (row, head).
  void step(int64_t t, int64_t R, int64_t per_sent, const std::vector<int64_t>& tokens, int64_t C,
            const std::vector<int64_t>& sent, const std::vector<const float*>& ck, const std::vector<const float*>& cv,
            int64_t S, const std::vector<int64_t>& src_len, const Cache& cache, std::vector<float>& x,
            std::vector<float>& h, std::vector<float>& a, std::vector<float>& y, std::vector<float>& logits,
            std::vector<float>& sc, int64_t T_room, float scale) const {
    const float* E = emb.data_ptr<float>();
    const float* P = pe.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) {
      const int64_t tok = tokens[r * (C + 1) + t];
      for (int64_t d = 0; d < D; ++d) x[r * D + d] = E[tok * D + d] * emb_scale + P[t * D + d];
    }
    const int64_t qw = H * K, vw = H * Q, kv = qw + vw, w3 = qw + kv;
    for (int64_t l = 0; l < L; ++l) {
      const Layer& ly = layers[l];
      // masked self-attention over the cached steps and this one
      const float* in = x.data();
      if (!post_ln) {
        ly.n_self(x.data(), R, D, y.data());
        in = y.data();
      }
      ly.qkv(in, R, h.data());  // (R, qw + qw + vw)
      float* block = cache.blocks[t].get() + l * R * kv;
      for (int64_t r = 0; r < R; ++r) std::memcpy(block + r * kv, h.data() + r * w3 + qw, sizeof(float) * kv);
      parallel_for(0, R * H, heads_grain(t + 1), [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t r = i / H, hh = i % H;
          const int32_t* anc = cache.anc.data() + r * cache.stride;
          auto at = [&](int64_t j) {  // step j's keys | values of this row's ancestor, this head
            return cache.blocks[j].get() + (l * cache.rows[j] + anc[j]) * kv;
          };
          attend(h.data() + r * w3 + hh * K, [&](int64_t j) { return at(j) + hh * K; },
                 [&](int64_t j) { return at(j) + qw + hh * Q; }, t + 1, K, Q, scale, sc.data() + i * T_room,
                 a.data() + r * vw + hh * Q);
        }
      });
      ly.self_out(a.data(), R, y.data());
      residual(x.data(), y.data(), R, ly.n_self);
      // cross-attention over the sentence's source
      in = x.data();
      if (!post_ln) {
        ly.n_cross(x.data(), R, D, y.data());
        in = y.data();
      }
      ly.cross_q(in, R, h.data());  // (R, qw)
      parallel_for(0, R * H, heads_grain(S), [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t r = i / H, hh = i % H;
          const int64_t b = sent[r / per_sent];
          const float* keys = ck[l] + (b * H + hh) * S * K;
          const float* vals = cv[l] + (b * H + hh) * S * Q;
          attend(h.data() + r * qw + hh * K, [&](int64_t j) { return keys + j * K; },
                 [&](int64_t j) { return vals + j * Q; }, src_len[b], K, Q, scale, sc.data() + i * T_room,
                 a.data() + r * vw + hh * Q);
        }
      });
      ly.cross_out(a.data(), R, y.data());
      residual(x.data(), y.data(), R, ly.n_cross);
      feed_forward(ly.n_ffn, ly.fc1, ly.fc2, x.data(), R, y.data(), h.data());
    }
    const float* last = x.data();
    if (final_norm.w.defined()) {
      final_norm(x.data(), R, D, y.data());
      last = y.data();
    }
    out(last, R, logits.data());
  }

  // The (row, head) attentions a thread takes at least, for T keys: ~32k multiply-adds.
  int64_t heads_grain(int64_t T) const { return std::max<int64_t>(4, (1 << 15) / std::max<int64_t>(1, T * (K + Q))); }

  // The feed-forward sublayer (eq. 2) of M rows x (M, D), in place; y (M, D) and h (M, fc1.N) are room.
  void feed_forward(const Norm& norm, const Linear& fc1, const Linear& fc2, float* x, int64_t M, float* y,
                    float* h) const {
    const float* in = x;
    if (!post_ln) {
      norm(x, M, D, y);
      in = y;
    }
    fc1(in, M, h);
    activation(h, M * fc1.N);
    fc2(h, M, y);
    residual(x, y, M, norm);
  }

  // x = LayerNorm(x + y) post-LN, x + y pre-LN.
  void residual(float* x, const float* y, int64_t R, const Norm& norm) const {
    for (int64_t i = 0; i < R * D; ++i) x[i] += y[i];
    if (post_ln) norm(x, R, D, x);
  }
};

// One thread's peak of the products' unit for ``kind`` (0 fp32: FMA on W floats; 1 bf16: the AVX512-BF16 dot product,
// else the fp32 FMA the widened weights run on; 2 int8: the AVX512-VNNI dot product, else the fp32 FMA), in
// multiply-adds per second: ``iters`` rounds of 16 independent instructions (12 of fp32 on AVX2), as many sums in
// flight as the kernels keep. What benchmarks.native_products holds the products' speed against.
double peak_macs(int64_t kind, int64_t iters) {
  auto t0 = std::chrono::steady_clock::now();
  double macs = 0.0;
#ifdef AIAYN_DPBF16
  if (kind == BF16) {
    __m512 a[16];
    for (auto& v : a) v = _mm512_setzero_ps();
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), w = x;
    for (int64_t k = 0; k < iters; ++k) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, w);
      __asm__ volatile("" : "+v"(x));
    }
    float sink = 0.f;
    for (auto& v : a) sink += _mm512_reduce_add_ps(v);
    __asm__ volatile("" : : "r"(&sink) : "memory");
    macs = 32.0 * 16 * iters;
  }
#endif
#ifdef AIAYN_VNNI
  if (kind == INT8) {
    __m512i a[16];
    for (auto& v : a) v = _mm512_setzero_si512();
    __m512i x = _mm512_set1_epi8(1), w = x;
    for (int64_t k = 0; k < iters; ++k) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) a[i] = _mm512_dpbusd_epi32(a[i], x, w);
      __asm__ volatile("" : "+v"(x));
    }
    int32_t sink = 0;
    for (auto& v : a) sink += _mm512_reduce_add_epi32(v);
    __asm__ volatile("" : : "r"(&sink) : "memory");
    macs = 64.0 * 16 * iters;
  }
#endif
  if (macs == 0.0) {  // fp32 FMA on W floats; AVX2 has 16 vector registers: 12 sums, the operands, no spills
    constexpr int A = W == 16 ? 16 : 12;
    vf a[A];
    for (auto& v : a) v = vf{};
    vf x = vf{} + 1.f, w = x;
    for (int64_t k = 0; k < iters; ++k) {
#pragma GCC unroll 16
      for (int i = 0; i < A; ++i) a[i] += x * w;
      __asm__ volatile("" : "+x"(x));
    }
    float sink = 0.f;
    for (auto& v : a)
      for (int j = 0; j < W; ++j) sink += v[j];
    __asm__ volatile("" : : "r"(&sink) : "memory");
    macs = double(W) * A * iters;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return macs / s;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#ifdef AIAYN_VNNI
  m.attr("vnni") = true;
#else
  m.attr("vnni") = false;
#endif
#ifdef AIAYN_DPBF16
  m.attr("dpbf16") = true;
#else
  m.attr("dpbf16") = false;
#endif
  // A linear layer through the native products (kind 0 fp32, 1 bf16 weights, 2 int8 weights): tests, benchmarks.
  py::class_<Linear>(m, "Linear", py::module_local())
      .def(py::init<torch::Tensor, torch::Tensor, int64_t>())
      .def("__call__", [](const Linear& lin, torch::Tensor x) {
        at::get_num_threads();
        auto xc = x.to(torch::kFloat32).contiguous();
        auto y = torch::empty({xc.size(0), lin.N}, xc.options());
        lin(xc.data_ptr<float>(), xc.size(0), y.data_ptr<float>());
        return y;
      })
      // seconds per call of ``calls`` calls on x, timed here (benchmarks.native_products: no Python between calls)
      .def("seconds", [](const Linear& lin, torch::Tensor x, int64_t calls) {
        at::get_num_threads();
        auto xc = x.to(torch::kFloat32).contiguous();
        std::vector<float> y(xc.size(0) * lin.N);
        py::gil_scoped_release nogil;
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < calls; ++i) lin(xc.data_ptr<float>(), xc.size(0), y.data());
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(calls);
      });
  m.def("group_count", &Decoder::group_count, "the groups a search of B sentences, beam N, takes on T threads");
  m.def("peak_macs", &peak_macs, "one thread's multiply-adds per second on the products' unit for a kind");
  py::class_<Decoder>(m, "Decoder", py::module_local())
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("search", &Decoder::search);
}
