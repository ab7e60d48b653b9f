/* A stand-in for cudaGetDevice, for the NCCL tests. Linked into the test host and exported
 * from it (as a host that loaded libcudart globally would have it), so ucp's CurrentCudaDevice()
 * finds it through dlsym(RTLD_DEFAULT); also built as libcudart.so.0 for a library loaded with
 * RTLD_LOCAL, where ucp must find it among the loaded objects. StandInSetCudaDevice plays
 * cudaSetDevice under a name that cannot clash with CUDA's headers. cudaError_t is an int enum
 * whose cudaSuccess is 0; this file does not include the CUDA headers. */
__attribute__((visibility("default"))) int cudaGetDevice(int* device);
__attribute__((visibility("default"))) void StandInSetCudaDevice(int device);

static int g_current_device;

int cudaGetDevice(int* device) {
  if (device == 0) return 1; /* cudaErrorInvalidValue */
  *device = g_current_device;
  return 0;
}

void StandInSetCudaDevice(int device) { g_current_device = device; }
