// Int8 weight-only products on the CPU for decoding (a few rows of activations):
// y[m, n] = sum_g scale[n, g] * sum_{k in group g} x[m, k] * q[n, k], accumulated in fp32.
// Each output channel's int8 row is read once for all the rows of x (it stays in L1
// while they pass), so the weights cross memory as int8: a quarter of fp32's bytes. The
// inner loop takes 4 output channels and up to 4 rows of x at once (each x load used 4
// times, each widened int8 vector up to 4 times), in AVX-512 or
// AVX2 intrinsics chosen at load time from the CPU's flags (a scalar loop otherwise).
// Output channels are split across torch's intra-op threads (at::parallel_for).
//
// Beside it, fsharded_cpu::rows_matmul(x, w): x @ w for 1 to 4 rows of x and a float
// weight (fp32 or bf16), the same stream over the weight (see below).
//
// Dispatcher ops, fsharded_cpu::int8_matmul(x, q, scales) and rows_matmul, registered with
// TORCH_LIBRARY and loaded by torch.ops.load_library: called from Python or from a
// compiled graph without a Python frame in between (its fake and vmap rules are
// registered in Python). It includes only ATen's core headers, so it builds in seconds.
// See fsharded/kernels/weight_int8.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace {

// Dot products of R rows of x (row stride K) with 4 output channels' int8 rows (row
// stride K) over one group of gs elements: acc[r * 4 + c]. Each int8 vector is widened
// to fp32 once and used for all R rows. Three builds of the same function.
#if defined(__x86_64__) && defined(__GNUC__)
template <int R>
__attribute__((target("avx512f,avx512bw")))
void tile_avx512(const float* x, const int8_t* q0, int64_t K, int64_t gs, float* acc) {
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= gs; k += 16) {
    __m512 w[4];
    for (int c = 0; c < 4; ++c)
      w[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q0 + c * K + k))));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(xv, w[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) {
      float t = _mm512_reduce_add_ps(a[r][c]);
      for (int64_t j = k; j < gs; ++j) t += x[r * K + j] * static_cast<float>(q0[c * K + j]);
      acc[r * 4 + c] = t;
    }
}

__attribute__((target("avx2,fma")))
inline float hsum256(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

template <int R>
__attribute__((target("avx2,fma")))
void tile_avx2(const float* x, const int8_t* q0, int64_t K, int64_t gs, float* acc) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= gs; k += 8) {
    __m256 w[4];
    for (int c = 0; c < 4; ++c)
      w[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q0 + c * K + k))));
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < 4; ++c) a[r][c] = _mm256_fmadd_ps(xv, w[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) {
      float t = hsum256(a[r][c]);
      for (int64_t j = k; j < gs; ++j) t += x[r * K + j] * static_cast<float>(q0[c * K + j]);
      acc[r * 4 + c] = t;
    }
}
#endif

template <int R>
void tile_scalar(const float* x, const int8_t* q0, int64_t K, int64_t gs, float* acc) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) {
      float t = 0.f;
      for (int64_t k = 0; k < gs; ++k) t += x[r * K + k] * static_cast<float>(q0[c * K + k]);
      acc[r * 4 + c] = t;
    }
}

using Tile = void (*)(const float*, const int8_t*, int64_t, int64_t, float*);

struct Tiles {
  Tile by_rows[4];  // R = 1..4
};

// FSHARDED_DECODE_ISA=avx2 or scalar caps the instruction set the products use (tests of
// the other builds on a machine that has AVX-512).
int isa_cap() {
  const char* v = std::getenv("FSHARDED_DECODE_ISA");
  if (v == nullptr) return 2;
  const std::string s(v);
  return s == "scalar" ? 0 : s == "avx2" ? 1 : 2;
}

