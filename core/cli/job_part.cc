#include "core/cli/job_part.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <map>
#include <numeric>
#include <span>
#include <thread>
#include <utility>

#include "core/cli/staging.h"
#include "core/cli/terminal.h"
#include "core/io/file.h"
#include "core/tag/source_check.h"
#include "core/util/xxh3.h"

namespace ucp::cli {
namespace {

// The staging directory's key: what the job writes, from what, in how many parts, with files
// divided as parts of what size.
std::string JobKey(const std::vector<PlannedOutput>& outputs, const AtomIndex& index,
                   uint32_t parts, uint64_t part_kib) {
  std::string text = std::to_string(parts) + " " + std::to_string(part_kib) + "\n";
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

// An output divided as parts is no process's file.
constexpr uint32_t kNoProcess = std::numeric_limits<uint32_t>::max();
// A marker: a line per storage piece its process's parts wrote, about 60 bytes each.
constexpr uint64_t kMaxMarkerBytes = uint64_t{64} << 20;

// Where the parts of the archive at `path` (relative) are written in the staging directory.
std::string PartsPath(const std::string& staged, const std::string& path) {
  const std::filesystem::path relative(path);
  const std::string parent = relative.parent_path().string();
  return staged + "/" + (parent.empty() ? "" : parent + "/") + "." + relative.filename().string() +
         ".parts";
}

// The job's work: every output whole, but archives divided as parts (one unit per part), and
// which process does each unit.
struct JobWork {
  struct Unit {
    size_t output = 0;           // index into the outputs (archives first: the archive's index)
    std::optional<size_t> part;  // of a divided archive
  };
  std::vector<Unit> units;  // in output order, a divided archive's parts in order
  std::vector<uint32_t> owners;
  std::map<size_t, std::vector<ArchivePart>> parts;  // archive index → its parts
};

Result<JobWork> DivideJob(const OutputPlan& plan, const std::vector<PlannedOutput>& outputs,
                          uint32_t processes, uint64_t part_bytes) {
  JobWork work;
  std::vector<uint64_t> weights;
  for (size_t o = 0; o < outputs.size(); ++o) {
    if (o < plan.archives.size()) {
      UCP_ASSIGN_OR_RETURN(std::vector<ArchivePart> parts,
                           PlanArchiveParts(plan.archives[o], part_bytes));
      if (parts.size() > 1) {
        for (size_t k = 0; k < parts.size(); ++k) {
          work.units.push_back({o, k});
          weights.push_back(parts[k].end - parts[k].begin);
        }
        work.parts[o] = std::move(parts);
        continue;
      }
    }
    work.units.push_back({o, std::nullopt});
    weights.push_back(outputs[o].weight);
  }
  work.owners = DivideWork(weights, processes);
  return work;
}

// Completes every archive of `divided` in `staged` from the pieces its parts wrote (`pieces`:
// "<archive path>\t<piece>" lines, from every process).
Status CompleteDividedArchives(const OutputPlan& divided, const std::string& pieces,
                               const std::string& staged, const ExecuteOptions& options) {
  std::map<std::string, std::string> by_archive;  // path → its pieces' lines
  for (size_t at = 0; at < pieces.size();) {
    const size_t end = std::min(pieces.find('\n', at), pieces.size());
    const std::string line = pieces.substr(at, end - at);
    const size_t tab = line.find('\t');
    if (tab == std::string::npos) {
      return Status::Corrupt("job: a part's marker line \"" + line.substr(0, 200) +
                             "\" is not \"<archive>\\t<piece>\"");
    }
    by_archive[line.substr(0, tab)] += line.substr(tab + 1) + "\n";
    at = end + 1;
  }
  for (const ArchiveOutput& archive : divided.archives) {
    UCP_ASSIGN_OR_RETURN(const std::vector<StoragePieceCrc> crcs,
                         ParsePieceCrcs(by_archive[archive.path], "job: the parts' markers"));
    UCP_RETURN_IF_ERROR(
        FinishArchiveParts(archive, crcs, PartsPath(staged, archive.path), staged, options));
  }
  return Status::Ok();
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

std::vector<uint32_t> DivideWork(const std::vector<uint64_t>& weights, uint32_t parts) {
  std::vector<size_t> order(weights.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&weights](size_t a, size_t b) { return weights[a] > weights[b]; });
  std::vector<uint64_t> load(std::max(parts, 1u), 0);
  std::vector<uint32_t> owners(weights.size(), 0);
  for (const size_t i : order) {
    const uint32_t lightest =
        static_cast<uint32_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owners[i] = lightest;
    load[lightest] += std::max<uint64_t>(weights[i], 1);
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
                                     const JobOptions& options) {
  UCP_ASSIGN_OR_RETURN(const std::vector<PlannedOutput> outputs, ListOutputs(plan, index));
  UCP_ASSIGN_OR_RETURN(const JobWork work,
                       DivideJob(plan, outputs, part.parts, options.part_kib << 10));
  // The divided archives leave the plan, in work.parts' order: no process's file.
  OutputPlan divided;
  std::map<size_t, const ArchiveOutput*> divided_of;  // archive index → it, in `divided`
  for (const auto& [a, parts] : work.parts) divided.archives.push_back(std::move(plan.archives[a]));
  {
    size_t d = 0;
    for (const auto& [a, parts] : work.parts) divided_of[a] = &divided.archives[d++];
  }
  std::vector<uint32_t> file_owners;  // per output
  bool writes_parts = false;
  for (size_t u = 0; u < work.units.size(); ++u) {
    const JobWork::Unit& unit = work.units[u];
    if (!unit.part) file_owners.push_back(work.owners[u]);
    if (unit.part == 0) file_owners.push_back(kNoProcess);
    writes_parts = writes_parts || (unit.part && work.owners[u] == part.rank);
  }
  const OutputPlan share = ShareOf(std::move(plan), file_owners, part.rank);
  UCP_RETURN_IF_ERROR(CheckSourcesBeforeReading(index, share, tag_dir, "source check"));
  if (writes_parts) {
    UCP_RETURN_IF_ERROR(CheckSourcesBeforeReading(index, divided, tag_dir, "source check"));
  }
  const bool owner = part.rank == 0;
  UCP_ASSIGN_OR_RETURN(
      StagedDirectory staged,
      StagedDirectory::CreateShared(final_path,
                                    JobKey(outputs, index, part.parts, options.part_kib), owner));
  ExecuteOptions execute;
  execute.threads = threads;
  execute.locate_damage = LocateDamageWith(index, tag_dir);
  UCP_RETURN_IF_ERROR(ExecutePlan(share, index, tag_dir, staged.path(), execute));
  JobPartResult result;
  result.files_written =
      share.archives.size() + share.safetensors.size() + share.copies.size() + share.texts.size();
  result.bytes_written = share.DataBytes();
  // This process's parts, and the CRC-32s of what they wrote: "<archive path>\t<piece>" lines.
  std::string pieces;
  for (size_t u = 0; u < work.units.size(); ++u) {
    const JobWork::Unit& unit = work.units[u];
    if (!unit.part || work.owners[u] != part.rank) continue;
    const ArchiveOutput& archive = *divided_of.at(unit.output);
    const ArchivePart& piece_of = work.parts.at(unit.output)[*unit.part];
    const std::string parts_path = PartsPath(staged.path(), archive.path);
    UCP_RETURN_IF_ERROR(
        CreateDirectories(std::filesystem::path(parts_path).parent_path().string()));
    UCP_ASSIGN_OR_RETURN(
        const std::vector<StoragePieceCrc> written,
        ExecuteArchivePart(archive, piece_of, index, tag_dir, parts_path, execute));
    for (const StoragePieceCrc& crc : written) {
      pieces += archive.path + "\t" + PieceCrcsText(std::span(&crc, 1));
    }
    ++result.parts_written;
    result.bytes_written += piece_of.end - piece_of.begin;
  }
  if (!owner) {
    UCP_RETURN_IF_ERROR(
        WriteFileAtomically(PartMarker(staged.path(), part.rank, part.parts),
                            std::to_string(result.files_written) + " files\n" + pieces,
                            /*sync=*/true));
    return result;
  }

  // Every other part's marker, then every file: a part that marked itself done without a file
  // of its share is a fault, not something to wait for.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(options.wait_seconds);
  auto pause = std::chrono::milliseconds(1);
  for (uint32_t other = 1; other < part.parts; ++other) {
    struct stat st;
    while (::stat(PartMarker(staged.path(), other, part.parts).c_str(), &st) != 0) {
      if (std::chrono::steady_clock::now() >= deadline) {
        return Status::FailedPrecondition(
            "job of " + std::to_string(part.parts) + " processes: part " + std::to_string(other) +
            " did not finish its share within " + std::to_string(options.wait_seconds) + " s");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
    }
    UCP_ASSIGN_OR_RETURN(
        const std::string marker,
        ReadSmallFile(PartMarker(staged.path(), other, part.parts), kMaxMarkerBytes));
    pieces += marker.substr(std::min(marker.find('\n') + 1, marker.size()));
  }
  UCP_RETURN_IF_ERROR(CompleteDividedArchives(divided, pieces, staged.path(), execute));
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

void AddJobOptions(CLI::App& command, JobOptions& options) {
  command.add_flag("--job", options.enabled,
                   "one process of a job under a launcher (RANK/WORLD_SIZE, ...): write this "
                   "process's share; process 0 commits once every file is there");
  command.add_option("--job-wait", options.wait_seconds,
                     "--job: seconds process 0 waits for the others' files (default 1800)");
  command
      .add_option("--job-part-kb", options.part_kib,
                  "--job: a file of at least twice this many KiB of tensor data is divided as "
                  "parts of at least this size (default 1048576, 1 GiB)")
      ->check(CLI::Range(uint64_t{4}, uint64_t{1} << 30));
}

void PrintJobPart(std::ostream& out, const std::string& final_path, const std::string& what,
                  const JobPart& part, const JobPartResult& done, size_t files,
                  uint64_t data_bytes) {
  if (done.committed) {
    out << final_path << ": " << what << ", " << files << " files, " << HumanBytes(data_bytes)
        << " of tensor data, written by " << part.parts << " processes (" << part.evidence << ")\n";
  } else {
    out << final_path << ": part " << part.rank << " of " << part.parts << " (" << part.evidence
        << "): " << done.files_written << " of " << files << " files"
        << (done.parts_written > 0
                ? ", " + std::to_string(done.parts_written) + " parts of divided files"
                : std::string())
        << ", " << HumanBytes(done.bytes_written) << " of tensor data; process 0 commits\n";
  }
}

}  // namespace ucp::cli
