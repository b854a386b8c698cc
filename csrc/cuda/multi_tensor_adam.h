// Multi-tensor fused Adam/AdamW for CUDA: the launcher's C++ interface (no torch headers,
// so the .cu compiles quickly with plain nvcc; multi_tensor_adam.cpp binds it to torch).
#pragma once

#include <cstdint>

#include "../cpu_optim.h"  // AdamConsts, make_adam_consts, Dtype

namespace fsharded_cuda {

using fsharded_cpu_optim::AdamConsts;

// One parameter tensor on the GPU: fp32 master weights, gradient (dtype `gtype` of the
// call), fp32 moments and an optional half copy (dtype `htype`, null when kNoHalf).
struct AdamTensor {
  float* p;
  const void* g;
  float* m;
  float* v;
  void* half;
  int64_t n;
};

// Zeroes *found_inf (device int), sets it when some g * inv_scale is inf/nan (only when
// `check`: otherwise no check runs and non-finite values reach the weights), then runs the
// update, which every block skips when *found_inf is set: no host synchronisation, and
// nothing is modified on overflow. All launches go to `stream` (a cudaStream_t).
// Returns a cudaError_t (0 on success).
int multi_tensor_adam(const AdamTensor* tensors, int count, int gtype, int htype,
                      const AdamConsts& c, bool check, int* found_inf, void* stream);

const char* error_string(int code);

}  // namespace fsharded_cuda
