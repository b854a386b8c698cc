// The element-wise optimizer kernels, written once over a vector type `V` of `W` fp32
// lanes. Included (once) by each per-ISA translation unit after it has defined
// FS_ISA (0 scalar, 1 AVX2, 2 AVX-512) and FS_NS, and switched the compiler's target to
// that instruction set. No torch or standard-library code is compiled under that target:
// inline functions from shared headers would otherwise get an AVX-512 body that the
// linker may pick for the other translation units too.
//
// Arithmetic follows torch.optim's single-tensor CPU code element by element (lerp for
// the first moment, sqrt(v) / sqrt(bc2) + eps, addcdiv), so results agree with
// torch.optim.AdamW / Adam / Adagrad to a few ulp per step.

namespace FS_NS {

using namespace fsharded_cpu_optim;

#define FS_INLINE inline __attribute__((always_inline))

// -- scalar conversions (bit-exact with c10::BFloat16 / c10::Half) ----------------------

static FS_INLINE uint32_t bits_of(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, 4);
  return u;
}

static FS_INLINE float float_of(uint32_t u) {
  float x;
  __builtin_memcpy(&x, &u, 4);
  return x;
}

static FS_INLINE float bf16_to_f32(uint16_t h) { return float_of(uint32_t(h) << 16); }

// Round to nearest even; nan -> 0x7fc0 (what torch produces).
static FS_INLINE uint16_t f32_to_bf16(float x) {
  if (x != x) return 0x7fc0;
  uint32_t u = bits_of(x);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static FS_INLINE float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in fp32
    return float_of(sign | bits_of(float(mant) * 5.9604644775390625e-8f));
  }
  if (exp == 31) return float_of(sign | 0x7f800000u | (mant << 13));
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Round to nearest even with subnormals and overflow to inf; nan -> quiet nan.
static FS_INLINE uint16_t f32_to_f16(float x) {
  uint32_t u = bits_of(x);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) return sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  uint32_t q, rem, half;
  if (u < 0x38800000u) {  // below 2^-14: a subnormal half (or zero)
    int shift = 126 - int(u >> 23);  // value / 2^-24 = mant * 2^-shift
    if (shift >= 25) return sign;
    uint32_t mant = (u & 0x7fffffu) | 0x800000u;
    q = mant >> shift;
    rem = mant & ((1u << shift) - 1u);
    half = 1u << (shift - 1);
  } else {
    q = (((u >> 23) - 112u) << 10) | ((u & 0x7fffffu) >> 13);
    rem = u & 0x1fffu;
    half = 0x1000u;
  }
  if (rem > half || (rem == half && (q & 1u))) ++q;  // a carry into the exponent is right
  return uint16_t(sign | q);
}

// -- per-element access, scalar ---------------------------------------------------------

template <int G>
static FS_INLINE float load_grad1(const void* g, int64_t i) {
  if constexpr (G == kF32) return static_cast<const float*>(g)[i];
  else if constexpr (G == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  else return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
}

template <int H>
static FS_INLINE void store_half1(void* h, int64_t i, float x) {
  if constexpr (H == kBF16) static_cast<uint16_t*>(h)[i] = f32_to_bf16(x);
  else if constexpr (H == kF16) static_cast<uint16_t*>(h)[i] = f32_to_f16(x);
}

static FS_INLINE float bcast(float x, float) { return x; }
static FS_INLINE float vsqrt(float x) { return __builtin_sqrtf(x); }
// Fused where the vector code is fused, so head, body and tail round alike and the result
// does not depend on how the elements were split among threads.
static FS_INLINE float vfmadd(float a, float b, float c) {
#if FS_ISA >= 1
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
static FS_INLINE float vsign(float x) { return float((x > 0.0f) - (x < 0.0f)); }

// -- vectors ------------------------------------------------------------------------------

#if FS_ISA == 2
using V = __m512;
constexpr int W = 16;
static FS_INLINE V bcast(float x, V) { return _mm512_set1_ps(x); }
static FS_INLINE V vload(const float* p) { return _mm512_loadu_ps(p); }
static FS_INLINE void vstore(float* p, V x) { _mm512_storeu_ps(p, x); }
static FS_INLINE V vsqrt(V x) { return _mm512_sqrt_ps(x); }
static FS_INLINE V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static FS_INLINE V vsign(V x) {
  V z = _mm512_setzero_ps();
  V r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, z, _CMP_GT_OQ), z, _mm512_set1_ps(1.0f));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, z, _CMP_LT_OQ), r, _mm512_set1_ps(-1.0f));
}
static FS_INLINE bool vany_nan(V x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0; }

template <int G>
static FS_INLINE V load_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const uint16_t*>(g) + i));
    if constexpr (G == kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else return _mm512_cvtph_ps(h);
  }
}

