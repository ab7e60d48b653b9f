#include "hooks/cuda_device.h"

#include <dlfcn.h>

#include <cerrno>

#include "core/util/reentrancy_guard.h"

namespace ucp::hooks {
namespace {

// cudaError_t cudaGetDevice(int*), with cudaError_t an enum whose cudaSuccess is 0.
using CudaGetDeviceFn = int (*)(int*);

// Sonames of the CUDA runtimes NCCL 2.x hosts use, newest first.
constexpr const char* kCudartSonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                          "libcudart.so"};

CudaGetDeviceFn FindCudaGetDevice() {
  if (void* sym = ::dlsym(RTLD_DEFAULT, "cudaGetDevice")) {
    return reinterpret_cast<CudaGetDeviceFn>(sym);
  }
  for (const char* soname : kCudartSonames) {
    // RTLD_NOLOAD: a handle only if the host already mapped it; ucp never loads CUDA.
    void* handle = ::dlopen(soname, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    void* sym = ::dlsym(handle, "cudaGetDevice");
    ::dlclose(handle);  // drops the reference RTLD_NOLOAD added; the host's stays
    if (sym != nullptr) return reinterpret_cast<CudaGetDeviceFn>(sym);
  }
  return nullptr;
}

}  // namespace

std::optional<int> CurrentCudaDevice() noexcept {
  ReentrancyGuard guard;
  const int saved_errno = errno;
  std::optional<int> device;
  if (CudaGetDeviceFn get_device = FindCudaGetDevice()) {
    int value = -1;
    if (get_device(&value) == 0 && value >= 0) device = value;
  }
  errno = saved_errno;
  return device;
}

}  // namespace ucp::hooks