Tiles pick() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (isa_cap() >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
    return {{tile_avx512<1>, tile_avx512<2>, tile_avx512<3>, tile_avx512<4>}};
  if (isa_cap() >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {{tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>}};
#endif
  return {{tile_scalar<1>, tile_scalar<2>, tile_scalar<3>, tile_scalar<4>}};
}

const Tiles kTiles = pick();

// Output channels n0..n1 (a multiple of 4 apart, but for the last) for every row of x,
// written to y (M, N) in T.
template <typename T>
void channels(const float* x, int64_t M, int64_t K, const int8_t* q, const float* s, int64_t groups, T* y,
              int64_t N, int64_t n0, int64_t n1) {
  const int64_t gs = K / groups;
  float part[16], total[16];
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t c4 = std::min<int64_t>(4, n1 - n);
    for (int64_t m = 0; m < M; m += 4) {
      const int rows = static_cast<int>(std::min<int64_t>(4, M - m));
      std::fill(total, total + 16, 0.f);
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = x + m * K + g * gs;
        if (c4 == 4) {
          kTiles.by_rows[rows - 1](xg, q + n * K + g * gs, K, gs, part);
        } else {  // the last channels: one at a time
          for (int r = 0; r < rows; ++r)
            for (int64_t c = 0; c < c4; ++c) {
              float t = 0.f;
              const int8_t* qc = q + (n + c) * K + g * gs;
              for (int64_t k = 0; k < gs; ++k) t += xg[r * K + k] * static_cast<float>(qc[k]);
              part[r * 4 + c] = t;
            }
        }
        for (int r = 0; r < rows; ++r)
          for (int64_t c = 0; c < c4; ++c) total[r * 4 + c] += part[r * 4 + c] * s[(n + c) * groups + g];
      }
      for (int r = 0; r < rows; ++r)
        for (int64_t c = 0; c < c4; ++c) y[(m + r) * N + n + c] = static_cast<T>(total[r * 4 + c]);
    }
  }
}

template <typename T>
void run(const float* xp, int64_t M, int64_t K, const int8_t* qp, const float* sp, int64_t groups, T* yp,
         int64_t N) {
  // Blocks of 4 output channels; at least 64 channels (16 blocks) per task.
  const int64_t blocks = (N + 3) / 4;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    channels<T>(xp, M, K, qp, sp, groups, yp, N, b0 * 4, std::min<int64_t>(N, b1 * 4));
  });
}

at::Tensor int8_matmul(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scales_in) {
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu() &&
                  (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf),
              "int8_matmul: x must be a float32/bfloat16/float16 CPU tensor (M, K)");
  TORCH_CHECK(q_in.dim() == 2 && q_in.scalar_type() == at::kChar && q_in.device().is_cpu(),
              "int8_matmul: q must be an int8 CPU tensor (N, K)");
  TORCH_CHECK(scales_in.dim() == 2 && scales_in.scalar_type() == at::kFloat && scales_in.device().is_cpu(),
              "int8_matmul: scales must be a float32 CPU tensor (N, groups)");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = q_in.size(0), groups = scales_in.size(1);
  TORCH_CHECK(q_in.size(1) == K && scales_in.size(0) == N && groups >= 1 && K % groups == 0,
              "int8_matmul: shapes do not fit: x (", M, ", ", K, "), q (", N, ", ", q_in.size(1), "), scales (",
              scales_in.size(0), ", ", groups, ")");
  const at::Tensor q = q_in.contiguous(), scales = scales_in.contiguous();
  const int8_t* qp = q.const_data_ptr<int8_t>();
  const float* sp = scales.const_data_ptr<float>();
  at::Tensor y = at::empty({M, N}, x_in.options());
  if (dt == at::kFloat) {
    const at::Tensor x = x_in.contiguous();
    run<float>(x.const_data_ptr<float>(), M, K, qp, sp, groups, y.mutable_data_ptr<float>(), N);
    return y;
  }
  // bf16 / fp16 rows widened to fp32 once (M x K: a few rows), the output written in x's dtype.
  std::vector<float> xf(static_cast<size_t>(M * K));
  const at::Tensor x = x_in.contiguous();
  if (dt == at::kBFloat16) {
    const c10::BFloat16* xb = x.const_data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xb[i]);
    run<c10::BFloat16>(xf.data(), M, K, qp, sp, groups, y.mutable_data_ptr<c10::BFloat16>(), N);
  } else {
    const c10::Half* xh = x.const_data_ptr<c10::Half>();
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xh[i]);
    run<c10::Half>(xf.data(), M, K, qp, sp, groups, y.mutable_data_ptr<c10::Half>(), N);
  }
  return y;
}

