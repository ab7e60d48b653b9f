/* A host program linked against the real libnccl.so.2: one rank of a one-rank communicator.
 *
 * Prints the result of ncclGetUniqueId, of ncclCommInitRank (1 rank, rank 0, on the current CUDA
 * device) and, when that succeeded, of ncclCommDestroy; exits 0. Without a GPU the init fails,
 * and the test only compares these results with and without libucp.so preloaded. */
#include <stdio.h>
#include <string.h>

#include "interpose/nccl_abi.h"

int main(void) {
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  const ncclResult_t id_result = ncclGetUniqueId(&id);
  printf("ncclGetUniqueId rc=%d\n", (int)id_result);
  if (id_result != ncclSuccess) return 0;
  ncclComm_t comm = NULL;
  const ncclResult_t init_result = ncclCommInitRank(&comm, 1, id, 0);
  printf("ncclCommInitRank rc=%d comm=%s\n", (int)init_result, comm == NULL ? "null" : "set");
  if (init_result == ncclSuccess) printf("ncclCommDestroy rc=%d\n", (int)ncclCommDestroy(comm));
  return 0;
}
