#include "core/tag/journal.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <span>
#include <unordered_set>

#include "core/io/fault_injection.h"
#include "core/util/chunked_xxh3.h"
#include "core/util/xxh3.h"

namespace ucp {
namespace {

constexpr int kRecordVersion = 1;
// Journals hold one short line per file; anything larger is not a journal.
constexpr uint64_t kMaxJournalBytes = 64ull << 20;

using Json = nlohmann::json;

std::string ThisProcessJournalName() {
  return "journal." + JournalHostName() + "." + std::to_string(::getpid()) + ".jsonl";
}

// The host of journal file name "journal.<host>.<pid>.jsonl" (the host may hold dots); empty for
// any other name.
std::string HostOfJournalName(std::string_view name) {
  constexpr std::string_view kPrefix = "journal.", kSuffix = ".jsonl";
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix)) return "";
  name = name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  const size_t dot = name.rfind('.');
  if (dot == std::string_view::npos || dot == 0) return "";
  return std::string(name.substr(0, dot));
}

Result<std::string> ReadWholeFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return PosixError("journal: open " + path, errno);
  std::string bytes;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return PosixError("journal: read " + path, err);
    }
    if (n == 0) break;
    if (bytes.size() + static_cast<size_t>(n) > kMaxJournalBytes) {
      ::close(fd);
      return Status::OutOfRange("journal: " + path + ": larger than " +
                                std::to_string(kMaxJournalBytes) + " bytes");
    }
    bytes.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return bytes;
}

Result<JournalRecord> DecodeRecord(std::string_view line) {
  const Json json = Json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return Status::Corrupt("not JSON");
  if (!json.is_object()) return Status::Corrupt("not a JSON object");
  auto member = [&json](const char* key) -> const Json* {
    const auto it = json.find(key);
    return it == json.end() ? nullptr : &*it;
  };
  const Json* version = member("v");
  if (version == nullptr || !version->is_number_integer() ||
      version->get<int64_t>() != kRecordVersion) {
    return Status::Corrupt("\"v\" is not 1");
  }
  JournalRecord record;
  auto string_member = [&](const char* key, std::string* out) -> Status {
    const Json* value = member(key);
    if (value == nullptr || !value->is_string()) {
      return Status::Corrupt(std::string("\"") + key + "\" is missing or not a string");
    }
    *out = value->get<std::string>();
    return Status::Ok();
  };
  auto integer_member = [&](const char* key, int64_t* out) -> Status {
    const Json* value = member(key);
    if (value == nullptr || !value->is_number_integer()) {
      return Status::Corrupt(std::string("\"") + key + "\" is missing or not an integer");
    }
    *out = value->get<int64_t>();
    return Status::Ok();
  };
  UCP_RETURN_IF_ERROR(string_member("path", &record.path));
  if (record.path.empty() || record.path[0] == '/') {
    return Status::Corrupt("\"path\" is empty or absolute");
  }
  const Json* size = member("size");
  if (size == nullptr || !size->is_number_unsigned()) {
    return Status::Corrupt("\"size\" is missing or not a non-negative integer");
  }
  record.size = size->get<uint64_t>();
  std::string hash;
  UCP_RETURN_IF_ERROR(string_member("xxh3", &hash));
  UCP_ASSIGN_OR_RETURN(record.xxh3, ParseXxh3(hash));
  UCP_RETURN_IF_ERROR(integer_member("rank", &record.rank));
  UCP_RETURN_IF_ERROR(integer_member("pid", &record.pid));
  UCP_RETURN_IF_ERROR(integer_member("time_ns", &record.time_ns));
  UCP_RETURN_IF_ERROR(string_member("framework", &record.framework));
  std::string role;
  UCP_RETURN_IF_ERROR(string_member("role", &role));
  if (role == FileRoleName(FileRole::kData)) {
    record.role = FileRole::kData;
  } else if (role == FileRoleName(FileRole::kCommitSignal)) {
    record.role = FileRole::kCommitSignal;
  } else {
    return Status::Corrupt("\"role\" is neither \"data\" nor \"commit\"");
  }
  if (const Json* durable = member("durable"); durable != nullptr) {
    if (!durable->is_boolean()) return Status::Corrupt("\"durable\" is not a boolean");
    record.durable = durable->get<bool>();
  }
  UCP_ASSIGN_OR_RETURN(record.chunks, ChunkHashesFromJson(json, record.size));
  const Json* ino = member("ino");
  const Json* mtime = member("mtime_ns");
  if ((ino == nullptr) != (mtime == nullptr)) {
    return Status::Corrupt("\"ino\" and \"mtime_ns\" come together");
  }
  if (ino != nullptr) {
    if (!ino->is_number_unsigned()) return Status::Corrupt("\"ino\" is not a non-negative integer");
    if (!mtime->is_number_integer()) return Status::Corrupt("\"mtime_ns\" is not an integer");
    record.stamp = FileStamp{ino->get<uint64_t>(), mtime->get<int64_t>()};
  }
  if (const Json* job = member("job"); job != nullptr) {
    if (!job->is_string()) return Status::Corrupt("\"job\" is not a string");
    record.job = job->get<std::string>();
  }
  return record;
}

}  // namespace

