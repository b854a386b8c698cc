// Int8 weight-only products on the CPU for decoding (a few rows of activations):
// y[m, n] = sum_g scale[n, g] * sum_{k in group g} x[m, k] * q[n, k], accumulated in fp32.
// Each output channel's int8 row is read once for all the rows of x (it stays in L1
// while they pass), so the weights cross memory as int8: a quarter of fp32's bytes. The
// inner loop takes 4 output channels at once (each x load used 4 times), in AVX-512 or
// AVX2 intrinsics chosen at load time from the CPU's flags (a scalar loop otherwise).
// Output channels are split across threads. See fsharded/kernels/weight_int8.py.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace {

// Dot products of one row of x with 4 output channels' int8 rows over one group of gs
// elements; acc[c] += result. Three builds of the same function.
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

__attribute__((target("avx512f,avx512bw")))
void dot4_avx512(const float* x, const int8_t* q0, int64_t K, int64_t gs, float* acc) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= gs; k += 16) {
    const __m512 xv = _mm512_loadu_ps(x + k);
    a0 = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q0 + k)))), a0);
    a1 = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q0 + K + k)))), a1);
    a2 = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q0 + 2 * K + k)))), a2);
    a3 = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q0 + 3 * K + k)))), a3);
  }
  float r[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1), _mm512_reduce_add_ps(a2), _mm512_reduce_add_ps(a3)};
  for (; k < gs; ++k)
    for (int c = 0; c < 4; ++c) r[c] += x[k] * static_cast<float>(q0[c * K + k]);
  for (int c = 0; c < 4; ++c) acc[c] = r[c];
}

__attribute__((target("avx2,fma")))
void dot4_avx2(const float* x, const int8_t* q0, int64_t K, int64_t gs, float* acc) {
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 8 <= gs; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (int c = 0; c < 4; ++c) {
      const __m128i b = _mm_loadl_epi64((const __m128i*)(q0 + c * K + k));
      a[c] = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), a[c]);
    }
  }
  for (int c = 0; c < 4; ++c) {
    __m128 lo = _mm256_castps256_ps128(a[c]), hi = _mm256_extractf128_ps(a[c], 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    float r = _mm_cvtss_f32(lo);
    for (int64_t j = k; j < gs; ++j) r += x[j] * static_cast<float>(q0[c * K + j]);
    acc[c] = r;
  }
}
#endif

void dot4_scalar(const float* x, const int8_t* q0, int64_t K, int64_t gs, float* acc) {
  for (int c = 0; c < 4; ++c) {
    float r = 0.f;
    for (int64_t k = 0; k < gs; ++k) r += x[k] * static_cast<float>(q0[c * K + k]);
    acc[c] = r;
  }
}

using Dot4 = void (*)(const float*, const int8_t*, int64_t, int64_t, float*);

Dot4 pick() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return dot4_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return dot4_avx2;
#endif
  return dot4_scalar;
}

const Dot4 kDot4 = pick();

// Output channels n0..n1 (a multiple of 4 apart, but for the last) for every row of x.
void channels(const float* x, int64_t M, int64_t K, const int8_t* q, const float* s, int64_t groups, float* y,
              int64_t N, int64_t n0, int64_t n1) {
  const int64_t gs = K / groups;
  float part[4];
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t c4 = std::min<int64_t>(4, n1 - n);
    for (int64_t m = 0; m < M; ++m) {
      float total[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t g = 0; g < groups; ++g) {
        if (c4 == 4) {
          kDot4(x + m * K + g * gs, q + n * K + g * gs, K, gs, part);
        } else {  // the last channels: one at a time
          for (int64_t c = 0; c < c4; ++c) {
            float r = 0.f;
            const int8_t* qc = q + (n + c) * K + g * gs;
            const float* xg = x + m * K + g * gs;
            for (int64_t k = 0; k < gs; ++k) r += xg[k] * static_cast<float>(qc[k]);
            part[c] = r;
          }
        }
        for (int64_t c = 0; c < c4; ++c) total[c] += part[c] * s[(n + c) * groups + g];
      }
      for (int64_t c = 0; c < c4; ++c) y[m * N + n + c] = total[c];
    }
  }
}

torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t threads) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "int8_matmul: x must be a contiguous fp32 CPU tensor (M, K)");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.device().is_cpu(),
              "int8_matmul: q must be a contiguous int8 CPU tensor (N, K)");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == torch::kFloat32 && scales.is_contiguous(),
              "int8_matmul: scales must be a contiguous fp32 tensor (N, groups)");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), groups = scales.size(1);
  TORCH_CHECK(q.size(1) == K && scales.size(0) == N && groups >= 1 && K % groups == 0,
              "int8_matmul: shapes do not fit: x (", M, ", ", K, "), q (", N, ", ", q.size(1), "), scales (",
              scales.size(0), ", ", groups, ")");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, (N + 3) / 4)));
  const int64_t per = ((N + nt - 1) / nt + 3) / 4 * 4;  // whole blocks of 4 channels per thread
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int t = 0; t < nt; ++t) {
    const int64_t n0 = t * per, n1 = std::min<int64_t>(N, n0 + per);
    if (n0 < n1) channels(xp, M, K, qp, sp, groups, yp, N, n0, n1);
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "fsharded's int8 weight-only CPU product for decoding (see fsharded/kernels/weight_int8.py)";
  m.def("int8_matmul", &int8_matmul, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("q"),
        py::arg("scales"), py::arg("threads"));
}
