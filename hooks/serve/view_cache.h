// ViewCache: the files a tag's framework expects at another topology, built on demand from the
// tag's committed index, once, and shared by every process of the job.
//
// Layout of one view (normative; README "View cache"):
//   <view>/                 <cache root>/<topology name>, the cache root being <tag>/.ucp/views
//                           (or, with UCP_CACHE_DIR=D, D/<tag name>-<16 hex of XXH3 of the tag's
//                           absolute path>); topology name "tp<T>-pp<P>-dp<D>"
//   <view>/.lock            flock(2)ed exclusively while view.json is checked or written
//   <view>/view.json        {"version": 2, "index_xxh3": "<16 hex of index.json's bytes>",
//                            "target": {"dp":, "tp":, "pp":, "world":},
//                            "verified": true|false, "error": "<why not>"}
//                           written once per index (temporary, fsync, rename): "verified" says
//                           whether the sources checked before reading (source_check.h's
//                           CheckSourcesBeforeReading: files without chunk hashes whole, the
//                           carried archives' pickles and directories) passed when the view was
//                           created; the bytes of files with chunk hashes are checked chunk by
//                           chunk as each file of the view is built. A verification that could
//                           not read a source (EIO, a missing file) records nothing and fails
//                           this open only
//   <view>/.planned/served.<name>
//                           a sparse file of the size <name> has once built, for stat and
//                           access before then; made for every name whose size the plan tells by
//                           the view's creator, before view.json
//   <view>/verdict          "complete\n" once every file of the view is built, or "failed: " and
//                           the first build failure (a damaged chunk, an I/O error): written
//                           under a temporary name and linked to "verdict", which link(2)
//                           creates only where it does not exist, so the first verdict stands for
//                           every process on every node. In a view inside the tag (shared by the
//                           whole job) no process reads a file of the view before the verdict is
//                           "complete", so the job's processes all read the view, or none does.
//                           After "failed" no process builds or serves a file of the view
//                           (View::Open, Materialize and Describe fail naming it)
//   <view>/.<name>.lease    the OwnerLease of <name>'s builder while it is built ('/' becomes '#')
//   <view>/.<name>#part<k>of<n>.lease, <view>/.<name>#part<k>of<n>.done
//                           a file built in parts (an archive of more than the part size, e.g.
//                           the model states that every rank reads): the lease of part k's
//                           builder, and the mark that part k is written and synced
//   <dir of served.<name>>/.served.<name>.parts
//                           the file the parts are written into, each at its offsets in the
//                           whole archive; once every part is marked, the holder of <name>'s
//                           lease writes its directory and renames it to served.<name>
//   <view>/served.<name>    the file <name> of the target topology (the prefix goes on the last
//                           component), exactly the bytes `ucp reshard` writes for <name>;
//                           written under a temporary name and renamed. The prefix keeps tools
//                           that collect a tag's files by name prefix through the whole tree
//                           (DeepSpeed's ds_to_universal walks it with os.walk) from taking a
//                           served file for one of the tag's own
// A view whose view.json names another index (the tag was saved again) is emptied and
// re-created under .lock. A crash leaves at worst a temporary file, never a partial <name>.
//
// Concurrency: any number of processes and threads, on one node or many, may ask for the same
// view and file at once; the first to create a file's lease builds it, the others wait (bounded
// backoff) until it is there, taking a build over from an owner that died or hangs (owner_lease.h:
// no flock, no lock without a time limit): each file is built once in the common case, and a file
// built twice is the same bytes renamed into place twice. In a view inside the tag, a process's
// first Materialize builds every file no other process is building, then waits for the others,
// and only then records or reads the verdict: the job's files are spread over its processes, each
// starting at its own place among the view's files (JobPlace) and learning which files are built or
// claimed from one listing of the view per step rather than a stat of each file, so that a job of
// P processes and F files costs O(P + F) listings and claims, not P × F stats. In a
// view under UCP_CACHE_DIR (a node's own disk: shared by that node's processes only) a process
// builds only the files it asks for, so a node builds only what its ranks read; a failure then
// stops the view for the processes that have not read it yet. Memory: the executor's bounded
// chunks (ExecuteOptions).
//
// Thread-safety: every method may be called from any thread. The callers (ViewServer) hold a
// ReentrancyGuard: nothing here may be seen by the hooks.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/atom_index.h"
#include "core/frameworks/framework_adapter.h"
#include "core/io/owner_lease.h"
#include "core/plan/executor.h"
#include "core/util/status.h"

