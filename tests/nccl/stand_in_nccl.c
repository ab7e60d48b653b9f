/* A stand-in for NCCL in tests: libnccl.so.2 without GPUs or a network.
 *
 * It exports the entry points as the real library does: strong pnccl* definitions and nccl* as
 * weak aliases of them, so the NCCL wrappers of libucp.so meet the same symbol layout.
 * Communicators are heap objects holding what they were created with, and every result is
 * deterministic, so a host's output can be compared with and without the preload:
 *   - ncclGetUniqueId: 128 bytes derived from a per-process counter;
 *   - ncclCommSplit: the child of a parent with N ranks has (N + 1) / 2 ranks, and the caller's
 *     rank in it is key modulo that size; NCCL_SPLIT_NOCOLOR gives a NULL communicator;
 *   - a communicator created between ncclGroupStart and ncclGroupEnd is not ready until the
 *     outermost ncclGroupEnd: ncclCommCount/ncclCommUserRank on it fail with
 *     ncclInvalidArgument and print a warning to stderr, as NCCL does with NCCL_DEBUG=WARN.
 * STAND_IN_NCCL_FAIL=<name>:<code> makes the entry point <name> (e.g. ncclCommInitRank) return
 * <code>: with code 7 (ncclInProgress) it does its work first, like a non-blocking NCCL; with
 * any other code it returns at once, leaving its outputs untouched.
 *
 * Thread-safety: none needed by the tests (single-threaded hosts). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "interpose/nccl_abi.h"

#define STAND_IN_EXPORT __attribute__((visibility("default")))
#define STAND_IN_ALIAS(name) __attribute__((weak, alias("p" #name), visibility("default")))

struct ncclComm {
  uint32_t magic;
  int nranks;
  int rank;
  int ready;
  int finalized;
};

enum { kCommMagic = 0x5ca1ab1e };

static int g_group_depth;
static unsigned g_id_counter;
static struct ncclComm* g_pending[64];
static int g_pending_count;

/* The result STAND_IN_NCCL_FAIL asks for `name` to return, or ncclSuccess. */
static ncclResult_t InjectedResult(const char* name) {
  const char* spec = getenv("STAND_IN_NCCL_FAIL");
  if (spec == NULL) return ncclSuccess;
  const char* colon = strchr(spec, ':');
  if (colon == NULL) return ncclSuccess;
  const size_t length = (size_t)(colon - spec);
  if (length != strlen(name) || strncmp(spec, name, length) != 0) return ncclSuccess;
  return (ncclResult_t)atoi(colon + 1);
}

static ncclResult_t NewComm(ncclComm_t* out, int nranks, int rank) {
  if (out == NULL || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  struct ncclComm* comm = calloc(1, sizeof *comm);
  if (comm == NULL) return ncclSystemError;
  comm->magic = kCommMagic;
  comm->nranks = nranks;
  comm->rank = rank;
  comm->ready = g_group_depth == 0;
  if (!comm->ready) {
    if (g_pending_count == (int)(sizeof g_pending / sizeof g_pending[0])) {
      free(comm);
      return ncclInternalError;
    }
    g_pending[g_pending_count++] = comm;
  }
  *out = comm;
  return ncclSuccess;
}

static int Valid(const struct ncclComm* comm) { return comm != NULL && comm->magic == kCommMagic; }

/* A call whose injected result is not ncclInProgress returns it before doing anything. */
#define STAND_IN_INJECT(name)                         \
  const ncclResult_t injected = InjectedResult(name); \
  if (injected != ncclSuccess && injected != ncclInProgress) return injected

STAND_IN_EXPORT ncclResult_t pncclGetUniqueId(ncclUniqueId* uniqueId) {
  STAND_IN_INJECT("ncclGetUniqueId");
  if (uniqueId == NULL) return ncclInvalidArgument;
  const unsigned counter = ++g_id_counter;
  for (size_t i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) {
    uniqueId->internal[i] = (char)((counter * 37u + i * 11u) & 0xffu);
  }
  return injected;
}

STAND_IN_EXPORT ncclResult_t pncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId,
                                               int rank) {
  (void)commId;
  STAND_IN_INJECT("ncclCommInitRank");
  const ncclResult_t result = NewComm(comm, nranks, rank);
  return result != ncclSuccess ? result : injected;
}

STAND_IN_EXPORT ncclResult_t pncclCommInitRankConfig(ncclComm_t* comm, int nranks,
                                                     ncclUniqueId commId, int rank,
                                                     ncclConfig_t* config) {
  (void)commId;
  (void)config;
  STAND_IN_INJECT("ncclCommInitRankConfig");
  const ncclResult_t result = NewComm(comm, nranks, rank);
  return result != ncclSuccess ? result : injected;
}

