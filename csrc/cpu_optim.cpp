// Python binding of the CPU optimizer: AdamW / Adam (L2), Lion and Adagrad steps on lists
// of fp32 master weights, multi-threaded with OpenMP, with fused loss-scale unscaling, an
// optional non-finite check that leaves everything untouched when it fires, and an optional
// bf16/fp16 copy of the updated weights written in the same pass.
//
// Work is cut into chunks of the concatenated tensors (crossing tensor boundaries), so a
// thousand small tensors and one large one balance alike, and threads take chunks as they
// go. With check_finite, all gradients are checked first (every chunk, before any thread
// writes anything), which reads them twice; without it the step is a single pass.
//
// The kernels are picked at run time from the CPU's flags (AVX-512, AVX2 or portable), so
// one cached build runs on any x86-64 machine. Only this file includes torch headers.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpu_optim.h"

namespace {

using namespace fsharded_cpu_optim;
using TensorList = std::vector<at::Tensor>;

bool cpu_supports(const char* isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (std::string(isa) == "avx2") return avx2;
  if (std::string(isa) == "avx512") return avx2 && __builtin_cpu_supports("avx512f");
#endif
  return std::string(isa) == "scalar";
}

const Kernels* kernels_for(const std::string& isa) {
  if (isa == "avx512") return cpu_supports("avx512") ? kernels_avx512() : nullptr;
  if (isa == "avx2") return cpu_supports("avx2") ? kernels_avx2() : nullptr;
  if (isa == "scalar") return kernels_scalar();
  return nullptr;
}

const Kernels& select_kernels(const std::string& isa) {
  if (isa.empty() || isa == "auto") {
    for (const char* name : {"avx512", "avx2"}) {
      if (const Kernels* k = kernels_for(name)) return *k;
    }
    return *kernels_scalar();
  }
  if (isa != "avx512" && isa != "avx2" && isa != "scalar") {
    throw pybind11::value_error("isa=" + isa + ": expected auto, avx512, avx2 or scalar");
  }
  const Kernels* k = kernels_for(isa);
  if (k == nullptr) throw pybind11::value_error("isa=" + isa + ": this CPU does not support it");
  return *k;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const char* name : {"avx512", "avx2", "scalar"}) {
    if (kernels_for(name) != nullptr) out.emplace_back(name);
  }
  return out;
}

// -- validation -----------------------------------------------------------------------------

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  if (!t.defined()) return "an undefined tensor";
  os << "dtype=" << t.scalar_type() << ", device=" << t.device() << ", shape=" << t.sizes()
     << (t.is_contiguous() ? "" : ", not contiguous");
  return os.str();
}

[[noreturn]] void bad(bool type_error, const std::string& msg) {
  if (type_error) throw pybind11::type_error(msg);
  throw pybind11::value_error(msg);
}

int dtype_code(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: return -1;
  }
}

// Checks one list against params and returns its data pointers.
// kind: 0 = fp32 state, 1 = gradient (fp32/bf16/fp16), 2 = half copy (bf16/fp16).
std::vector<const at::Tensor*> check_list(const char* who, const char* name, const TensorList& xs,
                                          const TensorList& params, int kind) {
  if (xs.size() != params.size()) {
    bad(false, std::string(who) + ": " + name + " has " + std::to_string(xs.size()) +
                   " tensors but params has " + std::to_string(params.size()));
  }
  static const char* want[] = {"a float32", "a float32, bfloat16 or float16", "a bfloat16 or float16"};
  std::vector<const at::Tensor*> out;
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& t = xs[i];
    const std::string where = std::string(who) + ": " + name + "[" + std::to_string(i) + "]";
    const std::string need = std::string(want[kind]) + " contiguous CPU tensor";
    if (!t.defined() || t.device().type() != at::kCPU || !t.is_contiguous()) {
      bad(false, where + " must be " + need + ", got " + describe(t) +
                     " (move it to the CPU / call .contiguous())");
    }
    int code = dtype_code(t.scalar_type());
    bool ok = kind == 0 ? code == kF32 : kind == 1 ? code >= 0 : (code == kBF16 || code == kF16);
    if (!ok) bad(true, where + " must be " + need + ", got " + describe(t));
    if (t.numel() != params[i].numel()) {
      bad(false, where + " has " + std::to_string(t.numel()) + " elements but params[" +
                     std::to_string(i) + "] has " + std::to_string(params[i].numel()));
    }
    out.push_back(&t);
  }
  return out;
}