namespace ucp::hooks {

// What a view stores the file `name` as: "served." before its last component.
inline constexpr std::string_view kStoredPrefix = "served.";
std::string StoredName(std::string_view name);

// "tp<T>-pp<P>-dp<D>".
std::string ViewName(const Topology& topology);

// The directory of the view of `tag_dir` at `target`; `cache_dir` empty = inside the tag.
std::string ViewDirectory(const std::string& tag_dir, const std::string& cache_dir,
                          const Topology& target);

// A process's place among the job's processes (its global rank of `world`), where it starts
// building a view's files.
struct JobPlace {
  uint32_t rank = 0;
  uint32_t world = 1;
};

// The order in which the process at `place` builds `count` files (indexes into the view's sorted
// names): from ⌊rank × count / world⌋ round to the end and on from the start, so the job's
// processes start on different files. Without a place, from a position of this host and pid.
std::vector<size_t> BuildOrder(size_t count, const std::optional<JobPlace>& place);

class View {
 public:
  // Opens (creating it if needed) the view of the tag at `target`: plans it with `adapter`,
  // and creates or checks view.json, verifying the source files it reads against the index
  // when it creates it. kCorrupt naming the file when a source file's size or hash differs from the
  // index (also when an earlier process recorded that); the adapter's errors as they are.
  // A torch archive of the view whose storages hold more than `part_bytes` is built in parts of
  // at least that many storage bytes, by whichever processes take them (0: every file whole).
  static Result<std::unique_ptr<View>> Open(const FrameworkAdapter& adapter,
                                            std::shared_ptr<const AtomIndex> index,
                                            uint64_t index_xxh3, std::string tag_dir,
                                            const std::string& cache_dir, const Topology& target,
                                            const OwnerLease::Options& lease = {},
                                            std::optional<JobPlace> place = std::nullopt,
                                            uint64_t part_bytes = 0);

  View(const View&) = delete;
  View& operator=(const View&) = delete;

  const std::string& directory() const { return directory_; }
  // Every file name (relative to the tag) the target topology has.
  const std::set<std::string>& names() const { return names_; }

  // The absolute path of `name` in the view: in a view inside the tag, once every file of the
  // view is built (by this process or others) and the job's verdict is "complete"; under
  // UCP_CACHE_DIR, once `name` is built. kNotFound when `name` is not one of names(). A build that
  // fails (a chunk failing its hash: kCorrupt naming the source, the byte range and what it
  // holds) makes the verdict "failed": then kFailedPrecondition naming it, for every name not
  // served yet, in every process.
  Result<std::string> Materialize(const std::string& name);

  // A path whose metadata (stat, access) is that of the file Materialize(name) gives, without
  // building it: the built file once this process may serve it, else a placeholder of the
  // planned size (sparse, under .planned/ in the view, never opened for its bytes), made with the
  // view. The first Describe of a process reads the job's verdict; later ones make no system
  // call. An output whose size cannot be planned (safetensors) is built. kNotFound when `name`
  // is not one of names().
  Result<std::string> Describe(const std::string& name);

  // How many files this process built (not found built), for tests and logs; of a file built in
  // parts, the process that completed it.
  uint64_t built() const;
  // How many parts of files built in parts this process wrote.
  uint64_t parts_built() const;

