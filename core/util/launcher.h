// Where a launcher (torchrun, deepspeed, mpirun, srun, ...) placed this process: the job's size
// and this process's rank, as the launcher's environment states them.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ucp {

// Looks up one environment variable by name; nullptr when unset (getenv's contract).
using EnvLookup = std::function<const char*(const char* name)>;

struct LauncherPosition {
  int size = 0;
  std::optional<int> rank;  // below size
  std::string text;         // the evidence, e.g. "WORLD_SIZE=2 RANK=1 (launcher)"
};

// The first launcher whose size variable is set and valid, in order WORLD_SIZE/RANK,
// OMPI_COMM_WORLD_SIZE/_RANK, PMI_SIZE/PMI_RANK, SLURM_NTASKS/SLURM_PROCID. Set but invalid
// variables are reported in `warnings` and skipped.
std::optional<LauncherPosition> LauncherPositionFromEnv(const EnvLookup& env,
                                                        std::vector<std::string>& warnings);

}  // namespace ucp