template <int H, bool S>
static FS_INLINE void store_half(void* dst, int64_t i, V x) {
  __m256i h;
  if constexpr (H == kBF16) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    h = _mm512_cvtepi32_epi16(r);
  } else {
    h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  __m256i* p = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + i);
  if constexpr (S) _mm256_stream_si256(p, h);
  else _mm256_storeu_si256(p, h);
}
#define FS_SFENCE() _mm_sfence()

#elif FS_ISA == 1
using V = __m256;
constexpr int W = 8;
static FS_INLINE V bcast(float x, V) { return _mm256_set1_ps(x); }
static FS_INLINE V vload(const float* p) { return _mm256_loadu_ps(p); }
static FS_INLINE void vstore(float* p, V x) { _mm256_storeu_ps(p, x); }
static FS_INLINE V vsqrt(V x) { return _mm256_sqrt_ps(x); }
static FS_INLINE V vfmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static FS_INLINE V vsign(V x) {
  V z = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  return _mm256_and_ps(_mm256_cmp_ps(x, z, _CMP_GT_OQ), one) -
         _mm256_and_ps(_mm256_cmp_ps(x, z, _CMP_LT_OQ), one);
}
static FS_INLINE bool vany_nan(V x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0; }

template <int G>
static FS_INLINE V load_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint16_t*>(g) + i));
    if constexpr (G == kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }
}

template <int H, bool S>
static FS_INLINE void store_half(void* dst, int64_t i, V x) {
  __m128i h;
  if constexpr (H == kBF16) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  } else {
    h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  __m128i* p = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(dst) + i);
  if constexpr (S) _mm_stream_si128(p, h);
  else _mm_storeu_si128(p, h);
}
#define FS_SFENCE() _mm_sfence()

#else  // scalar: one lane, the compiler may still auto-vectorize for the baseline ISA
using V = float;
constexpr int W = 1;
static FS_INLINE V vload(const float* p) { return *p; }
static FS_INLINE void vstore(float* p, V x) { *p = x; }
static FS_INLINE bool vany_nan(V x) { return x != x; }
template <int G>
static FS_INLINE V load_grad(const void* g, int64_t i) { return load_grad1<G>(g, i); }
template <int H, bool S>
static FS_INLINE void store_half(void* dst, int64_t i, V x) { store_half1<H>(dst, i, x); }
#define FS_SFENCE() ((void)0)
#endif

// -- the update rules, for T = V (vector body) and T = float (head and tail) -------------

template <class T>
struct AdamK {
  T inv_scale, decay, l2, w, wm1, beta2, one_m_beta2, inv_bc2_sqrt, eps, neg_step;
  bool coupled, small_w;
  explicit AdamK(const AdamConsts& c)
      : inv_scale(bcast(c.inv_scale, T{})), decay(bcast(c.decay, T{})), l2(bcast(c.l2, T{})),
        w(bcast(c.lerp_w, T{})), wm1(bcast(c.lerp_w - 1.0f, T{})), beta2(bcast(c.beta2, T{})),
        one_m_beta2(bcast(c.one_m_beta2, T{})), inv_bc2_sqrt(bcast(c.inv_bc2_sqrt, T{})),
        eps(bcast(c.eps, T{})), neg_step(bcast(c.neg_step_size, T{})), coupled(c.l2 != 0.0f),
        small_w(c.lerp_w < 0.5f) {}

  FS_INLINE void operator()(T& p, T g, T& m, T& v) const {
    g = g * inv_scale;
    if (coupled) g = vfmadd(l2, p, g);  // Adam + L2: grad.add(param, alpha=wd)
    p = p * decay;                      // AdamW: param.mul_(1 - lr * wd)
    // exp_avg.lerp_(g, w), in torch's two-sided form
    m = small_w ? vfmadd(w, g - m, m) : vfmadd(wm1, g - m, g);
    v = vfmadd(one_m_beta2 * g, g, v * beta2);
    T denom = vfmadd(vsqrt(v), inv_bc2_sqrt, eps);
    p = p + (neg_step * m) / denom;
  }
};

template <class T>
struct LionK {
  T inv_scale, decay, neg_lr, beta1, one_m_beta1, beta2, one_m_beta2;
  explicit LionK(const LionConsts& c)
      : inv_scale(bcast(c.inv_scale, T{})), decay(bcast(c.decay, T{})),
        neg_lr(bcast(c.neg_lr, T{})), beta1(bcast(c.beta1, T{})),
        one_m_beta1(bcast(c.one_m_beta1, T{})), beta2(bcast(c.beta2, T{})),
        one_m_beta2(bcast(c.one_m_beta2, T{})) {}