 private:
  View(std::shared_ptr<const AtomIndex> index, std::string tag_dir, std::string directory,
       std::map<std::string, OutputPlan> plans, const OwnerLease::Options& lease, bool whole_job,
       std::optional<JobPlace> place, uint64_t part_bytes);
  // The plan of `name`, or kNotFound naming the view.
  Result<const OutputPlan*> PlanOf(const std::string& name) const;
  std::string VerdictPath() const;
  // The recorded verdict: Ok for "complete", kFailedPrecondition naming the failure; nullopt
  // while there is none.
  std::optional<Status> ReadVerdict() const;
  // kFailedPrecondition with the recorded error once a build of this view failed anywhere.
  Status CheckNoBuildFailed() const;
  // Records "complete" (`outcome` Ok) or the failure, unless a verdict is there already; returns
  // the verdict that stands.
  Status RecordVerdict(const Status& outcome) const;
  // Builds or waits for every file of the view, then records or reads the verdict.
  Status AwaitVerdict();
  // What one listing of the view's directories says: the names built, and those whose lease
  // file is there (a builder at work, or a dead one's to take over).
  struct Listing {
    std::set<std::string> built;
    std::set<std::string> claimed;
  };
  Result<Listing> List() const;
  std::string LeasePath(const std::string& name) const;
  // Builds `name` unless it is built; true once it is there. With `wait`, waits for another
  // process building it (taking over a dead or hung one); without, leaves it to that process:
  // false.
  Result<bool> Build(const std::string& name, bool wait);
  // Build for a file built in parts: writes the parts no other process is writing (with `wait`,
  // also waits for the others, taking over dead or hung ones), then, once every part is marked,
  // completes the file unless another process does.
  Result<bool> BuildInParts(const std::string& name, bool wait);
  // BuildInParts but for removing the parts' file after a failure.
  Result<bool> BuildOrCompleteParts(const std::string& name, bool wait);
  // Writes part `k` of `name` unless it is marked written; true once it is. Without `wait`,
  // false when another process writes it.
  Result<bool> BuildPart(const std::string& name, size_t k, bool wait);
  // Acquires the lease at `lease_path` for a build that is over once `done` holds (or a verdict
  // is there): the lease, nullopt when there is nothing left to do; kFailedPrecondition when
  // another process holds it and `wait` is false.
  Result<std::optional<OwnerLease>> Claim(const std::string& lease_path, bool wait,
                                          const std::function<bool()>& done) const;
  ExecuteOptions BuildOptions() const;

  std::shared_ptr<const AtomIndex> index_;
  std::string tag_dir_;
  std::string directory_;
  std::map<std::string, OutputPlan> plans_;  // the adapter's plan, one output per name
  OwnerLease::Options lease_options_;
  std::set<std::string> names_;
  // Where a listing of the view shows each name built or claimed: fixed with the plan.
  struct ListedAs {
    std::string directory;  // of the stored file
    std::string stored;     // the stored file's name in it
    std::string lease;      // the lease's name in the view's directory
    // A file built in parts: each part's lease and written mark in the view's directory.
    std::vector<std::string> part_leases;
    std::vector<std::string> part_marks;
  };
  std::map<std::string, ListedAs> listed_as_;
  // The files built in parts: their parts (PlanArchiveParts), and where the parts are written.
  struct Split {
    std::vector<ArchivePart> parts;
    std::string parts_path;
  };
  std::map<std::string, Split> splits_;
  mutable std::mutex mutex_;
  // Inside the tag: the whole job shares the view, which is read whole or not at all.
  const bool whole_job_;
  const std::optional<JobPlace> place_;
  // Names this process may serve without asking the file system again: built (under
  // UCP_CACHE_DIR), or all of them once the job's verdict is "complete".
  std::set<std::string> ready_;
  std::map<std::string, std::string> placeholders_;  // name → its placeholder, once described
  std::atomic<bool> verdict_read_{false};            // by Describe
  uint64_t built_ = 0;
  uint64_t parts_built_ = 0;
};

}  // namespace ucp::hooks
