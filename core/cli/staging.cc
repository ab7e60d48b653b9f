#include "core/cli/staging.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <system_error>

#include "core/cli/terminal.h"
#include "core/io/file.h"
#include "core/tag/source_check.h"

namespace ucp::cli {
namespace {

std::string TemporaryName(const std::string& parent, const std::string& name,
                          std::string_view suffix) {
  return (parent == "/" ? "" : parent) + "/" + std::string(kTemporaryPrefix) + name +
         std::string(suffix);
}

void RemoveTree(const std::string& path) {
  std::error_code ignored;
  std::filesystem::remove_all(path, ignored);
}

// mkdir -p of `dir`, returning the directories it made, outermost first.
Result<std::vector<std::string>> MakeDirectories(const std::string& dir) {
  std::vector<std::string> missing;
  std::filesystem::path path(dir);
  std::error_code error;
  while (!path.empty() && !std::filesystem::exists(path, error)) {
    missing.push_back(path.string());
    path = path.parent_path();
  }
  std::vector<std::string> created;
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (::mkdir(it->c_str(), 0755) != 0 && errno != EEXIST) {
      const int err = errno;
      for (auto made = created.rbegin(); made != created.rend(); ++made) ::rmdir(made->c_str());
      return PosixError("mkdir " + *it, err);
    }
    created.push_back(*it);
  }
  return created;
}

}  // namespace

std::string TrimTrailingSlashes(std::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  return std::string(path);
}

std::pair<std::string, std::string> SplitPath(std::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) return {".", std::string(path)};
  if (slash == 0) return {"/", std::string(path.substr(1))};
  return {std::string(path.substr(0, slash)), std::string(path.substr(slash + 1))};
}

Result<StagedDirectory> StagedDirectory::Create(std::string final_path) {
  return Make(std::move(final_path), "-" + std::to_string(::getpid()), /*reuse=*/false);
}

Result<StagedDirectory> StagedDirectory::CreateShared(std::string final_path, std::string_view key,
                                                      bool owner) {
  UCP_ASSIGN_OR_RETURN(StagedDirectory staged,
                       Make(std::move(final_path), "-job-" + std::string(key), /*reuse=*/true));
  // The others' files stay for the owner to commit, whatever happens to this process.
  if (!owner) staged.committed_ = true;
  return staged;
}

Result<StagedDirectory> StagedDirectory::Make(std::string final_path, std::string_view suffix,
                                              bool reuse) {
  auto [parent, name] = SplitPath(final_path);
  if (name.empty() || name == "." || name == ".." || name == "/") {
    return Status::InvalidArgument("output " + final_path + ": not a directory name");
  }
  UCP_ASSIGN_OR_RETURN(std::vector<std::string> created, MakeDirectories(parent));
  std::string temporary = TemporaryName(parent, name, suffix);
  // A temporary of an earlier run of the same pid (a reused pid after a crash) is garbage; a
  // job's is its other processes' work.
  if (!reuse) RemoveTree(temporary);
  if (::mkdir(temporary.c_str(), 0755) != 0 && !(reuse && errno == EEXIST)) {
    const int err = errno;
    for (auto made = created.rbegin(); made != created.rend(); ++made) ::rmdir(made->c_str());
    return PosixError("mkdir " + temporary, err);
  }
  std::string final_name = (parent == "/" ? "" : parent) + "/" + name;
  return StagedDirectory(std::move(final_name), std::move(parent), std::move(temporary),
                         std::move(created));
}

StagedDirectory::StagedDirectory(StagedDirectory&& other) noexcept
    : final_(std::move(other.final_)),
      parent_(std::move(other.parent_)),
      temporary_(std::move(other.temporary_)),
      created_(std::move(other.created_)),
      committed_(other.committed_) {
  other.committed_ = true;
}

StagedDirectory::~StagedDirectory() {
  if (committed_) return;
  RemoveTree(temporary_);
  for (auto made = created_.rbegin(); made != created_.rend(); ++made) ::rmdir(made->c_str());
}

Status CheckOutputFree(const std::string& path, bool force) {
  struct stat existing;
  if (!force && ::lstat(path.c_str(), &existing) == 0) {
    return Status::FailedPrecondition(path + " exists (--force replaces it)");
  }
  return Status::Ok();
}

Status StagedDirectory::Commit(bool replace) {
  UCP_RETURN_IF_ERROR(CheckOutputFree(final_, replace));
  struct stat existing;
  const bool exists = ::lstat(final_.c_str(), &existing) == 0;
  if (!exists) {
    UCP_RETURN_IF_ERROR(RenameFile(temporary_, final_));
  } else if (::renameat2(AT_FDCWD, temporary_.c_str(), AT_FDCWD, final_.c_str(), RENAME_EXCHANGE) !=
             0) {
    if (errno != EINVAL && errno != ENOSYS) {
      return PosixError("rename (exchange) " + temporary_ + " with " + final_, errno);
    }
    // No atomic exchange on this file system: move the old one aside first.
    const std::string aside = temporary_ + ".old";
    UCP_RETURN_IF_ERROR(RenameFile(final_, aside));
    if (Status moved = RenameFile(temporary_, final_); !moved.ok()) {
      (void)RenameFile(aside, final_);
      return moved;
    }
    RemoveTree(aside);
  }
  // The temporary name now holds the replaced directory, if there was one.
  committed_ = true;
  RemoveTree(temporary_);
  return SyncDirectory(parent_);
}

Status ExecuteStaged(const OutputPlan& plan, const AtomIndex& index, const std::string& tag_dir,
                     const std::string& final_path, unsigned threads, bool force,
                     std::string_view command) {
  UCP_RETURN_IF_ERROR(CheckSourcesBeforeReading(index, plan, tag_dir, "source check"));
  UCP_ASSIGN_OR_RETURN(StagedDirectory staged, StagedDirectory::Create(final_path));
  Progress progress{std::string(command)};
  ExecuteOptions execute;
  execute.threads = threads;
  execute.progress = progress.Callback();
  execute.locate_damage = LocateDamageWith(index, tag_dir);
  const Status status = ExecutePlan(plan, index, tag_dir, staged.path(), execute);
  progress.Finish();
  UCP_RETURN_IF_ERROR(status);
  return staged.Commit(force);
}

}  // namespace ucp::cli