std::string JournalDirectory(std::string_view tag_dir) { return std::string(tag_dir) + "/.ucp"; }

int64_t WallClockNs() {
  struct timespec now {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  return int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
}

std::string JournalHostName() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') {
    std::snprintf(host, sizeof(host), "unknown");
  }
  // A '/' in a host name would leave the directory.
  std::replace(host, host + std::strlen(host), '/', '_');
  return host;
}

std::string FormatXxh3(uint64_t hash) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(hash));
  return std::string(text, 16);
}

Result<uint64_t> ParseXxh3(std::string_view text) {
  if (text.size() != 16) return Status::Corrupt("xxh3 is not 16 hex digits");
  uint64_t value = 0;
  for (const char c : text) {
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      return Status::Corrupt("xxh3 is not 16 lowercase hex digits");
    }
    value = (value << 4) | static_cast<uint64_t>(digit);
  }
  return value;
}

int64_t LauncherRank() {
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    char* end = nullptr;
    errno = 0;
    const long long rank = std::strtoll(value, &end, 10);
    if (errno == 0 && *end == '\0' && rank >= 0) return rank;
  }
  return -1;
}

std::string LauncherJob() {
  // Printable ASCII only: the id goes into a JSON line, which must be valid UTF-8, and a close
  // record that cannot be written would lose the close.
  const auto value = [](const char* name) -> std::string {
    const char* text = std::getenv(name);
    std::string out = text == nullptr ? "" : text;
    for (char& c : out) {
      if (c < 0x20 || c > 0x7e) c = '?';
    }
    return out;
  };
  std::string job;
  const auto add = [&job](const std::string& launcher, const std::string& id) {
    job += (job.empty() ? "" : ";") + launcher + "=" + id;
  };
  if (const std::string slurm = value("SLURM_JOB_ID"); !slurm.empty()) {
    // The step tells two sruns of one allocation apart; the restart count a requeued job's runs.
    add("slurm", slurm + "." + value("SLURM_STEP_ID") + "." + value("SLURM_RESTART_COUNT"));
  }
  if (const std::string pmix = value("PMIX_NAMESPACE"); !pmix.empty()) add("pmix", pmix);
  if (const std::string run = value("TORCHELASTIC_RUN_ID"); !run.empty()) {
    // torchrun keeps the run id when it restarts its workers, and counts the restarts.
    add("torchelastic", run + "." + value("TORCHELASTIC_RESTART_COUNT"));
  }
  return job;
}

Result<std::string> EncodeJournalRecord(const JournalRecord& record) {
  if (record.path.empty() || record.path[0] == '/') {
    return Status::InvalidArgument("journal: record path \"" + record.path +
                                   "\" is empty or absolute");
  }
  try {
    // An ordered_json keeps the members in the order of the spec, for people reading journals.
    nlohmann::ordered_json json;
    json["v"] = kRecordVersion;
    json["path"] = record.path;
    json["size"] = record.size;
    json["xxh3"] = FormatXxh3(record.xxh3);
    json["rank"] = record.rank;
    json["pid"] = record.pid;
    json["time_ns"] = record.time_ns;
    json["framework"] = record.framework;
    json["role"] = FileRoleName(record.role);
    if (record.durable) json["durable"] = true;
    PutChunkHashes(record.chunks, json);
    if (record.stamp) {
      json["ino"] = record.stamp->ino;
      json["mtime_ns"] = record.stamp->mtime_ns;
    }
    if (!record.job.empty()) json["job"] = record.job;
    return json.dump() + "\n";
  } catch (const std::exception& error) {
    return Status::InvalidArgument("journal: record for \"" + record.path + "\": " + error.what());
  }
}

Status AppendJournalRecord(std::string_view tag_dir, const JournalRecord& record) {
  IoPhaseScope phase(IoPhase::kJournal);
  UCP_ASSIGN_OR_RETURN(const std::string line, EncodeJournalRecord(record));
  const std::string dir = JournalDirectory(tag_dir);
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return PosixError("journal: mkdir " + dir, errno);
  }
  const std::string path = dir + "/" + ThisProcessJournalName();
  // Only this process appends to its journal, and only under this lock, so the size before the
  // append is where the line starts: a failure part-way (a full disk) cuts the line off again
  // rather than leave a torn line that a later record would make the middle of the file.
  static std::mutex append_mutex;
  std::lock_guard<std::mutex> lock(append_mutex);
  UCP_ASSIGN_OR_RETURN(File file, File::Open(path, File::Mode::kAppend));
  UCP_ASSIGN_OR_RETURN(const uint64_t start, file.Size());
  const Status status = file.Append(std::as_bytes(std::span(line.data(), line.size())));
  if (!status.ok()) {
    const Status cut = file.Truncate(start);
    return Status(status.code(),
                  "journal: " + status.message() + (cut.ok() ? "" : "; then " + cut.message()));
  }
  return file.Close();
}

