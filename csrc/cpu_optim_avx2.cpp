// AVX2 build of the CPU optimizer kernels (selected at run time when the CPU has
// avx2, fma and f16c but not AVX-512). See cpu_optim_impl.h.
#include <cstdint>

#include "cpu_optim.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
// GCC 12 warns about its own intrinsics under a target pragma (-Wmaybe-uninitialized), and
// about __m512 losing may_alias as a template argument; neither is a problem here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wignored-attributes"
#pragma GCC target("avx2,fma,f16c")
#endif

#define FS_ISA 1
#define FS_NS fs_avx2
#define FS_NAME "avx2"
#include "cpu_optim_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

const fsharded_cpu_optim::Kernels* fsharded_cpu_optim::kernels_avx2() { return &fs_avx2::kTable; }
#else
const fsharded_cpu_optim::Kernels* fsharded_cpu_optim::kernels_avx2() { return nullptr; }
#endif
