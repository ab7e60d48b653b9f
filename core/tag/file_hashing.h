// Hashing the files of a tag: XXH3-64 of whole files, in parallel, reusing the save journals.
//
// Thread-safety: HashTagFiles runs its own worker threads and returns after they finished.
#pragma once

#include <string>
#include <vector>

#include "core/tag/journal.h"
#include "core/util/status.h"

namespace ucp {

struct HashOptions {
  // Worker threads (0: min(hardware threads, 8)); never more than there are files.
  unsigned threads = 0;
  // Take a file's hash from the tag's journals (<tag>/.ucp/journal.*.jsonl) when a close record
  // describes the file's bytes on disk now: the same size, inode and mtime (ClosesOnDisk).
  bool trust_journal = true;
};

// Size and XXH3-64 of every file `relative_paths` names under `tag_dir`, in the same order. Each
// file is opened with File::OpenBeneath (never outside tag_dir) and read to its end through a
// bounded buffer (journal.h's HashFile). The first failure (in path order) is returned, naming
// the file.
[[nodiscard]] Result<std::vector<FileDigest>> HashTagFiles(
    const std::string& tag_dir, const std::vector<std::string>& relative_paths,
    const HashOptions& options);

}  // namespace ucp
