#include "core/tag/file_hashing.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <string_view>
#include <thread>
#include <utility>

#include "core/io/fault_injection.h"
#include "core/util/reentrancy_guard.h"

namespace ucp {
namespace {

// The journal's digest of each file whose close record describes its bytes on disk now (the same
// size, inode and mtime): equality only, so the clocks of the node that wrote the record and of
// the file system never meet. Not of a file that another process also closed at that inode: two
// writers of one file (DeepSpeed's folded AutoEP saves write some expert files from two ranks at
// once) can leave bytes that are neither's, while each record hashes what its writer wrote. Such
// a file is hashed from disk.
std::map<std::string, FileDigest> JournalDigests(const std::string& tag_dir) {
  std::map<std::string, FileDigest> digests;
  Result<JournalContents> journals = ReadTagJournals(tag_dir);
  if (!journals.ok()) return digests;  // no journal (or an unreadable one): hash everything
  // One pass over the records: the first writer of each (path, inode), and those written by more.
  std::map<std::pair<std::string_view, uint64_t>, const JournalRecord*> first_writer;
  std::set<std::pair<std::string_view, uint64_t>> several_writers;
  for (const JournalRecord& record : journals->records) {
    if (!record.stamp) continue;
    const std::pair<std::string_view, uint64_t> file{record.path, record.stamp->ino};
    const auto [first, added] = first_writer.emplace(file, &record);
    if (!added && (first->second->pid != record.pid || first->second->host != record.host)) {
      several_writers.insert(file);
    }
  }
  for (const auto& close : ClosesOnDisk(journals->records, TagFilesOnDisk(tag_dir))) {
    const JournalRecord* record = close.second;
    if (several_writers.contains({close.first, record->stamp->ino})) continue;
    digests[close.first] = FileDigest{record->size, record->xxh3, record->chunks};
  }
  return digests;
}

}  // namespace

Result<std::vector<FileDigest>> HashTagFiles(const std::string& tag_dir,
                                             const std::vector<std::string>& relative_paths,
                                             const HashOptions& options) {
  const std::map<std::string, FileDigest> journaled =
      options.trust_journal ? JournalDigests(tag_dir) : std::map<std::string, FileDigest>{};
  std::vector<Result<FileDigest>> results(relative_paths.size(), Status::Internal("not hashed"));
  std::vector<size_t> pending;
  for (size_t i = 0; i < relative_paths.size(); ++i) {
    if (const auto digest = journaled.find(relative_paths[i]); digest != journaled.end()) {
      results[i] = digest->second;
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
