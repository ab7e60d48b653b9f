// The AVX2 kernel of core/util/xxh3.h. This file alone is compiled with -mavx2
// (core/CMakeLists.txt), which makes XXH_INLINE_ALL pick xxHash's AVX2 accumulate loop. It must
// stay this small: every function it includes is either static (xxHash under XXH_INLINE_ALL) or
// defined here, so no AVX2 copy of a shared inline function (a std:: template, say) can be
// chosen by the linker for code that runs on a CPU without AVX2.
#include <xxhash.h>

#include <cstddef>
#include <cstdint>

#ifndef __AVX2__
#error "xxh3_avx2.cc must be compiled with -mavx2"
#endif

namespace ucp::detail {

void Xxh3UpdateAvx2(XXH3_state_t& state, const void* data, size_t size) {
  XXH3_64bits_update(&state, data, size);
}

}  // namespace ucp::detail
