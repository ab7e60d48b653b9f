// The calling thread's current CUDA device, asked of a CUDA runtime the host already loaded.
//
// ucp never links or loads CUDA: cudaGetDevice is looked up in the global namespace
// (dlsym(RTLD_DEFAULT)) and in a libcudart that is already mapped (dlopen with RTLD_NOLOAD).
// A host without CUDA, or one that keeps CUDA private to a library we cannot see, gives nullopt.
//
// Thread-safety: any thread, any time; the symbol is looked up on every call (NCCL
// communicators are created rarely, and a host may load CUDA late).
#pragma once

#include <optional>

namespace ucp::hooks {

// The device cudaGetDevice reports for this thread, or nullopt when no CUDA runtime is loaded or
// the call fails. Preserves errno.
std::optional<int> CurrentCudaDevice() noexcept;

}  // namespace ucp::hooks
