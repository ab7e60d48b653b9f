// Config: every UCP_* environment variable, read once when libucp.so starts, then immutable.
//
// Thread-safety: a value type; ParseConfig() has no shared state and may run anywhere. The
// preload calls it once from its constructor with getenv as the lookup.
//
// Unset and empty variables take their defaults. Any bad value makes ParseConfig() fail with an
// InvalidArgument whose message names the variable, the value and what is accepted, e.g.
//   UCP_MODE=fast is invalid (expected index, atoms or off)
// The preload prints that one line (the only thing ucp ever prints) and passes everything
// through for the rest of the process.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/format/atom_index.h"
#include "core/util/launcher.h"
#include "core/util/log.h"
#include "core/util/status.h"

namespace ucp::hooks {

// UCP_MODE.
enum class Mode {
  kIndex,  // index the framework's own files (default)
  kAtoms,  // also write consolidated atoms in the background
  kOff,    // no checkpoint handling at all (the hooks pass everything through)
};

// UCP_DETECT: how a file being written is recognised as a checkpoint.
enum class Detect {
  kName,   // by its path (a registered adapter recognises the name); default
  kStack,  // by its path and by the writer's call stack (UCP_STACK_PATTERNS)
};

// UCP_TOPOLOGY: each degree is optional; the ones not given are inferred (DESIGN.md §5).
struct TopologyOverride {
  std::optional<int> tp;
  std::optional<int> pp;
  std::optional<int> dp;
  std::optional<int> ep;  // an MoE tag's expert-parallel size at the resume
  // How a pipeline's layers are placed at another pp (the trainer's partition_method), where the
  // saved stages leave it ambiguous.
  std::optional<LayerPartition> partition;

  bool empty() const { return !tp && !pp && !dp && !ep && !partition; }
  friend bool operator==(const TopologyOverride&, const TopologyOverride&) = default;
};

struct Config {
  bool disable = false;                      // UCP_DISABLE=1
  Mode mode = Mode::kIndex;                  // UCP_MODE
  std::vector<std::string> roots;            // UCP_ROOTS; empty = anywhere
  TopologyOverride topology;                 // UCP_TOPOLOGY
  std::string cache_dir;                     // UCP_CACHE_DIR; empty = in the tag
  log::Level log_level = log::Level::kWarn;  // UCP_LOG_LEVEL
  std::string log_dir;                       // UCP_LOG_DIR; empty = no log file
  bool strict = false;                       // UCP_STRICT=1
  Detect detect = Detect::kName;             // UCP_DETECT
  std::vector<std::string> stack_patterns{"PyTorchStreamWriter"};  // UCP_STACK_PATTERNS
  std::string dump_topology;  // UCP_DUMP_TOPOLOGY; empty = no dump
  bool durable = false;       // UCP_DURABLE=1: commit signals wait for a complete, durable tag
  // UCP_LEASE_STALE_MS: how long a view file's build lease may stay unchanged before its owner
  // counts as hung or dead and a waiting process takes the build over (100 .. 86400000).
  std::chrono::milliseconds lease_stale{30000};
  // UCP_BUILD_PART_KB: a view file (a torch archive) of at least twice this many KiB of tensor
  // data is built in parts of at least this size, each by whichever process of the job takes it,
  // so that the model states every rank reads are not one process's work (4 .. 2^30; default
  // 1048576, 1 GiB).
  uint64_t build_part_bytes = uint64_t{1} << 30;

  // True when the wrappers should do anything at all (not UCP_DISABLE=1, not UCP_MODE=off).
  bool active() const { return !disable && mode != Mode::kOff; }
};

using ::ucp::EnvLookup;

// Reads and validates every variable through `lookup`. Paths (roots, cache, log and dump
// locations) must be absolute; they are returned lexically normalised. The first bad variable,
// in the order of the fields above, is the one reported.
[[nodiscard]] Result<Config> ParseConfig(const EnvLookup& lookup);

}  // namespace ucp::hooks
