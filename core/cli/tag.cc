#include "core/cli/tag.h"

#include <sys/stat.h>

#include <cerrno>

#include "core/cli/staging.h"
#include "core/tag/atoms_store.h"

namespace ucp::cli {
namespace {

// The saved index, when it still describes the files on disk, or its atoms store those that are
// gone (sizes; hashes are `ucp verify`'s).
Result<Tag> SavedIndex(const std::string& dir) {
  UCP_ASSIGN_OR_RETURN(AtomIndex index, AtomIndex::Read(IndexPath(dir)));
  UCP_ASSIGN_OR_RETURN(const FrameworkAdapter* adapter, FindAdapter(index.contents().adapter));
  if (index.contents().adapter_schema != adapter->schema()) {
    return Status::FailedPrecondition("saved index: another adapter schema");
  }
  // The framework's files, or the atoms store once they are gone.
  UCP_ASSIGN_OR_RETURN(std::optional<AtomIndex> over_store, ReadableSources(index, dir));
  Tag tag{.dir = dir,
          .name = SplitPath(dir).second,
          .adapter = adapter,
          .index = over_store ? std::move(*over_store) : std::move(index),
          .saved_index = true,
          .from_store = over_store.has_value()};
  return tag;
}

}  // namespace

std::string IndexPath(const std::string& tag_dir) { return AtomIndexPath(tag_dir); }

Result<Tag> OpenTag(const std::string& given, const IndexOptions& options, bool use_saved_index) {
  const std::string dir = TrimTrailingSlashes(given);
  struct stat info;
  if (::stat(dir.c_str(), &info) != 0) return PosixError("tag " + dir, errno);
  if (!S_ISDIR(info.st_mode)) return Status::NotFound("tag " + dir + ": not a directory");
  if (use_saved_index) {
    Result<Tag> saved = SavedIndex(dir);
    if (saved.ok()) return saved;
  }
  UCP_ASSIGN_OR_RETURN(const FrameworkAdapter* adapter, DetectAdapter(dir));
  UCP_ASSIGN_OR_RETURN(AtomIndex index, adapter->BuildIndex(dir, options));
  Tag tag{.dir = dir,
          .name = SplitPath(dir).second,
          .adapter = adapter,
          .index = std::move(index),
          .saved_index = false};
  return tag;
}

}  // namespace ucp::cli
