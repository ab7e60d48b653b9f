// ViewServer: the load side's ServePolicy. Serves a tag's files at the current topology when the
// tag was saved at another one (DESIGN.md §3, Load).
//
// Resolve(path):
//   1. `path` is a data file name a CheckpointLayout recognises (and lies in the roots), in a
//      tag directory holding a committed <tag>/.ucp/index.json. Anything else: kPassThrough,
//      at the cost of a few string comparisons (no system call for paths no layout recognises).
//   2. The current topology (the resolver, hooks/topology/current_topology.h) equals the index's
//   source
//      topology while the framework's files are there, or nothing tells it (no launcher, no
//      NCCL, no UCP_TOPOLOGY) → kPassThrough.
//   3. Otherwise the tag's View (view_cache.h) at that topology, read from the framework's
//      files, or from the atoms store when they are gone (ReadableSources, atoms_store.h): a
//      name of the view → kSubstitute with the view's file (built first if needed); a file of
//      the source topology the view does not have → kAbsent; any other name → kPassThrough.
// ResolveMetadata(path): as Resolve, except that a name of the view not built yet is described
//   by its placeholder (View::Describe): a stat or access builds nothing.
//   Any failure (unreadable or invalid index, unresolvable topology, an adapter refusal, source
//   files that fail verification, a build error here or in another process of the job: the
//   view's verdict) → kPassThrough with one warning per tag in the log, or kFail under
//   UCP_STRICT=1. A view inside the tag is read only once the job's verdict on all of it is
//   "complete" (view_cache.h), so the job's processes all read the view or all the framework's
//   files. Under UCP_CACHE_DIR, where each node builds only what its processes read, a process
//   that has already opened a file of the view gets kFail rather than a mix of two topologies.
// ChangeListing(dir): for a tag directory served as in 3, hide the source topology's files the
//   view lacks and add the view's names the directory lacks; otherwise nullopt.
//
// The index of a tag is read once and kept while index.json is unchanged (same inode, size and
// modification time); a re-saved tag's new index replaces it. Decisions for a tag are logged
// once at info level with the topology's evidence.
//
// Thread-safety: Resolve and ChangeListing may be called concurrently from any thread; the
// caller holds a ReentrancyGuard.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "core/format/atom_index.h"
#include "core/frameworks/checkpoint_layout.h"
#include "core/io/owner_lease.h"
#include "core/util/status.h"
#include "hooks/events.h"
#include "hooks/serve/view_cache.h"
#include "hooks/topology/current_topology.h"

namespace ucp::hooks {

struct ViewServerOptions {
  const LayoutRegistry* layouts = &LayoutRegistry::Builtin();
  RootSet roots;          // UCP_ROOTS
  std::string cache_dir;  // UCP_CACHE_DIR; empty = inside the tag
  bool strict = false;    // UCP_STRICT
  // How a view file's builder is chosen and taken over (UCP_LEASE_STALE_MS).
  OwnerLease::Options lease;
  // A view file of more storage bytes than this is built in parts of at least this many, by
  // several processes (UCP_BUILD_PART_KB; 0: every file by one process).
  uint64_t build_part_bytes = 0;
  // The current topology for a tag saved at `source` (production: ResolveCurrentTopology with the
  // config, TopologyRegistry::Global().Summary() and getenv).
  std::function<Result<CurrentTopology>(const Topology& source)> current_topology;
};

class ViewServer final : public ServePolicy {
 public:
  explicit ViewServer(ViewServerOptions options);
  ViewServer(const ViewServer&) = delete;
  ViewServer& operator=(const ViewServer&) = delete;

  ServeDecision Resolve(std::string_view path) override;
  ServeDecision ResolveMetadata(std::string_view path) override;
  bool MayServePath(std::string_view path) override;
  std::optional<ListingChange> ChangeListing(std::string_view dir) override;

 private:
  struct TagState;
  // Resolve (`metadata_only` false) and ResolveMetadata (true).
  ServeDecision ResolveFor(std::string_view path, bool metadata_only);
  // The served state of `tag_dir`, nullptr when it passes through (no index, same topology, a
  // failure already logged).
  std::shared_ptr<TagState> StateOf(const std::string& tag_dir);

  const ViewServerOptions options_;
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<TagState>, std::less<>> tags_;
};

}  // namespace ucp::hooks
