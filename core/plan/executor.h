// The reshard executor: writes the files an OutputPlan describes, moving every tensor byte from
// the source files by ranged reads through a bounded buffer per worker (memory is
// O(threads × chunk), never O(file) or O(atom)), except bytes copied unchanged with their own
// CRC-32s: whole files and whole zip records move with copy_file_range, never through memory.
//
// An OutputPlan is what an adapter decides a target topology (or an export format) needs:
// torch archives (an object tree + storages made of Segments), safetensors files (tensors made
// of Segments), verbatim copies of source files, and small text files (DeepSpeed's `latest`).
// Paths are relative to the output directory and may contain subdirectories, created as needed;
// they must be normalised and stay inside it ("..", absolute paths: kInvalidArgument before
// anything is written).
//
// Thread-safety: ExecutePlan runs its own worker threads and returns after they finished; the
// plan, the index and the progress callback must stay valid until then. `progress` is called
// from worker threads, serialised by the executor.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/atom_index.h"
#include "core/format/dtype.h"
#include "core/format/pickle_value.h"
#include "core/layout/region.h"
#include "core/plan/copy_plan.h"
#include "core/util/status.h"

namespace ucp {

// One storage record of an output archive: `segments` concatenated.
struct OutputStorage {
  std::string key;
  std::vector<Segment> segments;
};

// A torch.save archive: `graph`'s root pickled as data.pkl (its storage persistent ids name the
// keys of `storages`, with matching byte sizes), every storage streamed from its segments.
struct ArchiveOutput {
  std::string path;
  std::string archive_name;  // empty: the file's stem, as torch.save names it
  pickle::Graph graph;       // root() is the object written
  std::vector<OutputStorage> storages;
};

// One tensor of a safetensors output (named apart from safetensors_reader.h's SafetensorsTensor,
// a parsed header entry).
struct SafetensorsOutputTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<Segment> segments;  // product(shape) × itemsize bytes
};

struct SafetensorsOutput {
  std::string path;
  std::vector<SafetensorsOutputTensor> tensors;
  std::map<std::string, std::string> metadata;
};

// A byte-for-byte copy of source file `file`.
struct CopyOutput {
  std::string path;
  uint32_t file = 0;
};

struct TextOutput {
  std::string path;
  std::string contents;
};

struct OutputPlan {
  std::vector<ArchiveOutput> archives;
  std::vector<SafetensorsOutput> safetensors;
  std::vector<CopyOutput> copies;
  std::vector<TextOutput> texts;

  // Bytes of tensor data the plan writes from sources or zeros (copies not included: their sizes
  // are the index's).
  uint64_t DataBytes() const;
};

// Where the damage lies in bytes [begin, end) of source file `file`, whose chunk failed its hash:
// e.g. "record archive/data/3 fails its CRC-32 (it holds exp_avg of wte.weight)"; "" when unknown.
using DamageLocator = std::function<std::string(uint32_t file, uint64_t begin, uint64_t end)>;

struct ExecuteOptions {
  unsigned threads = 0;  // 0: min(hardware threads, 8)
  // Per-worker copy buffer for bytes that must be seen (archive records are CRC'd); 256 KiB
  // stays in L2 between read, CRC and write (ZipWriter::Options::copy_buffer_bytes).
  size_t chunk_bytes = size_t{256} << 10;
  bool sync = true;  // fsync each file and the directories it created
  // Names the damage in a chunk that fails its hash; unset: the atoms the chunk holds.
  DamageLocator locate_damage;
  // Called as bytes land: (bytes done, total), total = DataBytes() + the copied files' sizes.
  std::function<void(uint64_t, uint64_t)> progress;
};

// The size of the file ExecutePlan writes for `archive`, computed without reading a source byte
// (TorchArchiveWriter::PlannedSize over its storages' segment bytes).
Result<uint64_t> PlannedArchiveSize(const ArchiveOutput& archive);

// The size of the file ExecutePlan writes for `plan`'s only output, computed without reading a
// source byte: a torch archive (PlannedArchiveSize), a copy (its source's size in `index`), a
// text. nullopt for a safetensors output; kInvalidArgument when the plan does not hold exactly one
// output.
Result<std::optional<uint64_t>> PlannedFileSize(const OutputPlan& plan, const AtomIndex& index);

