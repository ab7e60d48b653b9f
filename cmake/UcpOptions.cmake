# Warnings and sanitizers, applied to every ucp target through ucp_project_options.
add_library(ucp_project_options INTERFACE)
target_compile_options(ucp_project_options INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wcast-align -Wformat=2
  -Wimplicit-fallthrough -Wnull-dereference)
if(UCP_WERROR)
  target_compile_options(ucp_project_options INTERFACE -Werror)
endif()
if(UCP_ASAN AND UCP_TSAN)
  message(FATAL_ERROR "UCP_ASAN and UCP_TSAN are exclusive")
endif()
if(UCP_ASAN)
  target_compile_options(ucp_project_options INTERFACE
    -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  target_link_options(ucp_project_options INTERFACE -fsanitize=address,undefined)
endif()
if(UCP_TSAN)
  target_compile_options(ucp_project_options INTERFACE -fsanitize=thread -fno-omit-frame-pointer)
  target_link_options(ucp_project_options INTERFACE -fsanitize=thread)
endif()