  FS_INLINE void operator()(T& p, T g, T& m) const {
    g = g * inv_scale;
    T c = vfmadd(one_m_beta1, g, m * beta1);
    p = vfmadd(neg_lr, vsign(c), p * decay);
    m = vfmadd(one_m_beta2, g, m * beta2);
  }
};

template <class T>
struct AdagradK {
  T inv_scale, l2, neg_clr, eps;
  bool coupled;
  explicit AdagradK(const AdagradConsts& c)
      : inv_scale(bcast(c.inv_scale, T{})), l2(bcast(c.l2, T{})), neg_clr(bcast(c.neg_clr, T{})),
        eps(bcast(c.eps, T{})), coupled(c.l2 != 0.0f) {}

  FS_INLINE void operator()(T& p, T g, T& s) const {
    g = g * inv_scale;
    if (coupled) g = vfmadd(l2, p, g);
    s = vfmadd(g, g, s);
    p = p + (neg_clr * g) / (vsqrt(s) + eps);
  }
};

// -- loops -------------------------------------------------------------------------------
//
// Large steps are memory bound (AdamW moves 28 B per element; in cache the loop runs at
// ~1 cycle per element on Zen 4), so the loops are plain streams, one vector per iteration.
// Measured at 5e7 elements on an AMD EPYC (Zen 4) VM, against this loop: software prefetch
// (T0 or T1, 1-64 KiB ahead, or a block ahead stream by stream) 8-40% slower; streaming
// stores of p / m / v (lines just read) ~30% slower; 256-bit vectors as fast as 512-bit
// (Zen 4 splits 512-bit ops, and the memory is the limit either way). Streaming stores pay
// only for the half copy, whose lines are not otherwise read.

// Elements before `i` that make the half copy aligned for streaming stores (W halves).
static FS_INLINE int64_t peel_for(const void* half, int64_t i, int64_t e) {
  const uintptr_t bytes = uintptr_t(W) * 2;
  uintptr_t addr = reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(half) + i);
  int64_t n = int64_t(((bytes - addr % bytes) % bytes) / 2);
  return n < e - i ? n : e - i;
}

template <int G, int H, bool S>
static void adam_loop(const Segment& s, int64_t i, int64_t e, const AdamConsts& c) {
  const AdamK<V> kv(c);
  const AdamK<float> k1(c);
  float *p = s.p, *m = s.s1, *v = s.s2;
  // Locals, not reads through `s` in the loop (a float store could alias it for all the
  // compiler knows).
  const void* g = s.g;
  void* half = s.half;
  if constexpr (S) {  // scalar head up to the alignment of the half copy
    for (int64_t stop = i + peel_for(half, i, e); i < stop; ++i) {
      k1(p[i], load_grad1<G>(g, i), m[i], v[i]);
      store_half1<H>(half, i, p[i]);
    }
  }
  for (; i + W <= e; i += W) {
    V pv = vload(p + i), mv = vload(m + i), vv = vload(v + i);
    kv(pv, load_grad<G>(g, i), mv, vv);
    vstore(p + i, pv);
    vstore(m + i, mv);
    vstore(v + i, vv);
    if constexpr (H != kNoHalf) store_half<H, S>(half, i, pv);
  }
  for (; i < e; ++i) {
    k1(p[i], load_grad1<G>(g, i), m[i], v[i]);
    if constexpr (H != kNoHalf) store_half1<H>(half, i, p[i]);
  }
  if constexpr (S) FS_SFENCE();
}

template <int G, int H, bool S>
static void lion_loop(const Segment& s, int64_t i, int64_t e, const LionConsts& c) {
  const LionK<V> kv(c);
  const LionK<float> k1(c);
  float *p = s.p, *m = s.s1;
  const void* g = s.g;
  void* half = s.half;
  if constexpr (S) {
    for (int64_t stop = i + peel_for(half, i, e); i < stop; ++i) {
      k1(p[i], load_grad1<G>(g, i), m[i]);
      store_half1<H>(half, i, p[i]);
    }
  }
  for (; i + W <= e; i += W) {
    V pv = vload(p + i), mv = vload(m + i);
    kv(pv, load_grad<G>(g, i), mv);
    vstore(p + i, pv);
    vstore(m + i, mv);
    if constexpr (H != kNoHalf) store_half<H, S>(half, i, pv);
  }
  for (; i < e; ++i) {
    k1(p[i], load_grad1<G>(g, i), m[i]);
    if constexpr (H != kNoHalf) store_half1<H>(half, i, p[i]);
  }
  if constexpr (S) FS_SFENCE();
}