Result<JournalContents> ParseJournal(std::string_view name, std::string_view bytes) {
  JournalContents contents;
  size_t line_number = 0;
  size_t start = 0;
  while (start < bytes.size()) {
    ++line_number;
    const size_t end = bytes.find('\n', start);
    if (end == std::string_view::npos) {
      contents.warnings.push_back("journal: " + std::string(name) + ": line " +
                                  std::to_string(line_number) +
                                  ": torn last line (no newline) skipped");
      break;
    }
    auto record = DecodeRecord(bytes.substr(start, end - start));
    if (!record.ok()) {
      return Status::Corrupt("journal: " + std::string(name) + ": line " +
                             std::to_string(line_number) + ": " + record.status().message());
    }
    contents.records.push_back(std::move(record).value());
    start = end + 1;
  }
  return contents;
}

Result<FileDigest> HashFile(const File& file) {
  constexpr size_t kChunk = 1 << 20;
  std::unique_ptr<std::byte[]> buffer(new (std::nothrow) std::byte[kChunk]);
  if (buffer == nullptr) return Status::Internal("hash: " + file.path() + ": out of memory");
  ChunkedXxh3 hash;
  for (;;) {
    UCP_ASSIGN_OR_RETURN(const size_t n,
                         file.ReadSomeAt(hash.size(), std::span(buffer.get(), kChunk)));
    if (n == 0) break;
    hash.Update(buffer.get(), n);
  }
  return FileDigest{hash.size(), hash.Whole(), hash.Chunks()};
}

Result<FileDigest> HashFile(const std::string& path) {
  UCP_ASSIGN_OR_RETURN(const File file, File::Open(path, File::Mode::kRead));
  return HashFile(file);
}

FileOnDisk FileOnDiskOf(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_size),
          {static_cast<uint64_t>(st.st_ino),
           int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec}};
}

std::optional<FileOnDisk> StatFileOnDisk(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return FileOnDiskOf(st);
}

std::unordered_map<std::string, const JournalRecord*> ClosesOnDisk(
    const std::vector<JournalRecord>& records, const FileOnDiskLookup& on_disk,
    bool keep_ambiguous) {
  std::unordered_map<std::string, std::optional<FileOnDisk>> disk;
  std::unordered_map<std::string, const JournalRecord*> closes;
  std::unordered_set<std::string_view> ambiguous;
  for (const JournalRecord& record : records) {
    if (record.role != FileRole::kData || record.durable || !record.stamp) continue;
    auto [known, fresh] = disk.try_emplace(record.path);
    if (fresh) known->second = on_disk(record.path);
    if (known->second != FileOnDisk{record.size, *record.stamp}) continue;
    const auto [match, first] = closes.try_emplace(record.path, &record);
    if (!first && match->second->xxh3 != record.xxh3) ambiguous.insert(known->first);
  }
  if (keep_ambiguous) return closes;
  for (const std::string_view path : ambiguous) closes.erase(std::string(path));
  return closes;
}

FileOnDiskLookup TagFilesOnDisk(const std::string& tag_dir) {
  return [tag_dir](const std::string& path) { return StatFileOnDisk(tag_dir + "/" + path); };
}

Result<JournalContents> ReadJournal(const std::string& path) {
  UCP_ASSIGN_OR_RETURN(const std::string bytes, ReadWholeFile(path));
  UCP_ASSIGN_OR_RETURN(JournalContents contents, ParseJournal(path, bytes));
  const size_t slash = path.rfind('/');
  const std::string host =
      HostOfJournalName(slash == std::string::npos ? path : path.substr(slash + 1));
  for (JournalRecord& record : contents.records) record.host = host;
  return contents;
}

Result<JournalContents> ReadTagJournals(std::string_view tag_dir) {
  const std::string dir = JournalDirectory(tag_dir);
  DIR* stream = ::opendir(dir.c_str());
  if (stream == nullptr) return PosixError("journal: opendir " + dir, errno);
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(stream)) {
    const std::string_view entry_name = entry->d_name;
    if (entry_name.starts_with("journal.") && entry_name.ends_with(".jsonl")) {
      names.emplace_back(entry_name);
    }
  }
  ::closedir(stream);
  std::sort(names.begin(), names.end());
  JournalContents all;
  for (const std::string& entry_name : names) {
    UCP_ASSIGN_OR_RETURN(JournalContents one, ReadJournal(dir + "/" + entry_name));
    std::move(one.records.begin(), one.records.end(), std::back_inserter(all.records));
    std::move(one.warnings.begin(), one.warnings.end(), std::back_inserter(all.warnings));
  }
  return all;
}

}  // namespace ucp
