// Torch binding of the multi-tensor fused Adam CUDA kernel (multi_tensor_adam.cu):
// validates the tensor lists, then launches on the current CUDA stream. Built only where
// CUDA exists (fsharded.kernels.cpu_optim.load_cuda).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <string>
#include <vector>

#include "multi_tensor_adam.h"

namespace {

using TensorList = std::vector<at::Tensor>;
using namespace fsharded_cpu_optim;

int code_of(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: return -1;
  }
}

// Every tensor of `xs` on `device`, contiguous, params' numel, and of one dtype among `ok`.
int check(const char* name, const TensorList& xs, const TensorList& params,
          const at::Device& device, std::initializer_list<int> ok) {
  TORCH_CHECK_VALUE(xs.size() == params.size(), "adamw_cuda_: ", name, " has ", xs.size(),
                    " tensors but params has ", params.size());
  int code = -2;
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& t = xs[i];
    TORCH_CHECK_VALUE(t.device() == device && t.is_contiguous(), "adamw_cuda_: ", name, "[", i,
                      "] must be a contiguous tensor on ", device, ", got device=", t.device(),
                      ", contiguous=", t.is_contiguous());
    const int c = code_of(t.scalar_type());
    bool allowed = false;
    for (int o : ok) allowed = allowed || c == o;
    TORCH_CHECK_TYPE(allowed, "adamw_cuda_: ", name, "[", i, "] has unsupported dtype ",
                     t.scalar_type());
    TORCH_CHECK_TYPE(code == -2 || code == c, "adamw_cuda_: every tensor of ", name,
                     " must have the same dtype; ", name, "[", i, "] is ", t.scalar_type());
    code = c;
    TORCH_CHECK_VALUE(t.numel() == params[i].numel(), "adamw_cuda_: ", name, "[", i, "] has ",
                      t.numel(), " elements but params[", i, "] has ", params[i].numel());
  }
  return code;
}

at::Tensor adam(const TensorList& params, const TensorList& grads, const TensorList& exp_avg,
                const TensorList& exp_avg_sq, const TensorList& half, double lr, double beta1,
                double beta2, double eps, double weight_decay, int64_t step, bool decoupled,
                double inv_scale, bool check_finite) {
  TORCH_CHECK_VALUE(step >= 1, "adamw_cuda_: step must be >= 1, got ", step);
  if (params.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kBool));
  const at::Device device = params[0].device();
  TORCH_CHECK_VALUE(device.is_cuda(), "adamw_cuda_: params must be CUDA tensors, got ", device);
  check("params", params, params, device, {kF32});
  const int gtype = check("grads", grads, params, device, {kF32, kBF16, kF16});
  check("exp_avg", exp_avg, params, device, {kF32});
  check("exp_avg_sq", exp_avg_sq, params, device, {kF32});
  int htype = kNoHalf;
  if (!half.empty()) htype = check("half_params", half, params, device, {kBF16, kF16});

  std::vector<fsharded_cuda::AdamTensor> ts(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    ts[i] = {params[i].data_ptr<float>(), grads[i].data_ptr(), exp_avg[i].data_ptr<float>(),
             exp_avg_sq[i].data_ptr<float>(), half.empty() ? nullptr : half[i].data_ptr(),
             params[i].numel()};
  }
  const AdamConsts c =
      make_adam_consts(lr, beta1, beta2, eps, weight_decay, step, decoupled, inv_scale);
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor found = at::empty({}, params[0].options().dtype(at::kInt));
  const int err = fsharded_cuda::multi_tensor_adam(
      ts.data(), int(ts.size()), gtype, htype, c, check_finite, found.data_ptr<int>(),
      c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(err == 0, "adamw_cuda_: CUDA error: ", fsharded_cuda::error_string(err));
  return found.to(at::kBool);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fsharded's multi-tensor fused Adam for CUDA (see fsharded/kernels/cpu_optim.py)";
  m.def("adam", &adam, pybind11::call_guard<pybind11::gil_scoped_release>(),
        pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("exp_avg"),
        pybind11::arg("exp_avg_sq"), pybind11::arg("half_params"), pybind11::arg("lr"),
        pybind11::arg("beta1"), pybind11::arg("beta2"), pybind11::arg("eps"),
        pybind11::arg("weight_decay"), pybind11::arg("step"), pybind11::arg("decoupled"),
        pybind11::arg("inv_scale"), pybind11::arg("check_finite"));
}