// ---- float weights: y (R, N) = x (R, K) @ w (K, N), w row-major, R up to 4 rows --------
// Decoding reads every weight once per token, so the product is a stream over w's rows:
// w's rows go in fixed blocks of 256, each thread takes a run of whole blocks (one linear
// stream), each block keeps R rows of sums over all N columns in L1/L2 and adds 4 rows
// of w into them per pass (each w vector loaded once for all R rows of x); the blocks'
// sums are added in block order, so the result does not depend on the thread count.
// fp32 sums; w in fp32 or bf16 (widened in registers).
constexpr int kRowsMax = 4;

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename W>
void cols_scalar(const float* x, int R, int64_t xs, int64_t kn, const W* w, int64_t N, float* acc) {
  for (int64_t k = 0; k < kn; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * xs + k];
      for (int64_t n = 0; n < N; ++n) acc[r * N + n] += xv * widen(w[k * N + n]);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename W, int R>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void cols_avx512(const float* x, int64_t xs, int64_t kn, const W* w, int64_t N, float* acc) {
  int64_t k = 0;
  for (; k + 4 <= kn; k += 4) {
    __m512 xv[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) xv[r][j] = _mm512_set1_ps(x[r * xs + k + j]);
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 m = N - n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (N - n)) - 1);
      __m512 a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm512_maskz_loadu_ps(m, acc + r * N + n);
      for (int j = 0; j < 4; ++j) {
        const __m512 wv = load16(w + (k + j) * N + n, m);
        for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(xv[r][j], wv, a[r]);
      }
      for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(acc + r * N + n, m, a[r]);
    }
  }
  for (; k < kn; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * xs + k];
      for (int64_t n = 0; n < N; ++n) acc[r * N + n] += xv * widen(w[k * N + n]);
    }
}

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename W, int R>
__attribute__((target("avx2,fma")))
void cols_avx2(const float* x, int64_t xs, int64_t kn, const W* w, int64_t N, float* acc) {
  const int64_t N8 = N / 8 * 8;
  int64_t k = 0;
  for (; k + 4 <= kn; k += 4) {
    __m256 xv[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) xv[r][j] = _mm256_set1_ps(x[r * xs + k + j]);
    for (int64_t n = 0; n < N8; n += 8) {
      __m256 a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm256_loadu_ps(acc + r * N + n);
      for (int j = 0; j < 4; ++j) {
        const __m256 wv = load8(w + (k + j) * N + n);
        for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(xv[r][j], wv, a[r]);
      }
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * N + n, a[r]);
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j)
        for (int64_t n = N8; n < N; ++n) acc[r * N + n] += x[r * xs + k + j] * widen(w[(k + j) * N + n]);
  }
  for (; k < kn; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * xs + k];
      for (int64_t n = 0; n < N; ++n) acc[r * N + n] += xv * widen(w[k * N + n]);
    }
}
#endif

template <typename W>
using Cols = void (*)(const float*, int64_t, int64_t, const W*, int64_t, float*);

template <typename W>
struct ColsTable {
  Cols<W> by_rows[kRowsMax] = {nullptr, nullptr, nullptr, nullptr};
};

