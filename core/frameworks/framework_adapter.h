// FrameworkAdapter: what one checkpoint schema (DeepSpeed ZeRO-1/2, ZeRO-3, Megatron, ...) means
// in terms of atoms. One implementation per schema, registered by name and schema version.
//
// Call order for one tag: Recognizes → (ExpectedFiles, while a save may still be running) →
// BuildIndex (reads every file's pickle, never tensor data;
// hashes the files unless the tag's journals already did) → any number of Plan* against that
// index. The plans are pure descriptions (executor.h runs them); an adapter never writes.
//
// Refusals are explicit: a topology or feature the adapter cannot produce is kUnsupported with
// a message a user can act on ("tp=2: tensor-parallel resharding is not supported yet"); it never
// guesses. Malformed input is kCorrupt / kInvalidArgument naming the file and the field.
//
// Thread-safety: adapters are stateless; every method may be called concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/atom_index.h"
#include "core/plan/executor.h"
#include "core/util/status.h"

namespace ucp {

struct IndexOptions {
  // Worker threads for hashing files (0: min(hardware threads, 8)).
  unsigned threads = 0;
  // Reuse hashes recorded by the save journals (<tag>/.ucp/journal.*.jsonl) for files whose size
  // and modification time match the record; false: hash every file.
  bool trust_journal = true;
};

class FrameworkAdapter {
 public:
  virtual ~FrameworkAdapter() = default;

  // Registry name, e.g. "deepspeed-zero12", and the schema version it reads and writes.
  virtual std::string_view name() const = 0;
  virtual uint32_t schema() const = 0;

  // True when the files directly in `tag_dir` have this schema's names (cheap: a directory
  // listing, and at most one pickle read where the names alone cannot tell two schemas apart;
  // never tensor data).
  virtual bool Recognizes(const std::string& tag_dir) const = 0;

  // The files (paths relative to `tag_dir`) a complete save of the tag holds, judged from what
  // is on disk now (DeepSpeed: the model-states file's dp_world_size, mp_world_size and ZeRO
  // stage, and whether its optimizer files are bf16_ ones). kFailedPrecondition while that cannot
  // be told yet (the file that says it is missing or still being written); kUnsupported for a tag
  // this adapter would refuse to index. Reads pickles (a file or two), never tensor data.
  virtual Result<std::vector<std::string>> ExpectedFiles(const std::string& tag_dir) const = 0;

  // Reads the tag and describes it as atoms. Validates everything it relies on (every rank file
  // present, one tag, shapes and partition metadata consistent).
  virtual Result<AtomIndex> BuildIndex(const std::string& tag_dir,
                                       const IndexOptions& options) const = 0;

  // Every file the framework expects in a tag directory saved at `target`, holding exactly the
  // index's state. Paths are relative to the new tag directory; files that belong beside it
  // (DeepSpeed's `latest`) are the caller's.
  virtual Result<OutputPlan> PlanReshard(const AtomIndex& index, const std::string& tag_dir,
                                         const Topology& target) const = 0;

  // The framework's own consolidated ("universal") layout of the index's state, paths relative
  // to the output folder (DeepSpeed: zero/<param>/<state>.pt, zero/optimizer_state.pt and the
  // model-state files).
  virtual Result<OutputPlan> PlanUniversalExport(const AtomIndex& index,
                                                 const std::string& tag_dir) const = 0;
};

// The adapters, newest schema first.
const std::vector<const FrameworkAdapter*>& Adapters();
// The adapter registered as `name`, or kNotFound listing the known names.
Result<const FrameworkAdapter*> FindAdapter(std::string_view name);
// The first adapter that recognises `tag_dir`, or kNotFound naming the directory.
Result<const FrameworkAdapter*> DetectAdapter(const std::string& tag_dir);

}  // namespace ucp
