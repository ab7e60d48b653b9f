/* A library that uses NCCL, for a host that dlopens it with RTLD_LOCAL (as Python loads an
 * extension module): libnccl.so.2 is then in this library's private scope, not in the global
 * one that libucp.so's dlsym(RTLD_NEXT) searches. */
#include <stdio.h>
#include <string.h>

#include "interpose/nccl_abi.h"

__attribute__((visibility("default"))) int RunNcclUser(void);
void StandInSetCudaDevice(int device); /* stand_in_cudart.c, as libcudart.so.0 */

/* Creates a 2-rank communicator as rank 0 on CUDA device 5 and destroys it; prints each result;
 * returns the number of calls that failed. */
int RunNcclUser(void) {
  int failures = 0;
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  const ncclResult_t id_result = ncclGetUniqueId(&id);
  printf("ncclGetUniqueId rc=%d\n", (int)id_result);
  failures += id_result != ncclSuccess;
  StandInSetCudaDevice(5);
  ncclComm_t comm = NULL;
  const ncclResult_t init_result = ncclCommInitRank(&comm, 2, id, 0);
  printf("ncclCommInitRank rc=%d\n", (int)init_result);
  failures += init_result != ncclSuccess;
  if (comm != NULL) {
    const ncclResult_t destroy_result = ncclCommDestroy(comm);
    printf("ncclCommDestroy rc=%d\n", (int)destroy_result);
    failures += destroy_result != ncclSuccess;
  }
  return failures;
}
