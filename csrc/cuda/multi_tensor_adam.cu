// Multi-tensor fused Adam/AdamW on CUDA, in the style of apex's multi_tensor_apply: the
// tensors of a step are cut into chunks of kChunk elements, and one launch covers up to
// kMaxBlocks chunks of up to kMaxTensors tensors, whose pointers travel in the kernel's
// argument block (4 KiB at most). Each block updates one chunk.
//
// Per element, in fp32: g *= inv_scale; [g += wd * p]; p *= 1 - lr * wd;
// m = lerp(m, g, 1 - b1); v = b2 v + (1 - b2) g^2; p += -step_size * m / (sqrt(v) * k + eps)
// with k = 1 / sqrt(1 - b2^t), and the updated p optionally written as bf16/fp16 too.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <vector>

#include "multi_tensor_adam.h"

namespace fsharded_cuda {
namespace {

using namespace fsharded_cpu_optim;

constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;
constexpr int kChunk = 65536;
constexpr int kThreads = 512;
constexpr int kILP = 4;

struct Batch {
  float* p[kMaxTensors];
  const void* g[kMaxTensors];
  float* m[kMaxTensors];
  float* v[kMaxTensors];
  void* half[kMaxTensors];
  int64_t n[kMaxTensors];
  unsigned char tensor[kMaxBlocks];  // block -> slot
  int chunk[kMaxBlocks];             // block -> chunk of that tensor
};
static_assert(sizeof(Batch) <= 4096, "kernel arguments are limited to 4 KiB");

template <int G>
__device__ __forceinline__ float load_g(const void* g, int64_t i) {
  if constexpr (G == kF32) return static_cast<const float*>(g)[i];
  else if constexpr (G == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(g)[i]);
  else return __half2float(static_cast<const __half*>(g)[i]);
}

template <int H>
__device__ __forceinline__ void store_h(void* h, int64_t i, float x) {
  if constexpr (H == kBF16) static_cast<__nv_bfloat16*>(h)[i] = __float2bfloat16_rn(x);
  else if constexpr (H == kF16) static_cast<__half*>(h)[i] = __float2half_rn(x);
}

struct Span {
  int slot;
  int64_t begin, end;
};

__device__ __forceinline__ Span block_span(const Batch& b) {
  const int slot = b.tensor[blockIdx.x];
  const int64_t begin = int64_t(b.chunk[blockIdx.x]) * kChunk;
  const int64_t end = begin + kChunk < b.n[slot] ? begin + kChunk : b.n[slot];
  return {slot, begin, end};
}

template <int G>
__global__ void __launch_bounds__(kThreads) nonfinite_kernel(Batch b, float inv_scale,
                                                             int* found_inf) {
  const Span s = block_span(b);
  const void* g = b.g[s.slot];
  int bad = 0;
  for (int64_t i = s.begin + threadIdx.x; i < s.end; i += blockDim.x) {
    bad |= !isfinite(load_g<G>(g, i) * inv_scale);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1;
}

template <int G, int H>
__global__ void __launch_bounds__(kThreads) adam_kernel(Batch b, AdamConsts c,
                                                        const int* found_inf) {
  if (*found_inf) return;
  const Span s = block_span(b);
  float* __restrict__ p = b.p[s.slot];
  float* __restrict__ m = b.m[s.slot];
  float* __restrict__ v = b.v[s.slot];
  const void* g = b.g[s.slot];
  void* h = b.half[s.slot];
  const bool coupled = c.l2 != 0.0f, small_w = c.lerp_w < 0.5f;
  for (int64_t base = s.begin; base < s.end; base += int64_t(blockDim.x) * kILP) {
    float rp[kILP], rg[kILP], rm[kILP], rv[kILP];
#pragma unroll
    for (int k = 0; k < kILP; ++k) {  // all loads first: kILP requests in flight per thread
      const int64_t i = base + threadIdx.x + int64_t(k) * blockDim.x;
      if (i < s.end) {
        rp[k] = p[i];
        rg[k] = load_g<G>(g, i);
        rm[k] = m[i];
        rv[k] = v[i];
      }
    }
#pragma unroll
    for (int k = 0; k < kILP; ++k) {
      const int64_t i = base + threadIdx.x + int64_t(k) * blockDim.x;
      if (i >= s.end) continue;
      float gi = rg[k] * c.inv_scale;
      if (coupled) gi = fmaf(c.l2, rp[k], gi);
      float pi = rp[k] * c.decay;
      float mi = small_w ? fmaf(c.lerp_w, gi - rm[k], rm[k])
                         : fmaf(c.lerp_w - 1.0f, gi - rm[k], gi);
      float vi = fmaf(c.one_m_beta2 * gi, gi, rv[k] * c.beta2);
      float denom = fmaf(sqrtf(vi), c.inv_bc2_sqrt, c.eps);
      pi = pi + (c.neg_step_size * mi) / denom;
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
      if constexpr (H != kNoHalf) store_h<H>(h, i, pi);
    }
  }
}

// Calls launch(batch, blocks) for consecutive groups of chunks of `ts` (non-empty tensors).
template <class Launch>
cudaError_t for_each_batch(const std::vector<AdamTensor>& ts, Launch&& launch) {
  Batch b{};
  int slots = 0, blocks = 0;
  for (size_t t = 0; t < ts.size(); ++t) {
    const AdamTensor& x = ts[t];
    b.p[slots] = x.p;
    b.g[slots] = x.g;
    b.m[slots] = x.m;
    b.v[slots] = x.v;
    b.half[slots] = x.half;
    b.n[slots] = x.n;
    ++slots;
    const int64_t chunks = (x.n + kChunk - 1) / kChunk;
    for (int64_t ch = 0; ch < chunks; ++ch) {
      b.tensor[blocks] = static_cast<unsigned char>(slots - 1);
      b.chunk[blocks] = static_cast<int>(ch);
      ++blocks;
      const bool last_chunk = ch == chunks - 1;
      if (blocks == kMaxBlocks || (slots == kMaxTensors && last_chunk) ||
          (t + 1 == ts.size() && last_chunk)) {
        launch(b, blocks);
        if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
        blocks = 0;
        if (last_chunk) {
          slots = 0;
        } else {  // the tensor continues in the next launch, from slot 0
          b.p[0] = b.p[slots - 1];
          b.g[0] = b.g[slots - 1];
          b.m[0] = b.m[slots - 1];
          b.v[0] = b.v[slots - 1];
          b.half[0] = b.half[slots - 1];
          b.n[0] = b.n[slots - 1];
          slots = 1;
        }
      }
    }
  }
  return cudaSuccess;
}

template <int G, int H>
cudaError_t run(const std::vector<AdamTensor>& ts, const AdamConsts& c, bool check,
                int* found_inf, cudaStream_t stream) {
  if (check) {
    cudaError_t e = for_each_batch(ts, [&](const Batch& b, int blocks) {
      nonfinite_kernel<G><<<blocks, kThreads, 0, stream>>>(b, c.inv_scale, found_inf);
    });
    if (e != cudaSuccess) return e;
  }
  return for_each_batch(ts, [&](const Batch& b, int blocks) {
    adam_kernel<G, H><<<blocks, kThreads, 0, stream>>>(b, c, found_inf);
  });
}

template <int G>
cudaError_t run_h(int htype, const std::vector<AdamTensor>& ts, const AdamConsts& c,
                  bool check, int* found_inf, cudaStream_t stream) {
  if (htype == kBF16) return run<G, kBF16>(ts, c, check, found_inf, stream);
  if (htype == kF16) return run<G, kF16>(ts, c, check, found_inf, stream);
  return run<G, kNoHalf>(ts, c, check, found_inf, stream);
}

}  // namespace

int multi_tensor_adam(const AdamTensor* tensors, int count, int gtype, int htype,
                      const AdamConsts& c, bool check, int* found_inf, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (cudaError_t e = cudaMemsetAsync(found_inf, 0, sizeof(int), stream); e != cudaSuccess) {
    return int(e);
  }
  std::vector<AdamTensor> ts;
  for (int i = 0; i < count; ++i) {
    if (tensors[i].n > 0) ts.push_back(tensors[i]);
  }
  if (ts.empty()) return int(cudaSuccess);
  cudaError_t e;
  if (gtype == kBF16) e = run_h<kBF16>(htype, ts, c, check, found_inf, stream);
  else if (gtype == kF16) e = run_h<kF16>(htype, ts, c, check, found_inf, stream);
  else e = run_h<kF32>(htype, ts, c, check, found_inf, stream);
  return int(e);
}

const char* error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace fsharded_cuda
