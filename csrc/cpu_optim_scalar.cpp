// Portable build of the CPU optimizer kernels (the fallback on CPUs without AVX2, and on
// other architectures). See cpu_optim_impl.h.
#include <cstdint>

#include "cpu_optim.h"

#define FS_ISA 0
#define FS_NS fs_scalar
#define FS_NAME "scalar"
#include "cpu_optim_impl.h"

const fsharded_cpu_optim::Kernels* fsharded_cpu_optim::kernels_scalar() { return &fs_scalar::kTable; }
