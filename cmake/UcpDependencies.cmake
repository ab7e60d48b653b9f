# Third-party code, all from Debian packages (README.md says why each one is there).
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(CLI11 REQUIRED)

# xxHash: header-only (XXH_INLINE_ALL) so the preload carries no extra shared dependency.
find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
add_library(ucp_xxhash INTERFACE)
target_include_directories(ucp_xxhash SYSTEM INTERFACE ${XXHASH_INCLUDE_DIR})
target_compile_definitions(ucp_xxhash INTERFACE XXH_INLINE_ALL)

# spdlog and fmt compiled into our objects from their headers, with hidden visibility: PyTorch
# ships its own fmt, and two exported copies in one process would clash.
add_library(ucp_logging_deps INTERFACE)
target_compile_definitions(ucp_logging_deps INTERFACE SPDLOG_HEADER_ONLY SPDLOG_FMT_EXTERNAL
  FMT_HEADER_ONLY)
target_include_directories(ucp_logging_deps SYSTEM INTERFACE
  $<TARGET_PROPERTY:spdlog::spdlog_header_only,INTERFACE_INCLUDE_DIRECTORIES>
  $<TARGET_PROPERTY:fmt::fmt-header-only,INTERFACE_INCLUDE_DIRECTORIES>)

# NCCL types come from nccl.h when CUDA is installed; NCCL is never linked, only resolved at run
# time, so its absence changes nothing but which header declares the few ABI types we use.
find_path(NCCL_INCLUDE_DIR nccl.h HINTS /usr/local/cuda/include)