template <typename W>
ColsTable<W> pick_cols() {
  ColsTable<W> t;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (isa_cap() >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    t.by_rows[0] = cols_avx512<W, 1>;
    t.by_rows[1] = cols_avx512<W, 2>;
    t.by_rows[2] = cols_avx512<W, 3>;
    t.by_rows[3] = cols_avx512<W, 4>;
  } else if (isa_cap() >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    t.by_rows[0] = cols_avx2<W, 1>;
    t.by_rows[1] = cols_avx2<W, 2>;
    t.by_rows[2] = cols_avx2<W, 3>;
    t.by_rows[3] = cols_avx2<W, 4>;
  }
#endif
  return t;
}

template <typename W>
const ColsTable<W>& cols_table() {
  static const ColsTable<W> t = pick_cols<W>();
  return t;
}

template <typename W, typename T>
void rows_run(const float* xp, int R, int64_t K, const W* wp, int64_t N, T* yp) {
  // w's rows in fixed blocks of kBlock; each thread streams a run of whole blocks (one
  // linear pass through memory) into each block's own partial sums, which are then added
  // in block order: the same result for any number of threads.
  constexpr int64_t kBlock = 256;
  const int64_t blocks = std::max<int64_t>(1, (K + kBlock - 1) / kBlock);
  std::vector<float> part(static_cast<size_t>(blocks * R * N), 0.f);
  const Cols<W> f = cols_table<W>().by_rows[R - 1];
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t k0 = b * kBlock, k1 = std::min<int64_t>(K, k0 + kBlock);
      float* acc = part.data() + b * R * N;
      // (x's rows k0..k1 of each of the R rows: x + k0 with row stride K)
      if (f != nullptr)
        f(xp + k0, K, k1 - k0, wp + k0 * N, N, acc);
      else
        cols_scalar<W>(xp + k0, R, K, k1 - k0, wp + k0 * N, N, acc);
    }
  });
  for (int r = 0; r < R; ++r)
    for (int64_t n = 0; n < N; ++n) {
      float v = 0.f;
      for (int64_t b = 0; b < blocks; ++b) v += part[(b * R + r) * N + n];
      yp[r * N + n] = static_cast<T>(v);
    }
}

at::Tensor rows_matmul(const at::Tensor& x_in, const at::Tensor& w_in) {
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu() && (dt == at::kFloat || dt == at::kBFloat16),
              "rows_matmul: x must be a float32/bfloat16 CPU tensor (R, K)");
  TORCH_CHECK(w_in.dim() == 2 && w_in.device().is_cpu() && w_in.scalar_type() == dt,
              "rows_matmul: w must be a CPU tensor (K, N) of x's dtype");
  const int64_t R = x_in.size(0), K = x_in.size(1), N = w_in.size(1);
  TORCH_CHECK(w_in.size(0) == K, "rows_matmul: x has ", K, " features but w is (", w_in.size(0), ", ", N, ")");
  TORCH_CHECK(R >= 1 && R <= kRowsMax, "rows_matmul: 1 to ", kRowsMax, " rows of x, got ", R);
  const at::Tensor w = w_in.contiguous();
  at::Tensor y = at::empty({R, N}, x_in.options());
  if (dt == at::kFloat) {
    const at::Tensor x = x_in.contiguous();
    rows_run<float, float>(x.const_data_ptr<float>(), static_cast<int>(R), K, w.const_data_ptr<float>(), N,
                           y.mutable_data_ptr<float>());
  } else {
    std::vector<float> xf(static_cast<size_t>(R * K));
    const at::Tensor x = x_in.contiguous();
    const c10::BFloat16* xb = x.const_data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < R * K; ++i) xf[i] = static_cast<float>(xb[i]);
    rows_run<c10::BFloat16, c10::BFloat16>(xf.data(), static_cast<int>(R), K, w.const_data_ptr<c10::BFloat16>(),
                                           N, y.mutable_data_ptr<c10::BFloat16>());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(fsharded_cpu, m) {
  m.set_python_module("fsharded.kernels.weight_int8");  // (its fake and vmap rules are there)
  m.def("int8_matmul(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("rows_matmul(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(fsharded_cpu, CPU, m) {
  m.impl("int8_matmul", &int8_matmul);
  m.impl("rows_matmul", &rows_matmul);
}
