// The calling thread's current CUDA device, asked of a CUDA runtime the host already loaded.
//
// ucp never links or loads CUDA: cudaGetDevice is looked up in the global namespace
// (dlsym(RTLD_DEFAULT)), else in a libcudart.so* already mapped in a private scope (found among
// the loaded objects, opened with RTLD_NOLOAD). A host without a CUDA runtime gives nullopt (a
// statically linked runtime, as in libnccl itself, is invisible).
//
// Thread-safety: any thread, any time. The function found is cached; until one is found, every
// call looks again (a host may load CUDA late; NCCL communicators are created rarely).
#pragma once

#include <optional>

namespace ucp::hooks {

// The device cudaGetDevice reports for this thread, or nullopt when no CUDA runtime is loaded or
// the call fails. Preserves errno.
std::optional<int> CurrentCudaDevice() noexcept;

}  // namespace ucp::hooks