std::vector<Segment> make_segments(const char* who, const TensorList& params,
                                   const TensorList& grads, const char* s1_name,
                                   const TensorList& s1, const char* s2_name,
                                   const TensorList* s2, const TensorList& half) {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& t = params[i];
    const std::string where = std::string(who) + ": params[" + std::to_string(i) + "]";
    if (!t.defined() || t.device().type() != at::kCPU || !t.is_contiguous()) {
      bad(false, where + " must be a float32 contiguous CPU tensor, got " + describe(t));
    }
    if (t.scalar_type() != at::kFloat) {
      bad(true, where + " must be a float32 contiguous CPU tensor (the fp32 master weights), got " +
                    describe(t));
    }
  }
  check_list(who, "grads", grads, params, 1);
  check_list(who, s1_name, s1, params, 0);
  if (s2 != nullptr) check_list(who, s2_name, *s2, params, 0);
  if (!half.empty()) check_list(who, "half_params", half, params, 2);
  std::vector<Segment> segs;
  segs.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    Segment s{};
    s.p = params[i].data_ptr<float>();
    s.g = grads[i].data_ptr();
    s.gtype = dtype_code(grads[i].scalar_type());
    s.s1 = s1[i].data_ptr<float>();
    s.s2 = s2 != nullptr ? (*s2)[i].data_ptr<float>() : nullptr;
    s.half = half.empty() ? nullptr : half[i].data_ptr();
    s.htype = half.empty() ? kNoHalf : dtype_code(half[i].scalar_type());
    s.n = params[i].numel();
    segs.push_back(s);
  }
  return segs;
}

// -- threading ------------------------------------------------------------------------------

// Below this many elements per thread, starting threads costs more than it saves.
constexpr int64_t kMinPerThread = int64_t(1) << 15;
// Half copies larger than this (elements) go around the caches: nobody reads them soon.
constexpr int64_t kStreamAbove = int64_t(1) << 20;

// The concatenation of all segments, cut into chunks that threads take in turn from a
// shared counter: a thread slowed by a busy core just takes fewer chunks, where a static
// split would make every other thread wait for it at the end. (On an idle machine one
// contiguous range per thread measured no faster: a chunk is >= 64 KiB per array, so the
// hardware prefetchers restart rarely.)
struct Chunks {
  const std::vector<Segment>& segs;
  std::vector<int64_t> offs;  // offs[i] = first global element of segs[i]
  int64_t total = 0, size = 0, count = 0;

  Chunks(const std::vector<Segment>& s, int threads) : segs(s), offs(s.size() + 1, 0) {
    for (size_t i = 0; i < s.size(); ++i) offs[i + 1] = offs[i] + s[i].n;
    total = offs.back();
    // ~8 chunks per thread, 16 Ki..256 Ki elements, a multiple of 64 (one cache line of
    // fp32 per 16, and a whole number of vectors of any width).
    const int64_t want = total / (int64_t(threads) * 8);
    size = std::min<int64_t>(int64_t(1) << 18, std::max<int64_t>(int64_t(1) << 14, want)) / 64 * 64;
    count = (total + size - 1) / size;
  }

  // fn(segment, begin, end) for the pieces of chunk c.
  template <class Fn>
  void each(int64_t c, Fn&& fn) const {
    const int64_t b = c * size, e = std::min(total, b + size);
    size_t i = size_t(std::upper_bound(offs.begin(), offs.end(), b) - offs.begin()) - 1;
    for (; i < segs.size() && offs[i] < e; ++i) {
      const int64_t lb = std::max(b, offs[i]) - offs[i], le = std::min(e, offs[i + 1]) - offs[i];
      if (le > lb) fn(segs[i], lb, le);
    }
  }
};

// With `check`: checks every gradient, then (only when all are finite) runs update on every
// element; returns found_inf. Without: runs update on every element at once and returns
// false (an inf/nan gradient then reaches the weights, as in torch.optim).
template <class Update>
bool run(const std::vector<Segment>& segs, const Kernels& k, float inv_scale, bool check,
         int64_t threads, Update&& update) {
  int64_t total = 0;
  for (const Segment& s : segs) total += s.n;
  if (total == 0) return false;
  const bool stream = total >= kStreamAbove;
  const int64_t most = std::max<int64_t>(1, (total + kMinPerThread - 1) / kMinPerThread);
  const int nt = int(std::max<int64_t>(1, std::min(threads, most)));
  const Chunks chunks(segs, nt);
  std::atomic<bool> found{false};
  std::atomic<int64_t> next_check{0}, checked{0}, next_update{0};
  auto body = [&] {
    if (check) {
      for (int64_t c = next_check++; c < chunks.count; c = next_check++) {
        if (found.load(std::memory_order_relaxed)) break;
        chunks.each(c, [&](const Segment& s, int64_t b, int64_t e) {
          if (k.nonfinite(s, b, e, inv_scale)) found.store(true, std::memory_order_relaxed);
        });
        checked.fetch_add(1, std::memory_order_release);
      }
      // Wait for the chunks other threads are checking, not for the threads themselves: a
      // thread the OS has not run yet holds no chunk, and nobody waits for it here.
      for (int spins = 0; checked.load(std::memory_order_acquire) < chunks.count &&
                          !found.load(std::memory_order_relaxed);
           ++spins) {
        if (spins > 64) std::this_thread::yield();
      }
      if (found.load(std::memory_order_relaxed)) return;
    }
    // After a check, last checked first updated: the gradients it read last are still cached.
    for (int64_t i = next_update++; i < chunks.count; i = next_update++) {
      chunks.each(check ? chunks.count - 1 - i : i,
                  [&](const Segment& s, int64_t b, int64_t e) { update(s, b, e, stream); });
    }
  };
  if (nt == 1) {
    body();
  } else {
#pragma omp parallel num_threads(nt)
    body();
  }
  return found.load();
}

