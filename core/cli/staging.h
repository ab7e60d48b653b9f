// All-or-nothing output directories for the commands that write checkpoints.
//
// A StagedDirectory is built under a temporary name beside its final path
// (`<parent>/.ucp-tmp-<name>-<pid>`), filled by the caller, and renamed into place by Commit. If
// it is destroyed uncommitted (any failure), the temporary and everything in it is removed, and
// so are the parent directories Create made: a failed command leaves nothing behind.
//
// Thread-safety: one owner; the directory itself may be filled from several threads.
#pragma once

#include <string>
#include <vector>

#include "core/format/atom_index.h"
#include "core/plan/executor.h"
#include "core/util/status.h"

namespace ucp::cli {

// The prefix of every temporary ucp leaves beside its outputs while writing.
inline constexpr std::string_view kTemporaryPrefix = ".ucp-tmp-";

class StagedDirectory {
 public:
  // Creates the parent of `final_path` (and its missing ancestors) and the temporary directory.
  // `final_path` must not end in "/" or name "." or "..".
  static Result<StagedDirectory> Create(std::string final_path);
  // The staging directory of a job (job_part.h), `<parent>/.ucp-tmp-<name>-job-<key>`, shared with
  // the job's other processes: created if missing, reused (not emptied) if present. Only the
  // `owner` removes it when destroyed uncommitted; the others leave it to the owner.
  static Result<StagedDirectory> CreateShared(std::string final_path, std::string_view key,
                                              bool owner);

  StagedDirectory(StagedDirectory&& other) noexcept;
  StagedDirectory& operator=(StagedDirectory&&) = delete;
  StagedDirectory(const StagedDirectory&) = delete;
  StagedDirectory& operator=(const StagedDirectory&) = delete;
  ~StagedDirectory();

  // Where to write.
  const std::string& path() const { return temporary_; }
  const std::string& final_path() const { return final_; }
  const std::string& parent() const { return parent_; }

  // Renames the temporary to the final path and syncs the parent. With `replace`, an existing
  // final path is swapped out atomically (renameat2 RENAME_EXCHANGE where the file system has
  // it) and then removed; without, an existing final path is kFailedPrecondition.
  Status Commit(bool replace);

 private:
  StagedDirectory(std::string final_path, std::string parent, std::string temporary,
                  std::vector<std::string> created)
      : final_(std::move(final_path)),
        parent_(std::move(parent)),
        temporary_(std::move(temporary)),
        created_(std::move(created)) {}
  // Create's work, with the temporary named `<name><suffix>`; `reuse` keeps an existing one.
  static Result<StagedDirectory> Make(std::string final_path, std::string_view suffix, bool reuse);

  std::string final_;
  std::string parent_;
  std::string temporary_;
  std::vector<std::string> created_;  // ancestors Create made, outermost first
  bool committed_ = false;
};

// Checks every file `plan` reads against the sizes and XXH3s of `index` (VerifySources: a
// damaged source is kCorrupt naming the file and, where its CRC-32s tell, the tensors), then
// writes `plan` (over the files of `index` in `tag_dir`) into a StagedDirectory for `final_path`,
// with a progress line for `command` on a terminal, and commits it (an existing `final_path` is
// replaced only with `force`). On failure nothing is left at `final_path` or beside it.
[[nodiscard]] Status ExecuteStaged(const OutputPlan& plan, const AtomIndex& index,
                                   const std::string& tag_dir, const std::string& final_path,
                                   unsigned threads, bool force, std::string_view command);

// kFailedPrecondition "<path> exists (--force replaces it)" when `path` exists and !force: the
// early form of Commit's check, before any work.
[[nodiscard]] Status CheckOutputFree(const std::string& path, bool force);

// `path` without trailing slashes ("/" stays "/").
std::string TrimTrailingSlashes(std::string_view path);

// The parent directory of `path` ("." when it has none) and its last component, with trailing
// slashes ignored.
std::pair<std::string, std::string> SplitPath(std::string_view path);

}  // namespace ucp::cli
