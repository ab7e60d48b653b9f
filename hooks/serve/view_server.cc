#include "hooks/serve/view_server.h"

#include <sys/stat.h>
#include <xxhash.h>

#include <atomic>
#include <cerrno>
#include <set>
#include <utility>
#include <vector>

#include "core/frameworks/framework_adapter.h"
#include "core/io/fault_injection.h"
#include "core/io/file.h"
#include "core/tag/atoms_store.h"
#include "core/util/log.h"

namespace ucp::hooks {
namespace {

// What identifies one version of index.json: a re-save renames a new file over it.
struct IndexIdentity {
  dev_t device = 0;
  ino_t inode = 0;
  off_t size = 0;
  int64_t mtime_sec = 0;
  int64_t mtime_nsec = 0;

  static IndexIdentity Of(const struct stat& info) {
    return {info.st_dev, info.st_ino, info.st_size, static_cast<int64_t>(info.st_mtim.tv_sec),
            static_cast<int64_t>(info.st_mtim.tv_nsec)};
  }
  bool operator==(const IndexIdentity&) const = default;
};

// The name in "<tag_dir>/<name>", or empty when `path` is not inside `tag_dir`.
std::string_view NameInTag(std::string_view path, std::string_view tag_dir) {
  if (path.size() <= tag_dir.size() + 1 || !path.starts_with(tag_dir) ||
      path[tag_dir.size()] != '/') {
    return {};
  }
  return path.substr(tag_dir.size() + 1);
}

std::string TopologyText(const Topology& topology) {
  return "tp=" + std::to_string(topology.tp) + " pp=" + std::to_string(topology.pp) +
         " dp=" + std::to_string(topology.dp);
}

// The index, its identity and the XXH3 of its bytes, all from one open of index.json.
struct LoadedIndex {
  std::shared_ptr<const AtomIndex> index;
  IndexIdentity identity;
  uint64_t xxh3 = 0;
};

Result<LoadedIndex> LoadIndex(const std::string& path) {
  UCP_ASSIGN_OR_RETURN(File file, File::Open(path, File::Mode::kRead));
  struct stat info;
  if (::fstat(file.fd(), &info) != 0) return PosixError("index: fstat " + path, errno);
  const uint64_t size = static_cast<uint64_t>(info.st_size);
  if (size > kMaxAtomIndexBytes) {
    return Status::OutOfRange("index " + path + ": " + std::to_string(size) + " bytes");
  }
  std::string bytes(size, '\0');
  UCP_RETURN_IF_ERROR(file.ReadAt(0, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()}));
  LoadedIndex loaded;
  loaded.identity = IndexIdentity::Of(info);
  loaded.xxh3 = XXH3_64bits(bytes.data(), bytes.size());
  UCP_ASSIGN_OR_RETURN(AtomIndex index, AtomIndex::Parse(bytes, path));
  loaded.index = std::make_shared<const AtomIndex>(std::move(index));
  return loaded;
}

}  // namespace

// One version of a tag's index and what is served for it. Immutable once published, except
// `failed`, which a build failure sets, and `served`.
struct ViewServer::TagState {
  IndexIdentity identity;
  std::shared_ptr<View> view;          // null: pass-through (same topology) or failed
  std::set<std::string> source_files;  // the index's framework files, relative to the tag
  bool from_store = false;             // the view reads the atoms store
  std::atomic<bool> failed{false};
  // A file of the view was opened for its bytes. Only a view under UCP_CACHE_DIR can fail after
  // that (one inside the tag is read only once all of it is built): this process then can no
  // longer fall back to the framework's files without mixing two topologies.
  std::atomic<bool> served{false};
};

ViewServer::ViewServer(ViewServerOptions options) : options_(std::move(options)) {}