template <int G, int H, bool S>
static void adagrad_loop(const Segment& s, int64_t i, int64_t e, const AdagradConsts& c) {
  const AdagradK<V> kv(c);
  const AdagradK<float> k1(c);
  float *p = s.p, *sum = s.s1;
  const void* g = s.g;
  void* half = s.half;
  if constexpr (S) {
    for (int64_t stop = i + peel_for(half, i, e); i < stop; ++i) {
      k1(p[i], load_grad1<G>(g, i), sum[i]);
      store_half1<H>(half, i, p[i]);
    }
  }
  for (; i + W <= e; i += W) {
    V pv = vload(p + i), sv = vload(sum + i);
    kv(pv, load_grad<G>(g, i), sv);
    vstore(p + i, pv);
    vstore(sum + i, sv);
    if constexpr (H != kNoHalf) store_half<H, S>(half, i, pv);
  }
  for (; i < e; ++i) {
    k1(p[i], load_grad1<G>(g, i), sum[i]);
    if constexpr (H != kNoHalf) store_half1<H>(half, i, p[i]);
  }
  if constexpr (S) FS_SFENCE();
}

template <int G>
static bool nonfinite_loop(const Segment& s, int64_t i, int64_t e, float inv_scale) {
  // x - x is 0 for finite x and nan for inf/nan: summing those needs no compare per vector.
  // A single core reads one stream well below its bandwidth (its misses in flight are
  // limited), so the range is read as 4 interleaved streams.
  constexpr int K = 4;
  const V sc = bcast(inv_scale, V{});
  V acc[K];
  for (int k = 0; k < K; ++k) acc[k] = bcast(0.0f, V{});
  const int64_t len = (e - i) / (K * W) * W;  // elements per stream, a multiple of W
  for (int64_t j = 0; j < len; j += W) {
    for (int k = 0; k < K; ++k) {
      V x = load_grad<G>(s.g, i + k * len + j) * sc;
      acc[k] = acc[k] + (x - x);
    }
  }
  float t = 0.0f;
  for (i += K * len; i < e; ++i) {
    float x = load_grad1<G>(s.g, i) * inv_scale;
    t += x - x;
  }
  V a = acc[0];
  for (int k = 1; k < K; ++k) a = a + acc[k];
  return vany_nan(a) || t != t;
}

// -- dispatch over element types ----------------------------------------------------------

template <template <int, int, bool> class Fn, class C>
static void dispatch(const Segment& s, int64_t b, int64_t e, const C& c, bool stream) {
  // Streaming stores only pay when a half copy is written and the range is long enough.
  const bool S = stream && s.htype != kNoHalf && e - b >= 4 * W;
#define FS_CASE_H(G, H)                           \
  if (s.htype == H) {                             \
    if (S) Fn<G, H, true>::run(s, b, e, c);       \
    else Fn<G, H, false>::run(s, b, e, c);        \
    return;                                       \
  }
#define FS_CASE_G(G)                              \
  if (s.gtype == G) {                             \
    FS_CASE_H(G, kBF16)                           \
    FS_CASE_H(G, kF16)                            \
    Fn<G, kNoHalf, false>::run(s, b, e, c);       \
    return;                                       \
  }
  FS_CASE_G(kF32)
  FS_CASE_G(kBF16)
  FS_CASE_G(kF16)
#undef FS_CASE_G
#undef FS_CASE_H
}

template <int G, int H, bool S>
struct AdamFn {
  static void run(const Segment& s, int64_t b, int64_t e, const AdamConsts& c) {
    adam_loop<G, H, S>(s, b, e, c);
  }
};
template <int G, int H, bool S>
struct LionFn {
  static void run(const Segment& s, int64_t b, int64_t e, const LionConsts& c) {
    lion_loop<G, H, S>(s, b, e, c);
  }
};
template <int G, int H, bool S>
struct AdagradFn {
  static void run(const Segment& s, int64_t b, int64_t e, const AdagradConsts& c) {
    adagrad_loop<G, H, S>(s, b, e, c);
  }
};

static bool nonfinite(const Segment& s, int64_t b, int64_t e, float inv_scale) {
  if (s.gtype == kF32) return nonfinite_loop<kF32>(s, b, e, inv_scale);
  if (s.gtype == kBF16) return nonfinite_loop<kBF16>(s, b, e, inv_scale);
  return nonfinite_loop<kF16>(s, b, e, inv_scale);
}
static void adam(const Segment& s, int64_t b, int64_t e, const AdamConsts& c, bool stream) {
  dispatch<AdamFn>(s, b, e, c, stream);
}
static void lion(const Segment& s, int64_t b, int64_t e, const LionConsts& c, bool stream) {
  dispatch<LionFn>(s, b, e, c, stream);
}
static void adagrad(const Segment& s, int64_t b, int64_t e, const AdagradConsts& c,
                    bool stream) {
  dispatch<AdagradFn>(s, b, e, c, stream);
}

static const Kernels kTable = {FS_NAME, nonfinite, adam, lion, adagrad};

#undef FS_INLINE
#undef FS_SFENCE

}  // namespace FS_NS