// -- the optimizers ---------------------------------------------------------------------------

void check_threads(const char* who, int64_t threads) {
  if (threads < 1) bad(false, std::string(who) + ": num_threads must be >= 1, got " + std::to_string(threads));
}

bool adam(const TensorList& params, const TensorList& grads, const TensorList& exp_avg,
          const TensorList& exp_avg_sq, const TensorList& half, double lr, double beta1,
          double beta2, double eps, double weight_decay, int64_t step, bool decoupled,
          double inv_scale, bool check_finite, int64_t threads, const std::string& isa) {
  const char* who = "adamw_";
  check_threads(who, threads);
  if (step < 1) bad(false, std::string(who) + ": step must be >= 1 (the 1-based step being taken), got " + std::to_string(step));
  const Kernels& k = select_kernels(isa);
  auto segs = make_segments(who, params, grads, "exp_avg", exp_avg, "exp_avg_sq", &exp_avg_sq, half);
  const AdamConsts c =
      make_adam_consts(lr, beta1, beta2, eps, weight_decay, step, decoupled, inv_scale);
  return run(segs, k, c.inv_scale, check_finite, threads, [&](const Segment& s, int64_t b, int64_t e, bool st) {
    k.adam(s, b, e, c, st);
  });
}

bool lion(const TensorList& params, const TensorList& grads, const TensorList& exp_avg,
          const TensorList& half, double lr, double beta1, double beta2, double weight_decay,
          double inv_scale, bool check_finite, int64_t threads, const std::string& isa) {
  const char* who = "lion_";
  check_threads(who, threads);
  const Kernels& k = select_kernels(isa);
  auto segs = make_segments(who, params, grads, "exp_avg", exp_avg, "", nullptr, half);
  LionConsts c{};
  c.inv_scale = float(inv_scale);
  c.decay = float(1.0 - lr * weight_decay);
  c.neg_lr = float(-lr);
  c.beta1 = float(beta1);
  c.one_m_beta1 = float(1.0 - beta1);
  c.beta2 = float(beta2);
  c.one_m_beta2 = float(1.0 - beta2);
  return run(segs, k, c.inv_scale, check_finite, threads, [&](const Segment& s, int64_t b, int64_t e, bool st) {
    k.lion(s, b, e, c, st);
  });
}

bool adagrad(const TensorList& params, const TensorList& grads, const TensorList& state_sum,
             const TensorList& half, double lr, double eps, double weight_decay, double lr_decay,
             int64_t step, double inv_scale, bool check_finite, int64_t threads,
             const std::string& isa) {
  const char* who = "adagrad_";
  check_threads(who, threads);
  if (step < 1) bad(false, std::string(who) + ": step must be >= 1 (the 1-based step being taken), got " + std::to_string(step));
  const Kernels& k = select_kernels(isa);
  auto segs = make_segments(who, params, grads, "state_sum", state_sum, "", nullptr, half);
  AdagradConsts c{};
  c.inv_scale = float(inv_scale);
  c.l2 = float(weight_decay);
  c.neg_clr = float(-(lr / (1.0 + double(step - 1) * lr_decay)));
  c.eps = float(eps);
  return run(segs, k, c.inv_scale, check_finite, threads, [&](const Segment& s, int64_t b, int64_t e, bool st) {
    k.adagrad(s, b, e, c, st);
  });
}

std::string auto_isa() { return select_kernels("auto").name; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "fsharded's CPU optimizer steps (see fsharded/kernels/cpu_optim.py)";
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("adam", &adam, nogil, py::arg("params"), py::arg("grads"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("half_params"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("decoupled"), py::arg("inv_scale"), py::arg("check_finite"), py::arg("num_threads"), py::arg("isa"));
  m.def("lion", &lion, nogil, py::arg("params"), py::arg("grads"), py::arg("exp_avg"),
        py::arg("half_params"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("weight_decay"), py::arg("inv_scale"), py::arg("check_finite"), py::arg("num_threads"), py::arg("isa"));
  m.def("adagrad", &adagrad, nogil, py::arg("params"), py::arg("grads"), py::arg("state_sum"),
        py::arg("half_params"), py::arg("lr"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("lr_decay"), py::arg("step"), py::arg("inv_scale"), py::arg("check_finite"), py::arg("num_threads"),
        py::arg("isa"));
  m.def("auto_isa", &auto_isa, "the instruction set the kernels use on this CPU");
  m.def("supported_isas", &supported_isas, "instruction sets usable on this CPU, best first");
}