// Writes every output of `plan` under `out_dir` (which must exist), reading the files of `index`
// relative to `tag_dir`. Every source file is checked against the index's size before it is
// read; a source shorter than a segment needs is kCorrupt naming the file. A source with chunk
// hashes in the index has every chunk this call reads checked as it is read (CheckedSource):
// kCorrupt naming the file, the byte range and the atoms it holds. Sources without them are
// not checked here: the caller checks them whole first (VerifySources). This call does not read
// what it copies unchanged: a CopyOutput's file, and a storage that is exactly one record of a
// zip source (one segment, not widened), which keeps the CRC-32 of the source's central
// directory (whose bytes are checked against the chunk hashes first). Each output is written
// to a temporary name and renamed, so on failure no output path holds a partial file (outputs
// already completed stay; the caller writes into a temporary directory when the set must be
// all-or-nothing).
[[nodiscard]] Status ExecutePlan(const OutputPlan& plan, const AtomIndex& index,
                                 const std::string& tag_dir, const std::string& out_dir,
                                 const ExecuteOptions& options);

// One archive built in parts by several processes into one shared file (the view cache's large
// files, such as the model states every rank reads, which one process would otherwise build
// while the job waits): each part writes a byte range of the archive's storages, the storages
// taken one after another in the archive's record order (by key), at their offsets in the whole
// archive, and reports the CRC-32 of each storage piece it wrote; once every part is written, one
// process writes the rest (data.pkl, the headers, the directory) and renames the file into place.
// The bytes are those ExecutePlan writes. A storage may be cut anywhere on a 64-byte boundary of
// its own: one storage can be the whole archive (DeepSpeed's ZeRO-1/2 model states hold the
// module's parameters in one flat buffer).
struct ArchivePart {
  uint64_t begin = 0;  // in the storages' concatenated bytes
  uint64_t end = 0;
};

// The CRC-32 of bytes [offset, offset + length) of storage `key`, as a part wrote them; or, with
// `record_crc`, the CRC-32 of the whole storage: it is one source record copied unchanged, whose
// pieces moved with copy_file_range and whose CRC is the source directory's.
struct StoragePieceCrc {
  std::string key;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t crc32 = 0;
  bool record_crc = false;
  bool operator==(const StoragePieceCrc&) const = default;
};

// `archive`'s storage bytes cut into parts of at least `part_bytes` each (less than twice that;
// one part when the archive holds less than twice that), in order.
Result<std::vector<ArchivePart>> PlanArchiveParts(const ArchiveOutput& archive,
                                                  uint64_t part_bytes);

// Writes `part` of `archive` into `parts_path` (created where missing and sized to the whole
// archive; never truncated), reading the sources of `index` under `tag_dir` as ExecutePlan does
// (sizes checked, chunk hashes checked as read, a storage that is one source record copied
// unseen; only the part's sources opened), then syncs it (options.sync). Returns the CRC-32 of
// each storage piece written (a copied record's: the whole record's, `record_crc`). A part
// written twice writes the same bytes.
[[nodiscard]] Result<std::vector<StoragePieceCrc>> ExecuteArchivePart(
    const ArchiveOutput& archive, const ArchivePart& part, const AtomIndex& index,
    const std::string& tag_dir, const std::string& parts_path, const ExecuteOptions& options);

// Completes `archive` in `parts_path` from the pieces every part wrote (`pieces`, in any order,
// each storage's tiling it exactly: kFailedPrecondition naming the storage otherwise), then
// renames `parts_path` to `out_dir`/`archive.path` (synced as options.sync says); `parts_path`
// stays where this fails.
[[nodiscard]] Status FinishArchiveParts(const ArchiveOutput& archive,
                                        std::span<const StoragePieceCrc> pieces,
                                        const std::string& parts_path, const std::string& out_dir,
                                        const ExecuteOptions& options);

// Pieces as text, a line "<key> <offset> <length> <crc32 hex>" each, with " record" after it for
// a record's CRC (what a part's mark holds),
// and back: kCorrupt naming `where` and the line for anything else.
std::string PieceCrcsText(std::span<const StoragePieceCrc> pieces);
Result<std::vector<StoragePieceCrc>> ParsePieceCrcs(std::string_view text,
                                                    const std::string& where);

}  // namespace ucp
