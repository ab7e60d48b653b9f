// `ucp verify TAGDIR`: every file the tag's saved index lists, re-hashed and compared. With an
// atoms store, framework files may be missing (removed after the store was made): the store's
// files must match.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <iostream>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "core/cli/commands.h"
#include "core/cli/staging.h"
#include "core/cli/tag.h"
#include "core/cli/terminal.h"
#include "core/tag/journal.h"
#include "core/tag/source_check.h"

namespace ucp::cli {
namespace {

struct VerifyOptions {
  std::string tag_dir;
  unsigned threads = 0;
};

std::string Hex64(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

// The byte ranges [begin, end) of the chunks whose hashes differ from the index's, consecutive
// chunks merged; none when the index has no chunk hashes of the file, or of another chunk size.
std::vector<std::pair<uint64_t, uint64_t>> DifferingChunks(const ChunkHashes& found,
                                                           const ChunkHashes& indexed,
                                                           uint64_t size) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  if (!indexed.recorded() || found.chunk_bytes != indexed.chunk_bytes ||
      found.hashes.size() != indexed.hashes.size()) {
    return ranges;
  }
  for (size_t c = 0; c < found.hashes.size(); ++c) {
    if (found.hashes[c] == indexed.hashes[c]) continue;
    const uint64_t begin = c * found.chunk_bytes;
    const uint64_t end = std::min(size, begin + found.chunk_bytes);
    if (!ranges.empty() && ranges.back().second == begin) {
      ranges.back().second = end;
    } else {
      ranges.emplace_back(begin, end);
    }
  }
  return ranges;
}

// "" when file `f` of `index` matches, else what differs: where the index has chunk hashes, the
// byte ranges that differ, and where the archive's CRC-32s tell, which records and tensors.
std::string Check(const std::string& dir, const AtomIndex& index, uint32_t f) {
  const IndexedFile& file = index.files()[f];
  Result<File> opened = File::OpenBeneath(dir, file.path);
  Result<FileDigest> digest = opened.ok() ? HashFile(*opened) : Result<FileDigest>(opened.status());
  if (!digest.ok()) {
    if (digest.status().code() == StatusCode::kNotFound) return "missing";
    return "unreadable: " + digest.status().message();
  }
  std::string differs;
  if (digest->size != file.size) {
    differs = "size " + std::to_string(digest->size) + ", index says " + std::to_string(file.size);
  } else if (digest->xxh3 != file.xxh3) {
    differs = "xxh3 " + Hex64(digest->xxh3) + ", index says " + Hex64(file.xxh3);
  } else {
    return "";
  }
  const auto ranges = DifferingChunks(digest->chunks, file.chunks, digest->size);
  if (ranges.empty()) {
    const std::string where = LocateDamage(index, f, dir);
    return where.empty() ? differs : differs + ": " + where;
  }
  differs += "; differing bytes:";
  for (size_t r = 0; r < ranges.size(); ++r) {
    const auto [begin, end] = ranges[r];
    differs += std::string(r == 0 ? " [" : ", [") + std::to_string(begin) + ", " +
               std::to_string(end) + ")";
    const std::string where = LocateDamage(index, f, dir, begin, end);
    if (!where.empty()) differs += " (" + where + ")";
  }
  return differs;
}

int RunVerify(const VerifyOptions& options) {
  constexpr std::string_view kCommand = "verify";
  const std::string dir = TrimTrailingSlashes(options.tag_dir);
  Result<AtomIndex> index = AtomIndex::Read(IndexPath(dir));
  if (!index.ok()) {
    return PrintError(kCommand, index.status().WithContext("no usable index (ucp index writes it)"),
                      kExitInput);
  }
  const std::vector<IndexedFile>& files = index->files();
  std::vector<std::string> problems(files.size());
  const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
  const unsigned threads =
      std::clamp<unsigned>(options.threads != 0 ? options.threads : std::min(hardware, 8u), 1,
                           static_cast<unsigned>(std::max<size_t>(files.size(), 1)));
  std::atomic<size_t> next{0};
  std::vector<std::thread> workers;
  for (unsigned t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      for (size_t i = next++; i < files.size(); i = next++)
        problems[i] = Check(dir, *index, static_cast<uint32_t>(i));
    });
  }
  for (std::thread& worker : workers) worker.join();

  // A framework file may be removed once the atoms store holds the tag (UCP_MODE=atoms): the
  // store's own files are then what must match.
  const bool has_store = index->contents().store.has_value();
  size_t bad = 0;
  size_t removed = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    if (has_store && !AtomIndex::IsStoreFile(files[i]) && problems[i] == "missing") {
      ++removed;
      std::cout << files[i].path << ": removed (the atoms store holds its state)\n";
      continue;
    }
    bytes += files[i].size;
    if (problems[i].empty()) continue;
    ++bad;
    std::cout << files[i].path << ": " << problems[i] << "\n";
  }
  if (bad != 0) {
    std::cerr << "ucp verify: " << bad << " of " << files.size() - removed
              << " files differ from the index of " << dir << "\n";
    return kExitMismatch;
  }
  std::cout << dir << ": " << files.size() - removed << " files (" << HumanBytes(bytes)
            << ") match the index";
  if (removed != 0) std::cout << "; " << removed << " removed, served from the atoms store";
  std::cout << "\n";
  return kExitOk;
}

}  // namespace

void AddVerifyCommand(CLI::App& app, Run* run) {
  auto options = std::make_shared<VerifyOptions>();
  CLI::App* command =
      app.add_subcommand("verify", "Re-hash the files of a tag against its saved index");
  command->add_option("tagdir", options->tag_dir, "the tag directory, e.g. ckpt/global_step5")
      ->required();
  command->add_option("--threads", options->threads, "hashing threads (0: up to 8)");
  command->callback([options, run] { *run = [options] { return RunVerify(*options); }; });
}

}  // namespace ucp::cli