std::shared_ptr<ViewServer::TagState> ViewServer::StateOf(const std::string& tag_dir) {
  IoPhaseScope phase(IoPhase::kViewBuild);
  const std::string index_path = AtomIndexPath(tag_dir);
  struct stat info;
  if (::stat(index_path.c_str(), &info) != 0 || !S_ISREG(info.st_mode)) return nullptr;
  const IndexIdentity identity = IndexIdentity::Of(info);

  std::lock_guard lock(mutex_);
  if (const auto known = tags_.find(tag_dir);
      known != tags_.end() && known->second->identity == identity) {
    return known->second;
  }
  auto state = std::make_shared<TagState>();
  state->identity = identity;
  tags_[tag_dir] = state;

  const auto fail = [&](const Status& status) {
    state->failed = true;
    UCP_LOG_WARN("serve: {}: {}; {}", tag_dir, status.ToString(),
                 options_.strict ? "its files fail with EIO (UCP_STRICT=1)"
                                 : "its files pass through unchanged");
    return state;
  };
  Result<LoadedIndex> loaded = LoadIndex(index_path);
  if (!loaded.ok()) return fail(loaded.status());
  const AtomIndex& index = *loaded->index;
  // The index read may be newer than the one stat'ed: the state is keyed on what was read.
  state->identity = loaded->identity;

  Result<const FrameworkAdapter*> adapter = FindAdapter(index.contents().adapter);
  if (!adapter.ok()) return fail(adapter.status());
  if ((*adapter)->schema() != index.contents().adapter_schema) {
    return fail(Status::Unsupported(
        "index schema " + std::to_string(index.contents().adapter_schema) + " of " +
        index.contents().adapter + ", ucp reads schema " + std::to_string((*adapter)->schema())));
  }
  const Topology& source = index.contents().topology;
  if (!options_.current_topology) {
    return fail(Status::FailedPrecondition("no current-topology resolver"));
  }
  Result<CurrentTopology> current = options_.current_topology(source);
  if (!current.ok() && current.status().code() == StatusCode::kNotFound) {
    // Not launched as a job: nothing says the topology changed.
    UCP_LOG_INFO("serve: {}: {}: pass-through", tag_dir, current.status().message());
    return state;
  }
  if (!current.ok()) return fail(current.status());
  for (const std::string& warning : current->warnings) {
    UCP_LOG_WARN("serve: {}: topology: {}", tag_dir, warning);
  }
  const Topology& target = current->topology;
  // An expert-parallel size given (ep != 0) is the adapter's to compare with the tag's.
  const bool same =
      target.dp == source.dp && target.tp == source.tp && target.pp == source.pp && target.ep == 0;
  // With the framework's files gone, the atoms store stands in for them, at any topology.
  Result<std::optional<AtomIndex>> readable = ReadableSources(index, tag_dir);
  if (same && (!readable.ok() || !readable->has_value())) {
    UCP_LOG_INFO("serve: {}: saved at {}, running at it ({}): pass-through{}", tag_dir,
                 TopologyText(source), current->evidence,
                 readable.ok() ? "" : " (" + readable.status().message() + ")");
    return state;
  }
  if (!readable.ok()) return fail(readable.status());
  const bool from_store = readable->has_value();
  std::shared_ptr<const AtomIndex> sources =
      from_store ? std::make_shared<const AtomIndex>(std::move(**readable)) : loaded->index;
  std::optional<JobPlace> place;
  if (current->global_rank && *current->global_rank >= 0 && target.world > 0) {
    place = JobPlace{static_cast<uint32_t>(*current->global_rank), target.world};
  }
  Result<std::unique_ptr<View>> view =
      View::Open(**adapter, std::move(sources), loaded->xxh3, tag_dir, options_.cache_dir, target,
                 options_.lease, place, options_.build_part_bytes);
  if (!view.ok()) return fail(view.status());
  for (const IndexedFile& file : index.files()) {
    if (!AtomIndex::IsStoreFile(file)) state->source_files.insert(file.path);
  }
  state->from_store = from_store;
  state->view = std::move(*view);
  UCP_LOG_INFO("serve: {}: saved at {}, running at {} ({}): serving {} from {}{}", tag_dir,
               TopologyText(source), TopologyText(target), current->evidence,
               state->view->names().size(), state->view->directory(),
               from_store ? ", built from the atoms store (the framework's files are gone)" : "");
  return state;
}

ServeDecision ViewServer::Resolve(std::string_view path) { return ResolveFor(path, false); }

ServeDecision ViewServer::ResolveMetadata(std::string_view path) { return ResolveFor(path, true); }

ServeDecision ViewServer::ResolveFor(std::string_view path, bool metadata_only) {
  // Nothing inside ucp's own directories is a checkpoint file (view files would otherwise look
  // like the files of a tag named after the view).
  if (path.find("/.ucp/") != std::string_view::npos) return {};
  const std::optional<PathMatch> match = options_.layouts->Recognise(path, options_.roots);
  if (!match || match->role != FileRole::kData || match->tag_dir.empty()) return {};
  if (!options_.cache_dir.empty() && NameInTag(path, options_.cache_dir).size() > 0) return {};
  const std::string_view name = NameInTag(path, match->tag_dir);
  if (name.empty()) return {};

  // Reading the index and the sources, creating the view and building its files.
  IoPhaseScope phase(IoPhase::kViewBuild);
  const std::shared_ptr<TagState> state = StateOf(match->tag_dir);
  if (state == nullptr) return {};
  // After a failure: the framework's files, unless some of the view's were already read here.
  const auto failed = [&] {
    const bool fail = options_.strict || state->served;
    return ServeDecision{fail ? ServeDecision::Kind::kFail : ServeDecision::Kind::kPassThrough, {}};
  };
  if (state->failed) return failed();
  if (state->view == nullptr) return {};
  const std::string name_text(name);
  if (state->view->names().contains(name_text)) {
    Result<std::string> built =
        metadata_only ? state->view->Describe(name_text) : state->view->Materialize(name_text);
    if (built.ok()) {
      if (!metadata_only) state->served = true;
      return {ServeDecision::Kind::kSubstitute, std::move(*built)};
    }
    if (!state->failed.exchange(true)) {
      UCP_LOG_WARN("serve: {}: {}; {}", match->tag_dir, built.status().ToString(),
                   options_.strict ? "its files fail with EIO (UCP_STRICT=1)"
                   : state->served ? "files of the view were read already: its files fail with "
                                     "EIO rather than mix two topologies"
                                   : "its files pass through unchanged from now on");
    }
    return failed();
  }
  if (state->source_files.contains(name_text)) return {ServeDecision::Kind::kAbsent, {}};
  return {};
}

bool ViewServer::MayServePath(std::string_view path) {
  return options_.layouts->MayMatchPath(path);
}

std::optional<ListingChange> ViewServer::ChangeListing(std::string_view dir) {
  if (dir.find("/.ucp") != std::string_view::npos || !options_.roots.Contains(dir)) {
    return std::nullopt;
  }
  const std::shared_ptr<TagState> state = StateOf(std::string(dir));
  if (state == nullptr || state->failed || state->view == nullptr) return std::nullopt;
  ListingChange change;
  const std::set<std::string>& names = state->view->names();
  for (const std::string& file : state->source_files) {
    if (file.find('/') == std::string::npos && !names.contains(file)) change.hide.push_back(file);
  }
  // From the store, the source topology's files may be gone from the directory too; names the
  // directory does have are listed once (interpose/dirs.cc).
  for (const std::string& name : names) {
    if (name.find('/') == std::string::npos &&
        (state->from_store || !state->source_files.contains(name))) {
      change.add.push_back(name);
    }
  }
  return change;
}

}  // namespace ucp::hooks
