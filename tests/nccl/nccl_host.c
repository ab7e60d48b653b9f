/* A host program for the NCCL hook tests, linked against libnccl.so.2 (the stand-in).
 *
 * It walks through every hooked entry point and prints one line per call with the result and
 * what it can see of the communicator, then exits with the number of calls that did not return
 * ncclSuccess. Its output must be the same with and without libucp.so preloaded. Nothing printed
 * depends on addresses.
 *
 * Usage: nccl_host [ID_DIR]. With ID_DIR, the unique ids are written there as raw bytes
 * (world.id: the world's ncclUniqueId; scalable.id: the two ids of ncclCommInitRankScalable),
 * so a test can hash them with an independent tool. */
#include <stdio.h>
#include <string.h>

#include "interpose/nccl_abi.h"

void StandInSetCudaDevice(int device); /* stand_in_cudart.c */

static int g_failures;

static void Report(const char* call, ncclResult_t result, ncclComm_t comm) {
  if (result != ncclSuccess) ++g_failures;
  printf("%s rc=%d", call, (int)result);
  if (result == ncclSuccess || result == ncclInProgress) {
    if (comm == NULL) {
      printf(" comm=null");
    } else {
      int count = -1;
      int rank = -1;
      const ncclResult_t count_result = ncclCommCount(comm, &count);
      const ncclResult_t rank_result = ncclCommUserRank(comm, &rank);
      printf(" count=%d/%d rank=%d/%d", (int)count_result, count, (int)rank_result, rank);
    }
  }
  printf("\n");
}

static void Plain(const char* call, ncclResult_t result) {
  if (result != ncclSuccess) ++g_failures;
  printf("%s rc=%d\n", call, (int)result);
}

static void WriteIds(const char* dir, const char* name, const ncclUniqueId* ids, size_t n) {
  if (dir == NULL) return;
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE* file = fopen(path, "wb");
  if (file == NULL) return;
  fwrite(ids, sizeof *ids, n, file);
  fclose(file);
}

static void Config(ncclConfig_t* config) {
  memset(config, 0, sizeof *config);
  config->size = sizeof *config;
  config->magic = 0xcafebeef;
  config->blocking = 1;
}

int main(int argc, char** argv) {
  const char* id_dir = argc > 1 ? argv[1] : NULL;
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  ncclResult_t result = ncclGetUniqueId(&id);
  printf("ncclGetUniqueId rc=%d first=%d\n", (int)result, (int)(unsigned char)id.internal[1]);
  if (result != ncclSuccess) ++g_failures;
  WriteIds(id_dir, "world.id", &id, 1);

  StandInSetCudaDevice(2);
  ncclComm_t world = NULL;
  result = ncclCommInitRank(&world, 4, id, 1);
  Report("ncclCommInitRank", result, world);

  StandInSetCudaDevice(3);
  ncclComm_t second = NULL;
  ncclConfig_t config;
  Config(&config);
  result = ncclCommInitRankConfig(&second, 4, id, 2, &config);
  Report("ncclCommInitRankConfig", result, second);

  ncclComm_t half = NULL;
  ncclComm_t none = NULL;
  ncclComm_t grouped = NULL;
  if (world != NULL) {
    result = ncclCommSplit(world, 0, 1, &half, NULL);
    Report("ncclCommSplit", result, half);
    none = world; /* must be set to NULL by a NOCOLOR split */
    result = ncclCommSplit(world, NCCL_SPLIT_NOCOLOR, 0, &none, NULL);
    Report("ncclCommSplit(nocolor)", result, none);
    Plain("ncclGroupStart", ncclGroupStart());
    result = ncclCommSplit(world, 1, 3, &grouped, NULL);
    Plain("ncclCommSplit(in group)", result);
    result = ncclGroupEnd();
    Report("ncclGroupEnd", result, grouped);
  }

  ncclUniqueId ids[2];
  memset(ids, 0, sizeof ids);
  Plain("ncclGetUniqueId[0]", ncclGetUniqueId(&ids[0]));
  Plain("ncclGetUniqueId[1]", ncclGetUniqueId(&ids[1]));
  WriteIds(id_dir, "scalable.id", ids, 2);
  ncclComm_t scalable = NULL;
  result = ncclCommInitRankScalable(&scalable, 8, 5, 2, ids, NULL);
  Report("ncclCommInitRankScalable", result, scalable);

  ncclComm_t all[2] = {NULL, NULL};
  const int devices[2] = {1, 0};
  result = ncclCommInitAll(all, 2, devices);
  Report("ncclCommInitAll[0]", result, all[0]);
  Report("ncclCommInitAll[1]", result, all[1]);

  if (half != NULL) {
    Plain("ncclCommFinalize(split)", ncclCommFinalize(half));
    Plain("ncclCommDestroy(split)", ncclCommDestroy(half));
  }
  if (second != NULL) Plain("ncclCommAbort(second)", ncclCommAbort(second));
  if (grouped != NULL) Plain("ncclCommFinalize(grouped)", ncclCommFinalize(grouped));
  if (all[0] != NULL) Plain("ncclCommDestroy(all0)", ncclCommDestroy(all[0]));
  printf("failures=%d\n", g_failures);
  return g_failures;
}
