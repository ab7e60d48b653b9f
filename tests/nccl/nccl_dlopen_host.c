/* A host that reaches NCCL only through a library it dlopens with RTLD_LOCAL.
 *
 * Usage: nccl_dlopen_host LIBRARY. Calls LIBRARY's RunNcclUser() and exits with its result
 * (2 when the library cannot be loaded). */
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (library == NULL) {
    fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
    return 2;
  }
  /* POSIX's way to turn dlsym's object pointer into a function pointer. */
  int (*run)(void) = NULL;
  *(void**)&run = dlsym(library, "RunNcclUser");
  if (run == NULL) return 2;
  return run();
}
