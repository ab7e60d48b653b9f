// The atoms store of UCP_MODE=atoms: every atom of a tag written whole, split across the ranks
// that saved it, recorded in the tag's index once complete (atom_index.h, "store"), so that the
// tag can be served after its framework files are gone.
//
// Layout (normative; README "Atoms store"), under <tag>/.ucp/atoms/:
//   <state>/                      for each atom state, in the index's atom order: exactly what
//                                 `ucp export --format safetensors --state <state>
//                                 --max-shard-size <max_shard_bytes>` writes (export_plan.h)
//   carried.<name>                a byte copy of each framework file <name> that a carried
//                                 entry names (the prefix on the last component, as view_cache.h
//                                 puts "served.": tools that collect a tag's files by name prefix
//                                 through the whole tree must not take it for one of the tag's)
//   done.<rank>-of-<world>.json   {"index_xxh3": "<16 hex>", "files": [{"path": <relative to
//                                 the store>, "size": N, "xxh3": "<16 hex>", "chunk_bytes": C,
//                                 "chunks": "<16 hex per chunk>"}, ...]} (chunks optional:
//                                 markers written before them lack them): that rank
//                                 has written its share for the index.json with that hash
// and <tag>/.ucp/index.lock, flock(2)ed while index.json is replaced (by IndexBuilder too).
// max_shard_bytes is the store's total bytes over the world size, clamped to [16 MiB, 4 GiB].
// The work is a list of units, one per output file (each state's shards, then its
// model.safetensors.index.json, then the copies); unit i is rank (i mod world)'s, ranks numbered
// dp + dp_size × (tp + tp_size × pp). Every unit is written under a temporary name and renamed.
// The rank that finds every done marker of the current index.json rewrites index.json with the
// store (consolidated offsets read back from the safetensors headers) and removes the markers.
//
// Thread-safety: the free functions may be called from any thread; concurrent callers for one tag
// are serialised by the index lock where they touch index.json.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/atom_index.h"
#include "core/plan/executor.h"
#include "core/util/status.h"

namespace ucp {

// Where the store lives, relative to the tag directory.
inline constexpr std::string_view kStoreDirectory = ".ucp/atoms";

// "<tag_dir>/.ucp/index.lock".
std::string IndexLockPath(const std::string& tag_dir);

// One output file of the store: `plan` writes exactly it, at `path` relative to the store.
struct StoreUnit {
  std::string path;
  OutputPlan plan;
};

struct StorePlan {
  uint64_t max_shard_bytes = 0;
  std::vector<StoreUnit> units;
};

// The store of `index`. kUnsupported when a state is no directory name or a dtype has no
// safetensors name; kFailedPrecondition for an index that already has a store.
[[nodiscard]] Result<StorePlan> PlanStore(const AtomIndex& index);

// Writes rank `rank`'s units of PlanStore(index) under <tag_dir>/.ucp/atoms, then its done
// marker. `index_xxh3` is the XXH3 of the index.json bytes `index` was parsed from.
[[nodiscard]] Status WriteStoreShare(const AtomIndex& index, uint64_t index_xxh3,
                                     const std::string& tag_dir, uint32_t rank,
                                     const ExecuteOptions& options);

// Under the index lock: when index.json still hashes to `index_xxh3` and every rank's done marker
// for it is there, rewrites index.json atomically with the store recorded and removes the
// markers; true when this call did so. False when a share is missing (its rank will finish the
// store) or index.json changed (a newer save: its own shares make its store).
[[nodiscard]] Result<bool> FinalizeStore(const std::string& tag_dir, uint64_t index_xxh3);

// The index to plan with for the tag as it is on disk now: nullopt (plan with `index` itself)
// while every framework file it lists is there with its size; else index.OverStore() when the
// index has a store whose files are all there with their sizes; else kFailedPrecondition naming
// the first file missing or changed. Hashes are not checked here (ViewCache and `ucp verify` do).
[[nodiscard]] Result<std::optional<AtomIndex>> ReadableSources(const AtomIndex& index,
                                                               const std::string& tag_dir);

}  // namespace ucp
