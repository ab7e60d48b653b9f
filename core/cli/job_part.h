// `ucp reshard` and `ucp export` as one process of many under a launcher (torchrun, srun,
// mpirun, ...): `--job` divides the plan's output files among the job's processes, each writes
// its share into one staging directory beside the output, and process 0 commits it once every
// file is there.
//
// The staging directory's name is a hash of the source files (sizes and XXH3s), the plan's
// outputs, the number of processes and the part size (--job-part-kb), so every process of the job finds it without talking to
// the others, and a rerun of the same job after a crash reuses what the first run completed:
// each output is written whole under a temporary name and renamed (ExecutePlan), and the same
// plan over the same sources writes the same bytes. Each other process leaves a marker,
// `.ucp-part-<rank>-of-<parts>`, once its share and the directories it made are synced. Process 0
// waits for every marker (at most `wait`), checks that every output of the plan is there with
// its planned size, removes the markers, renames the directory into place and writes `latest`
// (reshard) or `latest_universal` (export). A process 0 that fails or times out removes the
// staging directory: nothing is left behind.
//
// A torch archive of at least twice `--job-part-kb` of tensor data (the model states of a large
// model) is divided as parts (executor.h's ArchivePart): each part goes to a process as a file
// would, is written into the archive's parts' file in the staging directory, and its pieces'
// CRC-32s travel in the writer's marker (process 0's own in memory); process 0 completes each
// such archive (FinishArchiveParts) before checking the outputs.
//
// Thread-safety: one caller per process.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/atom_index.h"
#include "core/plan/executor.h"
#include "core/util/launcher.h"
#include "core/util/status.h"

namespace ucp::cli {

// This process's place in the job.
struct JobPart {
  uint32_t rank = 0;
  uint32_t parts = 1;
  std::string evidence;  // the launcher's variables, e.g. "WORLD_SIZE=4 RANK=1 (launcher)"
};

// From the launcher's environment (LauncherPositionFromEnv): kInvalidArgument when no launcher
// variable is set, a set one is malformed, or it gives no rank.
[[nodiscard]] Result<JobPart> JobPartFromEnv(const EnvLookup& env);

// One output file of a plan: its path, its planned size (nullopt for safetensors, whose size is
// known only once written) and its weight in the division (the planned size, or a safetensors
// file's tensor bytes).
struct PlannedOutput {
  std::string path;
  std::optional<uint64_t> size;
  uint64_t weight = 0;
};

// Every output of `plan`, in the order archives, safetensors, copies, texts.
[[nodiscard]] Result<std::vector<PlannedOutput>> ListOutputs(const OutputPlan& plan,
                                                             const AtomIndex& index);

// Which part does each piece of work of these weights (same order): the heaviest first, each to
// the least loaded part, ties to the lowest rank; the same answer in every process.
std::vector<uint32_t> DivideWork(const std::vector<uint64_t>& weights, uint32_t parts);

// The outputs of `plan` that `owners` gives to `rank`.
OutputPlan ShareOf(OutputPlan plan, const std::vector<uint32_t>& owners, uint32_t rank);

// What this process did.
struct JobPartResult {
  size_t files_written = 0;    // whole
  size_t parts_written = 0;    // parts of divided archives
  uint64_t bytes_written = 0;  // tensor data of its share, files and parts
  bool committed = false;      // process 0, after every file was there
};

// How long process 0 waits for the others' files by default (--job-wait).
inline constexpr unsigned kJobWaitSeconds = 1800;
// Archives of at least twice this many KiB of tensor data are divided as parts (--job-part-kb).
inline constexpr uint64_t kJobPartKiB = uint64_t{1} << 20;

// A writing command's --job options.
struct JobOptions {
  bool enabled = false;
  unsigned wait_seconds = kJobWaitSeconds;
  uint64_t part_kib = kJobPartKiB;
};

// Writes `part`'s share of `plan` into the job's staging directory beside `final_path` (after
// checking the sources that share reads against the index) and, in process 0, waits for the
// rest and commits (`force` replaces an existing `final_path`). A wait longer than
// `options.wait_seconds` is kFailedPrecondition naming the first part not finished; a finished
// job missing a file is kCorrupt naming it.
[[nodiscard]] Result<JobPartResult> ExecuteJobPart(OutputPlan plan, const AtomIndex& index,
                                                   const std::string& tag_dir,
                                                   const std::string& final_path,
                                                   const JobPart& part, unsigned threads,
                                                   bool force, const JobOptions& options);

// Adds --job, --job-wait SECONDS and --job-part-kb KIB to a writing command.
void AddJobOptions(CLI::App& command, JobOptions& options);

// The line a process of a job prints: process 0 the command's usual line with the part count,
// the others their share.
void PrintJobPart(std::ostream& out, const std::string& final_path, const std::string& what,
                  const JobPart& part, const JobPartResult& done, size_t files,
                  uint64_t data_bytes);

}  // namespace ucp::cli
