#include "core/cli/job_part.h"

#include <sys/stat.h>

#include <algorithm>
#include <numeric>
#include <thread>
#include <utility>

#include "core/cli/staging.h"
#include "core/cli/terminal.h"
#include "core/io/file.h"
#include "core/tag/source_check.h"
#include "core/util/xxh3.h"

namespace ucp::cli {
namespace {

// The staging directory's key: what the job writes, from what, in how many parts.
std::string JobKey(const std::vector<PlannedOutput>& outputs, const AtomIndex& index,
                   uint32_t parts) {
  std::string text = std::to_string(parts) + "\n";
  for (const IndexedFile& file : index.files()) {
    text += file.path + " " + std::to_string(file.size) + " " + std::to_string(file.xxh3) + "\n";
  }
  for (const PlannedOutput& output : outputs) {
    text += output.path + " " + (output.size ? std::to_string(*output.size) : "?") + "\n";
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(text.data(), text.size())));
  return hex;
}

// The marker a part leaves in the staging directory once its share is written and synced: a
// file visible there is whole, but its writer may still be syncing the directories it made.
std::string PartMarker(const std::string& dir, uint32_t rank, uint32_t parts) {
  return dir + "/.ucp-part-" + std::to_string(rank) + "-of-" + std::to_string(parts);
}

// The first output not in `dir` whole (its planned size, or present for a safetensors file),
// or nullopt when all are.
std::optional<std::string> FirstMissing(const std::vector<PlannedOutput>& outputs,
                                        const std::string& dir) {
  for (const PlannedOutput& output : outputs) {
    struct stat st;
    if (::stat((dir + "/" + output.path).c_str(), &st) != 0 ||
        (output.size && static_cast<uint64_t>(st.st_size) != *output.size)) {
      return output.path;
    }
  }
  return std::nullopt;
}

}  // namespace

Result<JobPart> JobPartFromEnv(const EnvLookup& env) {
  std::vector<std::string> warnings;
  std::optional<LauncherPosition> position = LauncherPositionFromEnv(env, warnings);
  if (!warnings.empty()) return Status::InvalidArgument("--job: " + warnings.front());
  if (!position) {
    return Status::InvalidArgument(
        "--job: no launcher variables (WORLD_SIZE and RANK, OMPI_COMM_WORLD_SIZE and "
        "OMPI_COMM_WORLD_RANK, PMI_SIZE and PMI_RANK, SLURM_NTASKS and SLURM_PROCID)");
  }
  if (!position->rank) {
    return Status::InvalidArgument("--job: " + position->text + " gives no rank");
  }
  return JobPart{static_cast<uint32_t>(*position->rank), static_cast<uint32_t>(position->size),
                 position->text};
}

Result<std::vector<PlannedOutput>> ListOutputs(const OutputPlan& plan, const AtomIndex& index) {
  std::vector<PlannedOutput> outputs;
  for (const ArchiveOutput& archive : plan.archives) {
    UCP_ASSIGN_OR_RETURN(const uint64_t size, PlannedArchiveSize(archive));
    outputs.push_back({archive.path, size, size});
  }
  for (const SafetensorsOutput& file : plan.safetensors) {
    uint64_t bytes = 0;
    for (const SafetensorsOutputTensor& tensor : file.tensors)
      bytes += SegmentBytes(tensor.segments);
    outputs.push_back({file.path, std::nullopt, bytes});
  }
  for (const CopyOutput& copy : plan.copies) {
    if (copy.file >= index.files().size()) {
      return Status::InvalidArgument("job: copy of source file " + std::to_string(copy.file) +
                                     ", the index has " + std::to_string(index.files().size()));
    }
    const uint64_t size = index.files()[copy.file].size;
    outputs.push_back({copy.path, size, size});
  }
  for (const TextOutput& text : plan.texts) {
    outputs.push_back({text.path, text.contents.size(), text.contents.size()});
  }
  return outputs;
}

std::vector<uint32_t> DivideOutputs(const std::vector<PlannedOutput>& outputs, uint32_t parts) {
  std::vector<size_t> order(outputs.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&outputs](size_t a, size_t b) {
    return outputs[a].weight > outputs[b].weight;
  });
  std::vector<uint64_t> load(std::max(parts, 1u), 0);
  std::vector<uint32_t> owners(outputs.size(), 0);
  for (const size_t i : order) {
    const uint32_t lightest =
        static_cast<uint32_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owners[i] = lightest;
    load[lightest] += std::max<uint64_t>(outputs[i].weight, 1);
  }
  return owners;
}

