#include "core/tag/file_hashing.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <map>
#include <optional>
#include <thread>

#include "core/io/fault_injection.h"
#include "core/util/reentrancy_guard.h"

namespace ucp {
namespace {

// The newest journal record of every path (records are appended in close order within a file;
// across files the close time decides).
std::map<std::string, JournalRecord> NewestRecords(const std::string& tag_dir) {
  std::map<std::string, JournalRecord> newest;
  Result<JournalContents> journals = ReadTagJournals(tag_dir);
  if (!journals.ok()) return newest;  // no journal (or an unreadable one): hash everything
  for (JournalRecord& record : journals->records) {
    if (record.role != FileRole::kData) continue;
    auto it = newest.find(record.path);
    if (it == newest.end() || it->second.time_ns <= record.time_ns) {
      newest[record.path] = std::move(record);
    }
  }
  return newest;
}

// The journal's digest of `path` when it still describes the file on disk.
std::optional<FileDigest> JournalDigest(const std::map<std::string, JournalRecord>& records,
                                        const std::string& relative, const std::string& path) {
  const auto it = records.find(relative);
  if (it == records.end()) return std::nullopt;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  const int64_t mtime_ns = int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec;
  if (static_cast<uint64_t>(st.st_size) != it->second.size || mtime_ns > it->second.time_ns) {
    return std::nullopt;
  }
  return FileDigest{it->second.size, it->second.xxh3, it->second.chunks};
}

}  // namespace

Result<std::vector<FileDigest>> HashTagFiles(const std::string& tag_dir,
                                             const std::vector<std::string>& relative_paths,
                                             const HashOptions& options) {
  const std::map<std::string, JournalRecord> records =
      options.trust_journal ? NewestRecords(tag_dir) : std::map<std::string, JournalRecord>{};
  std::vector<Result<FileDigest>> results(relative_paths.size(), Status::Internal("not hashed"));
  std::vector<size_t> pending;
  for (size_t i = 0; i < relative_paths.size(); ++i) {
    const std::string path = tag_dir + "/" + relative_paths[i];
    if (std::optional<FileDigest> digest = JournalDigest(records, relative_paths[i], path)) {
      results[i] = *digest;
    } else {
      pending.push_back(i);
    }
  }
  unsigned threads = options.threads;
  if (threads == 0) threads = std::min(std::max(std::thread::hardware_concurrency(), 1u), 8u);
  threads = static_cast<unsigned>(std::min<size_t>(threads, pending.size()));
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k = next.fetch_add(1); k < pending.size(); k = next.fetch_add(1)) {
      const size_t i = pending[k];
      Result<File> file = File::OpenBeneath(tag_dir, relative_paths[i]);
      results[i] = file.ok() ? HashFile(*file) : Result<FileDigest>(file.status());
    }
  };
  std::vector<std::thread> workers;
  for (unsigned t = 1; t < threads; ++t) {
    // Inside the preload these threads do ucp's own I/O, which the hooks must never see or serve;
    // it belongs to the phase that started them.
    workers.emplace_back([&work, phase = CurrentIoPhase()] {
      ReentrancyGuard guard;
      IoPhaseScope phase_scope(phase);
      work();
    });
  }
  work();
  for (std::thread& worker : workers) worker.join();

  std::vector<FileDigest> digests;
  digests.reserve(results.size());
  for (Result<FileDigest>& result : results) {
    if (!result.ok()) return result.status();
    digests.push_back(*result);
  }
  return digests;
}

}  // namespace ucp
