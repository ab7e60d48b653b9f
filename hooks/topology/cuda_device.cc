#include "hooks/topology/cuda_device.h"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "core/util/reentrancy_guard.h"

namespace ucp::hooks {
namespace {

// cudaError_t cudaGetDevice(int*), with cudaError_t an enum whose cudaSuccess is 0.
using CudaGetDeviceFn = int (*)(int*);

std::atomic<CudaGetDeviceFn> g_cuda_get_device{nullptr};

// dl_iterate_phdr callback: the link-map name of a loaded libcudart.so*, into *data.
int FindLoadedCudart(struct dl_phdr_info* info, size_t /*size*/, void* data) {
  const char* name = info->dlpi_name;
  if (name == nullptr) return 0;
  const char* slash = std::strrchr(name, '/');
  const char* base = slash != nullptr ? slash + 1 : name;
  if (std::strncmp(base, "libcudart.so", std::strlen("libcudart.so")) != 0) return 0;
  *static_cast<std::string*>(data) = name;
  return 1;
}

// cudaGetDevice of a runtime the host loaded, or nullptr. A libcudart found in a private
// (RTLD_LOCAL) scope is opened by its exact link-map name with RTLD_NOLOAD, which matches the
// loaded object without touching the file system; the reference that adds is kept, so the
// cached pointer stays valid should the host unload its own.
CudaGetDeviceFn FindCudaGetDevice() {
  if (void* sym = ::dlsym(RTLD_DEFAULT, "cudaGetDevice")) {
    return reinterpret_cast<CudaGetDeviceFn>(sym);
  }
  std::string path;
  ::dl_iterate_phdr(&FindLoadedCudart, &path);
  if (path.empty()) return nullptr;
  void* handle = ::dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return nullptr;
  void* sym = ::dlsym(handle, "cudaGetDevice");
  if (sym == nullptr) {
    ::dlclose(handle);
    return nullptr;
  }
  return reinterpret_cast<CudaGetDeviceFn>(sym);
}

}  // namespace

std::optional<int> CurrentCudaDevice() noexcept {
  ReentrancyGuard guard;
  const int saved_errno = errno;
  CudaGetDeviceFn get_device = g_cuda_get_device.load(std::memory_order_acquire);
  if (get_device == nullptr) {
    try {
      get_device = FindCudaGetDevice();
    } catch (...) {  // std::bad_alloc from the path string
      get_device = nullptr;
    }
    if (get_device != nullptr) g_cuda_get_device.store(get_device, std::memory_order_release);
  }
  std::optional<int> device;
  int value = -1;
  if (get_device != nullptr && get_device(&value) == 0 && value >= 0) device = value;
  errno = saved_errno;
  return device;
}

}  // namespace ucp::hooks