STAND_IN_EXPORT ncclResult_t pncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist) {
  (void)devlist;
  STAND_IN_INJECT("ncclCommInitAll");
  if (comm == NULL || ndev < 1) return ncclInvalidArgument;
  for (int i = 0; i < ndev; ++i) {
    const ncclResult_t result = NewComm(&comm[i], ndev, i);
    if (result != ncclSuccess) return result;
  }
  return injected;
}

STAND_IN_EXPORT ncclResult_t pncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank,
                                                       int nId, ncclUniqueId* commIds,
                                                       ncclConfig_t* config) {
  (void)config;
  STAND_IN_INJECT("ncclCommInitRankScalable");
  if (nId < 1 || commIds == NULL) return ncclInvalidArgument;
  const ncclResult_t result = NewComm(newcomm, nranks, myrank);
  return result != ncclSuccess ? result : injected;
}

STAND_IN_EXPORT ncclResult_t pncclCommSplit(ncclComm_t comm, int color, int key,
                                            ncclComm_t* newcomm, ncclConfig_t* config) {
  (void)config;
  STAND_IN_INJECT("ncclCommSplit");
  if (!Valid(comm) || newcomm == NULL) return ncclInvalidArgument;
  if (color == NCCL_SPLIT_NOCOLOR) {
    *newcomm = NULL;
    return injected;
  }
  const int nranks = (comm->nranks + 1) / 2;
  const ncclResult_t result = NewComm(newcomm, nranks, (key < 0 ? -key : key) % nranks);
  return result != ncclSuccess ? result : injected;
}

STAND_IN_EXPORT ncclResult_t pncclCommFinalize(ncclComm_t comm) {
  STAND_IN_INJECT("ncclCommFinalize");
  if (!Valid(comm)) return ncclInvalidArgument;
  comm->finalized = 1;
  return injected;
}

static ncclResult_t FreeComm(ncclComm_t comm) {
  if (!Valid(comm)) return ncclInvalidArgument;
  comm->magic = 0;
  free(comm);
  return ncclSuccess;
}

STAND_IN_EXPORT ncclResult_t pncclCommDestroy(ncclComm_t comm) {
  STAND_IN_INJECT("ncclCommDestroy");
  const ncclResult_t result = FreeComm(comm);
  return result != ncclSuccess ? result : injected;
}

STAND_IN_EXPORT ncclResult_t pncclCommAbort(ncclComm_t comm) {
  STAND_IN_INJECT("ncclCommAbort");
  const ncclResult_t result = FreeComm(comm);
  return result != ncclSuccess ? result : injected;
}

static ncclResult_t EnsureReady(const struct ncclComm* comm, const char* what) {
  if (!Valid(comm)) return ncclInvalidArgument;
  if (!comm->ready) {
    fprintf(stderr, "stand-in NCCL WARN %s: communicator used before it is ready\n", what);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

STAND_IN_EXPORT ncclResult_t pncclCommCount(const ncclComm_t comm, int* count) {
  const ncclResult_t result = EnsureReady(comm, "ncclCommCount");
  if (result != ncclSuccess) return result;
  if (count == NULL) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}

STAND_IN_EXPORT ncclResult_t pncclCommUserRank(const ncclComm_t comm, int* rank) {
  const ncclResult_t result = EnsureReady(comm, "ncclCommUserRank");
  if (result != ncclSuccess) return result;
  if (rank == NULL) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

STAND_IN_EXPORT ncclResult_t pncclGroupStart(void) {
  ++g_group_depth;
  return ncclSuccess;
}

STAND_IN_EXPORT ncclResult_t pncclGroupEnd(void) {
  if (g_group_depth == 0) return ncclInvalidUsage;
  if (--g_group_depth > 0) return ncclSuccess;
  for (int i = 0; i < g_pending_count; ++i) g_pending[i]->ready = 1;
  g_pending_count = 0;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) STAND_IN_ALIAS(ncclGetUniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank)
    STAND_IN_ALIAS(ncclCommInitRank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config) STAND_IN_ALIAS(ncclCommInitRankConfig);
ncclResult_t ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist)
    STAND_IN_ALIAS(ncclCommInitAll);
ncclResult_t ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId,
                                      ncclUniqueId* commIds, ncclConfig_t* config)
    STAND_IN_ALIAS(ncclCommInitRankScalable);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t* config) STAND_IN_ALIAS(ncclCommSplit);
ncclResult_t ncclCommFinalize(ncclComm_t comm) STAND_IN_ALIAS(ncclCommFinalize);
ncclResult_t ncclCommDestroy(ncclComm_t comm) STAND_IN_ALIAS(ncclCommDestroy);
ncclResult_t ncclCommAbort(ncclComm_t comm) STAND_IN_ALIAS(ncclCommAbort);
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) STAND_IN_ALIAS(ncclCommCount);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) STAND_IN_ALIAS(ncclCommUserRank);
ncclResult_t ncclGroupStart(void) STAND_IN_ALIAS(ncclGroupStart);
ncclResult_t ncclGroupEnd(void) STAND_IN_ALIAS(ncclGroupEnd);
