/* The NCCL ABI that ucp's wrappers and the test stand-in use: nccl.h when the build found it
 * (UCP_HAVE_NCCL_H, CUDA's include directory), else a minimal declaration of the same types and
 * entry points, as NCCL 2.x defines them. ucp never links NCCL or CUDA: this header only gives
 * names and layouts to what is resolved at run time.
 *
 * Only the leading fields of ncclConfig_t are declared in the fallback; they are the same in
 * every NCCL release with a config (2.14 to 2.28: size, magic, version, blocking, ...), and ucp
 * never reads past them.
 *
 * C and C++. Thread-safety: declarations only. */
#ifndef UCP_INTERPOSE_NCCL_ABI_H_
#define UCP_INTERPOSE_NCCL_ABI_H_

#if defined(UCP_HAVE_NCCL_H)
#include <nccl.h>
#else

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ncclComm* ncclComm_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

#define NCCL_SPLIT_NOCOLOR -1

typedef struct ncclConfig_prefix {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
} ncclConfig_t;

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config);
ncclResult_t ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist);
ncclResult_t ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId,
                                      ncclUniqueId* commIds, ncclConfig_t* config);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t* config);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

#ifdef __cplusplus
}
#endif

#endif /* UCP_HAVE_NCCL_H */
#endif /* UCP_INTERPOSE_NCCL_ABI_H_ */