OutputPlan ShareOf(OutputPlan plan, const std::vector<uint32_t>& owners, uint32_t rank) {
  OutputPlan share;
  size_t i = 0;
  const auto take = [&](auto& from, auto& to) {
    for (auto& output : from) {
      if (owners[i++] == rank) to.push_back(std::move(output));
    }
  };
  take(plan.archives, share.archives);
  take(plan.safetensors, share.safetensors);
  take(plan.copies, share.copies);
  take(plan.texts, share.texts);
  return share;
}

Result<JobPartResult> ExecuteJobPart(OutputPlan plan, const AtomIndex& index,
                                     const std::string& tag_dir, const std::string& final_path,
                                     const JobPart& part, unsigned threads, bool force,
                                     std::chrono::milliseconds wait) {
  UCP_ASSIGN_OR_RETURN(const std::vector<PlannedOutput> outputs, ListOutputs(plan, index));
  const std::vector<uint32_t> owners = DivideOutputs(outputs, part.parts);
  const OutputPlan share = ShareOf(std::move(plan), owners, part.rank);
  UCP_RETURN_IF_ERROR(CheckSourcesBeforeReading(index, share, tag_dir, "source check"));
  const bool owner = part.rank == 0;
  UCP_ASSIGN_OR_RETURN(
      StagedDirectory staged,
      StagedDirectory::CreateShared(final_path, JobKey(outputs, index, part.parts), owner));
  ExecuteOptions execute;
  execute.threads = threads;
  execute.locate_damage = LocateDamageWith(index, tag_dir);
  UCP_RETURN_IF_ERROR(ExecutePlan(share, index, tag_dir, staged.path(), execute));
  JobPartResult result;
  result.files_written =
      share.archives.size() + share.safetensors.size() + share.copies.size() + share.texts.size();
  result.bytes_written = share.DataBytes();
  if (!owner) {
    UCP_RETURN_IF_ERROR(WriteFileAtomically(PartMarker(staged.path(), part.rank, part.parts),
                                            std::to_string(result.files_written) + " files\n",
                                            /*sync=*/true));
    return result;
  }

  // Every other part's marker, then every file: a part that marked itself done without a file
  // of its share is a fault, not something to wait for.
  const auto deadline = std::chrono::steady_clock::now() + wait;
  auto pause = std::chrono::milliseconds(1);
  for (uint32_t other = 1; other < part.parts; ++other) {
    struct stat st;
    while (::stat(PartMarker(staged.path(), other, part.parts).c_str(), &st) != 0) {
      if (std::chrono::steady_clock::now() >= deadline) {
        return Status::FailedPrecondition(
            "job of " + std::to_string(part.parts) + " processes: part " + std::to_string(other) +
            " did not finish its share within " + std::to_string(wait.count() / 1000) + " s");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
    }
  }
  if (const std::optional<std::string> missing = FirstMissing(outputs, staged.path())) {
    return Status::Corrupt("job of " + std::to_string(part.parts) + " processes: " + *missing +
                           " is missing or not its planned size after every part finished");
  }
  for (uint32_t other = 1; other < part.parts; ++other) {
    UCP_RETURN_IF_ERROR(RemoveFile(PartMarker(staged.path(), other, part.parts)));
  }
  UCP_RETURN_IF_ERROR(staged.Commit(force));
  result.committed = true;
  return result;
}

void AddJobOptions(CLI::App& command, bool& job, unsigned& wait_seconds) {
  command.add_flag("--job", job,
                   "one process of a job under a launcher (RANK/WORLD_SIZE, ...): write this "
                   "process's share; process 0 commits once every file is there");
  command.add_option("--job-wait", wait_seconds,
                     "--job: seconds process 0 waits for the others' files (default 1800)");
}

void PrintJobPart(std::ostream& out, const std::string& final_path, const std::string& what,
                  const JobPart& part, const JobPartResult& done, size_t files,
                  uint64_t data_bytes) {
  if (done.committed) {
    out << final_path << ": " << what << ", " << files << " files, " << HumanBytes(data_bytes)
        << " of tensor data, written by " << part.parts << " processes (" << part.evidence << ")\n";
  } else {
    out << final_path << ": part " << part.rank << " of " << part.parts << " (" << part.evidence
        << "): " << done.files_written << " of " << files << " files, "
        << HumanBytes(done.bytes_written) << " of tensor data; process 0 commits\n";
  }
}

}  // namespace ucp::cli
