#include "core/tag/save_generation.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/io/fault_injection.h"
#include "core/io/file.h"

namespace ucp {
namespace {

constexpr int kGenerationVersion = 1;
// One short entry per file of the tag; anything larger is not a generation record.
constexpr uint64_t kMaxGenerationBytes = 64ull << 20;

using Json = nlohmann::json;

// When this library was loaded: in a trainer, before it opened any file of a save.
const int64_t kLoadTimeNs = WallClockNs();

}  // namespace

std::string SaveGenerationPath(const std::string& tag_dir) {
  return JournalDirectory(tag_dir) + "/generation.json";
}

std::string NewCommitId() {
  static std::atomic<uint64_t> commits{0};
  return JournalHostName() + "." + std::to_string(::getpid()) + "." +
         std::to_string(commits.fetch_add(1) + 1);
}

SaveBounds BoundsOfThisProcess(std::string commit, std::optional<SaveGeneration> earlier,
                               std::string job) {
  return {std::move(commit), std::move(earlier), JournalHostName(), kLoadTimeNs, std::move(job)};
}

Result<std::optional<SaveGeneration>> ReadSaveGeneration(const std::string& tag_dir) {
  const std::string path = SaveGenerationPath(tag_dir);
  Result<std::string> bytes = ReadSmallFile(path, kMaxGenerationBytes);
  if (!bytes.ok()) {
    if (bytes.status().code() == StatusCode::kNotFound) return std::optional<SaveGeneration>();
    return bytes.status();
  }
  const auto corrupt = [&path](const std::string& what) {
    return Status::Corrupt("save generation: " + path + ": " + what);
  };
  const Json json = Json::parse(*bytes, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) return corrupt("not a JSON object");
  const auto version = json.find("v");
  if (version == json.end() || !version->is_number_integer() ||
      version->get<int64_t>() != kGenerationVersion) {
    return corrupt("\"v\" is not 1");
  }
  const auto commit = json.find("commit");
  if (commit == json.end() || !commit->is_string()) {
    return corrupt("\"commit\" is missing or not a string");
  }
  const auto files = json.find("files");
  if (files == json.end() || !files->is_array()) {
    return corrupt("\"files\" is missing or not an array");
  }
  SaveGeneration generation;
  generation.commit = commit->get<std::string>();
  for (size_t i = 0; i < files->size(); ++i) {
    const Json& file = (*files)[i];
    const std::string where = "\"files\"[" + std::to_string(i) + "]";
    if (!file.is_object()) return corrupt(where + " is not an object");
    const auto path_member = file.find("path");
    if (path_member == file.end() || !path_member->is_string()) {
      return corrupt(where + ".path is missing or not a string");
    }
    FileOnDisk on_disk;
    for (const auto& [key, out] : {std::pair{"size", &on_disk.size}, {"ino", &on_disk.stamp.ino}}) {
      const auto value = file.find(key);
      if (value == file.end() || !value->is_number_unsigned()) {
        return corrupt(where + "." + key + " is missing or not a non-negative integer");
      }
      *out = value->get<uint64_t>();
    }
    const auto mtime = file.find("mtime_ns");
    if (mtime == file.end() || !mtime->is_number_integer()) {
      return corrupt(where + ".mtime_ns is missing or not an integer");
    }
    on_disk.stamp.mtime_ns = mtime->get<int64_t>();
    generation.files[path_member->get<std::string>()] = on_disk;
  }
  return std::optional<SaveGeneration>(std::move(generation));
}

Status WriteSaveGeneration(const std::string& tag_dir, const SaveGeneration& generation) {
  nlohmann::ordered_json json;
  json["v"] = kGenerationVersion;
  json["commit"] = generation.commit;
  json["files"] = nlohmann::ordered_json::array();
  for (const auto& [path, on_disk] : generation.files) {
    nlohmann::ordered_json file;
    file["path"] = path;
    file["size"] = on_disk.size;
    file["ino"] = on_disk.stamp.ino;
    file["mtime_ns"] = on_disk.stamp.mtime_ns;
    json["files"].push_back(std::move(file));
  }
  std::string text;
  try {
    text = json.dump() + "\n";
  } catch (const std::exception& error) {
    return Status::InvalidArgument("save generation: " + tag_dir + ": " + error.what());
  }
  IoPhaseScope phase(IoPhase::kJournal);
  // Under UCP_DURABLE the durable commit and the index builder both record the commit: the
  // second finds it recorded and writes nothing (one small read instead of a write and fsyncs).
  if (const Result<std::string> recorded =
          ReadSmallFile(SaveGenerationPath(tag_dir), text.size() + 1);
      recorded.ok() && *recorded == text) {
    return Status::Ok();
  }
  UCP_RETURN_IF_ERROR(CreateDirectories(JournalDirectory(tag_dir)));
  return WriteFileAtomically(SaveGenerationPath(tag_dir), text);
}

SaveFiles MatchSave(const std::vector<JournalRecord>& records,
                    const std::vector<std::string>& expected, const SaveBounds& bounds,
                    const FileOnDiskLookup& on_disk) {
  // A file whose closes disagree on its bytes is closed all the same: the index build hashes it
  // from disk (JournalDigests trusts no such record).
  const auto on_disk_now = ClosesOnDisk(records, on_disk, /*keep_ambiguous=*/true);
  const std::optional<SaveGeneration>& earlier = bounds.earlier;
  const bool exclude_earlier = earlier && earlier->commit != bounds.commit;
  SaveFiles save;
  for (const std::string& path : expected) {
    const auto close = on_disk_now.find(path);
    bool this_save = close != on_disk_now.end();
    if (this_save) {
      const JournalRecord& record = *close->second;
      const bool left_by_earlier_run =
          (!bounds.host.empty() && record.host == bounds.host &&
           record.time_ns < bounds.host_start_ns) ||
          (!bounds.job.empty() && !record.job.empty() && record.job != bounds.job);
      bool of_earlier_commit = false;
      if (exclude_earlier) {
        const auto before = earlier->files.find(path);
        of_earlier_commit = before != earlier->files.end() &&
                            before->second == FileOnDisk{record.size, *record.stamp};
      }
      this_save = !left_by_earlier_run && !of_earlier_commit;
    }
    if (this_save) {
      save.closes.emplace(path, close->second);
    } else {
      save.missing.push_back(path);
    }
  }
  return save;
}

SaveGeneration GenerationOf(const std::string& commit,
                            const std::unordered_map<std::string, const JournalRecord*>& closes) {
  SaveGeneration generation{commit, {}};
  for (const auto& [path, record] : closes) {
    generation.files[path] = FileOnDisk{record->size, *record->stamp};  // closes on disk have one
  }
  return generation;
}

}  // namespace ucp
