// Int8 weight-only products on the CPU for decoding (a few rows of activations):
// y[m, n] = sum_g scale[n, g] * sum_{k in group g} x[m, k] * q[n, k], accumulated in fp32.
// Each output channel's int8 row is read once for all the rows of x (it stays in L1
// while they pass), so the weights cross memory as int8: a quarter of fp32's bytes. The
// inner loop takes 4 output channels and up to 4 rows of x at once (each x load used 4
// times, each widened int8 vector up to 4 times), in AVX-512 or
// AVX2 intrinsics chosen at load time from the CPU's flags (a scalar loop otherwise).
// Output channels are split across torch's intra-op threads (at::parallel_for).
//
// A dispatcher op, fsharded_cpu::int8_matmul(x, q, scales), registered with
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

Tiles pick() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
    return {{tile_avx512<1>, tile_avx512<2>, tile_avx512<3>, tile_avx512<4>}};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
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

}  // namespace

TORCH_LIBRARY(fsharded_cpu, m) {
  m.set_python_module("fsharded.kernels.weight_int8");  // (its fake and vmap rules are there)
  m.def("int8_matmul(Tensor x, Tensor q, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(fsharded_cpu, CPU, m) {
  m.impl("int8_matmul", &int8_matmul);
}
