// Shared declarations of the CPU optimizer kernels (no torch headers).
//
// The element-wise kernels are compiled three times, once per instruction set
// (cpu_optim_avx512.cpp, cpu_optim_avx2.cpp, cpu_optim_scalar.cpp); cpu_optim.cpp picks
// one table at run time from the CPU's flags, splits the work over OpenMP threads and
// binds it to Python. Each kernel updates elements [begin, end) of one segment (one
// parameter tensor with its gradient, optimizer states and optional half-precision copy).
#pragma once

#include <cmath>
#include <cstdint>

namespace fsharded_cpu_optim {

// Element types of gradients and of the optional half-precision parameter copy.
enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNoHalf = 3 };

// One parameter tensor: fp32 master weights `p`, gradient `g` (fp32/bf16/fp16), one or
// two fp32 states and an optional bf16/fp16 copy of the updated weights (`half`, may be
// null). All arrays are contiguous with `n` elements.
struct Segment {
  float* p;
  const void* g;
  float* s1;  // exp_avg (Adam, Lion) or state_sum (Adagrad)
  float* s2;  // exp_avg_sq (Adam); null otherwise
  void* half;
  int64_t n;
  int gtype;  // Dtype of g
  int htype;  // Dtype of half, kNoHalf when absent
};

// Per-call constants, already rounded to fp32 the way torch.optim rounds its Python-float
// scalars (bias corrections are computed in double by the caller).
struct AdamConsts {
  float inv_scale;
  float decay;        // 1 - lr * weight_decay (decoupled) or 1
  float l2;           // weight_decay (coupled, Adam + L2) or 0
  float lerp_w;       // 1 - beta1
  float beta2;
  float one_m_beta2;  // 1 - beta2
  float inv_bc2_sqrt; // 1 / sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
};

// torch.optim.Adam(W)'s per-step scalars: bias corrections in double for the 1-based
// `step`, then rounded to fp32 as torch rounds Python-float arguments of its ops.
inline AdamConsts make_adam_consts(double lr, double beta1, double beta2, double eps,
                                   double weight_decay, int64_t step, bool decoupled,
                                   double inv_scale) {
  AdamConsts c{};
  c.inv_scale = float(inv_scale);
  c.decay = decoupled ? float(1.0 - lr * weight_decay) : 1.0f;
  c.l2 = decoupled ? 0.0f : float(weight_decay);
  c.lerp_w = float(1.0 - beta1);
  c.beta2 = float(beta2);
  c.one_m_beta2 = float(1.0 - beta2);
  const double bc1 = 1.0 - std::pow(beta1, double(step));
  const double bc2 = 1.0 - std::pow(beta2, double(step));
  c.inv_bc2_sqrt = float(1.0 / std::sqrt(bc2));
  c.eps = float(eps);
  c.neg_step_size = float(-(lr / bc1));
  return c;
}

struct LionConsts {
  float inv_scale;
  float decay;  // 1 - lr * weight_decay
  float neg_lr;
  float beta1, one_m_beta1;
  float beta2, one_m_beta2;
};

struct AdagradConsts {
  float inv_scale;
  float l2;       // weight_decay
  float neg_clr;  // -lr / (1 + (step - 1) * lr_decay)
  float eps;
};

// `stream` asks for non-temporal stores of the half-precision copy (written, never read).
struct Kernels {
  const char* name;
  // True when some g[i] * inv_scale, i in [begin, end), is inf or nan.
  bool (*nonfinite)(const Segment& s, int64_t begin, int64_t end, float inv_scale);
  void (*adam)(const Segment& s, int64_t begin, int64_t end, const AdamConsts& c, bool stream);
  void (*lion)(const Segment& s, int64_t begin, int64_t end, const LionConsts& c, bool stream);
  void (*adagrad)(const Segment& s, int64_t begin, int64_t end, const AdagradConsts& c,
                  bool stream);
};

// Null when the build target cannot produce that instruction set (non-x86 hosts).
const Kernels* kernels_avx512();
const Kernels* kernels_avx2();
const Kernels* kernels_scalar();

}  // namespace fsharded_cpu_optim
