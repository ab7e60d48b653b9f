#include "core/plan/executor.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "core/format/crc32.h"
#include "core/format/safetensors_writer.h"
#include "core/format/torch_archive_writer.h"
#include "core/format/zip_reader.h"
#include "core/io/byte_run.h"
#include "core/io/checked_source.h"
#include "core/io/fault_injection.h"
#include "core/io/file.h"
#include "core/util/checked.h"
#include "core/util/path.h"
#include "core/util/reentrancy_guard.h"

namespace ucp {
namespace {

constexpr unsigned kMaxDefaultThreads = 8;
// Verbatim copies are cut into pieces of this size so that progress moves.
constexpr uint64_t kCopyProgressStep = uint64_t{64} << 20;

std::string Parent(const std::string& relative) {
  const size_t slash = relative.rfind('/');
  return slash == std::string::npos ? std::string() : relative.substr(0, slash);
}

// What the workers share: the opened sources and the progress counter.
class Execution {
 public:
  Execution(const AtomIndex& index, const std::string& out_dir, const ExecuteOptions& options,
            uint64_t total)
      : index_(index), out_dir_(out_dir), options_(options), total_(total) {}

  // Opens every source file `plan` reads, once, and checks its size against the index. A file
  // with chunk hashes is read through a CheckedSource.
  Status OpenSources(const std::set<uint32_t>& used, const std::string& tag_dir) {
    sources_.resize(index_.files().size());
    checked_.resize(index_.files().size());
    for (const uint32_t f : used) {
      const IndexedFile& indexed = index_.files()[f];
      UCP_ASSIGN_OR_RETURN(sources_[f], File::OpenBeneath(tag_dir, indexed.path));
      UCP_ASSIGN_OR_RETURN(const uint64_t size, sources_[f].Size());
      if (size != indexed.size) {
        return Status::Corrupt("execute plan: source " + sources_[f].path() + " has " +
                               std::to_string(size) + " bytes, the index says " +
                               std::to_string(indexed.size) +
                               " (truncated, or changed since it was indexed)");
      }
      if (indexed.chunks.recorded()) {
        checked_[f] = std::make_unique<CheckedSource>(
            sources_[f], size, indexed.chunks, [this, f](uint64_t begin, uint64_t end) {
              if (options_.locate_damage) return options_.locate_damage(f, begin, end);
              const std::string held = AtomsWithin(index_, f, begin, end);
              return held.empty() ? held : "they hold " + held;
            });
      }
    }
    return Status::Ok();
  }

  // Reads the record directories of `files` (sources opened by OpenSources) that are zip
  // archives, so that a storage which is one whole record of one of them moves unseen with that
  // record's CRC-32 (UnchangedRecordCrc). A file that does not open as a zip archive (safetensors,
  // damaged headers) has no records here: its bytes are read and checked as the plan reads them.
  // Where the file has chunk hashes, the bytes from its last record's data to its end (the
  // central directory the CRCs come from) are checked against them first.
  Status LoadRecordCrcs(const std::set<uint32_t>& files, const std::string& tag_dir) {
    record_crcs_.resize(index_.files().size());
    for (const uint32_t f : files) {
      const IndexedFile& indexed = index_.files()[f];
      UCP_ASSIGN_OR_RETURN(File again, File::OpenBeneath(tag_dir, indexed.path));
      Result<ZipReader> zip = ZipReader::Open(std::move(again), ZipReader::Limits{});
      if (!zip.ok()) continue;
      uint64_t directory = 0;
      for (const ZipRecord& record : zip->records()) {
        directory = std::max(directory, record.data_offset + record.size);
      }
      if (checked_[f] != nullptr && directory < indexed.size) {
        std::vector<std::byte> buffer(
            std::min<uint64_t>(options_.chunk_bytes, indexed.size - directory));
        ChunkCache cache;
        for (uint64_t at = directory; at < indexed.size;) {
          const uint64_t n = std::min<uint64_t>(buffer.size(), indexed.size - at);
          UCP_RETURN_IF_ERROR(checked_[f]->ReadAt(at, std::span(buffer.data(), n), cache));
          at += n;
        }
      }
      for (const ZipRecord& record : zip->records()) {
        record_crcs_[f][record.data_offset] = {record.size, record.crc32};
      }
    }
    return Status::Ok();
  }

  // The CRC-32 of the source record whose data `segments` are, whole and unchanged (one segment,
  // not widened, exactly a record's data in a file LoadRecordCrcs read); nullopt otherwise.
  std::optional<uint32_t> UnchangedRecordCrc(const std::vector<Segment>& segments) const {
    if (segments.size() != 1) return std::nullopt;
    const Segment& segment = segments.front();
    if (segment.zero_fill() || segment.widen_bf16 || segment.file >= record_crcs_.size()) {
      return std::nullopt;
    }
    const auto record = record_crcs_[segment.file].find(segment.offset);
    if (record == record_crcs_[segment.file].end() || record->second.size != segment.length) {
      return std::nullopt;
    }
    return record->second.crc32;
  }

  std::vector<ByteRun> Runs(const std::vector<Segment>& segments) const {
    std::vector<ByteRun> runs;
    runs.reserve(segments.size());
    for (const Segment& segment : segments) {
      if (segment.zero_fill()) {
        runs.push_back({nullptr, segment.offset, segment.length});
      } else {
        runs.push_back({&sources_[segment.file], segment.offset, segment.length,
                        checked_[segment.file].get(), segment.widen_bf16});
      }
    }
    return runs;
  }

  std::string OutPath(const std::string& relative) const { return out_dir_ + "/" + relative; }

  void Progress(uint64_t bytes) {
    if (!options_.progress) return;
    std::lock_guard lock(progress_mutex_);
    done_ += bytes;
    options_.progress(done_, total_);
  }
  std::function<void(uint64_t)> ProgressHook() {
    if (!options_.progress) return {};
    return [this](uint64_t bytes) { Progress(bytes); };
  }

  Status Write(const ArchiveOutput& output) {
    TorchArchiveWriter::Options writer_options;
    writer_options.archive_name = output.archive_name;
    writer_options.sync = options_.sync;
    writer_options.copy_buffer_bytes = options_.chunk_bytes;
    writer_options.progress = ProgressHook();
    UCP_ASSIGN_OR_RETURN(TorchArchiveWriter writer,
                         TorchArchiveWriter::Create(OutPath(output.path), writer_options));
    for (const OutputStorage& storage : output.storages) {
      if (const std::optional<uint32_t> crc = UnchangedRecordCrc(storage.segments)) {
        const Segment& record = storage.segments.front();
        UCP_RETURN_IF_ERROR(writer.AddStorageFromFile(storage.key, sources_[record.file],
                                                      record.offset, record.length, crc));
      } else {
        UCP_RETURN_IF_ERROR(writer.AddStorageFromRuns(storage.key, Runs(storage.segments)));
      }
    }
    return writer.Finish(output.graph.root()).status();
  }

  // Streams `runs` into `out` from byte `at` on: the CRC-32 of the bytes written.
  Result<uint32_t> WritePiece(std::span<const ByteRun> runs, File& out, uint64_t at) {
    std::unique_ptr<std::byte[]> buffer(new std::byte[options_.chunk_bytes]);
    Crc32Stream crc;
    uint64_t done = 0;
    const Status streamed = StreamRuns(runs, std::span(buffer.get(), options_.chunk_bytes),
                                       [&](std::span<const std::byte> piece) -> Status {
                                         crc.Update(piece);
                                         UCP_RETURN_IF_ERROR(out.WriteAt(at + done, piece));
                                         done += piece.size();
                                         Progress(piece.size());
                                         return Status::Ok();
                                       });
    UCP_RETURN_IF_ERROR(streamed);
    return crc.value();
  }

  Status Write(const SafetensorsOutput& output) {
    SafetensorsWriter writer;
    for (const SafetensorsOutputTensor& tensor : output.tensors) {
      UCP_RETURN_IF_ERROR(
          writer.AddFromRuns(tensor.name, tensor.dtype, tensor.shape, Runs(tensor.segments)));
    }
    for (const auto& [key, value] : output.metadata) {
      UCP_RETURN_IF_ERROR(writer.SetMetadata(key, value));
    }
    return writer.Write(OutPath(output.path), {options_.sync, ProgressHook()});
  }

  Status Write(const CopyOutput& output) {
    const File& source = sources_[output.file];
    const uint64_t size = index_.files()[output.file].size;
    const std::string path = OutPath(output.path);
    static std::atomic<uint64_t> counter{0};
    const std::string temp = path + ".ucp-tmp-" + std::to_string(::getpid()) + "-" +
                             std::to_string(counter.fetch_add(1));
    UCP_ASSIGN_OR_RETURN(File out, File::Open(temp, File::Mode::kCreateExclusive));
    Status status = CopyUnseen(source, 0, out, 0, size);
    if (status.ok() && options_.sync) status = out.Sync();
    if (status.ok()) status = out.Close();
    if (status.ok()) status = RenameFile(temp, path);
    if (!status.ok()) {
      (void)out.Close();  // already failing: the first error is the one reported
      (void)RemoveFile(temp);
    }
    return status.WithContext("execute plan: copy " + source.path() + " to " + path);
  }

  // Bytes [offset, offset + size) of `source` to `out` at `at` with copy_file_range (a reflink
  // where the file system has one): the bytes never pass through this process, so they are not
  // checked against the source's chunk hashes; whole files and whole zip records, whose CRC-32s
  // travel with them, move this way.
  Status CopyUnseen(const File& source, uint64_t offset, File& out, uint64_t at, uint64_t size) {
    for (uint64_t done = 0; done < size;) {
      const uint64_t n = std::min(size - done, kCopyProgressStep);
      UCP_RETURN_IF_ERROR(CopyRange(source, offset + done, out, at + done, n));
      Progress(n);
      done += n;
    }
    return Status::Ok();
  }

  // Bytes [lo, hi) of a storage that is one whole source record (UnchangedRecordCrc), unseen.
  Status CopyRecordPiece(const Segment& record, uint64_t lo, uint64_t hi, File& out, uint64_t at) {
    return CopyUnseen(sources_[record.file], record.offset + lo, out, at, hi - lo);
  }

  Status Write(const TextOutput& output) {
    return WriteFileAtomically(OutPath(output.path), output.contents, options_.sync);
  }

 private:
  const AtomIndex& index_;
  const std::string& out_dir_;
  const ExecuteOptions& options_;
  const uint64_t total_;
  std::vector<File> sources_;  // by index file number; open only where the plan reads
  std::vector<std::unique_ptr<CheckedSource>> checked_;  // by file number; where it has chunks
  struct RecordCrc {
    uint64_t size;
    uint32_t crc32;
  };
  // By file number, then by the data offset of each record (LoadRecordCrcs).
  std::vector<std::map<uint64_t, RecordCrc>> record_crcs_;
  std::mutex progress_mutex_;
  uint64_t done_ = 0;
};

// One output file to write, with its byte weight for scheduling.
struct Task {
  uint64_t bytes;
  std::function<Status(Execution&)> run;
};

Status CheckSegments(const std::vector<Segment>& segments, const AtomIndex& index,
                     const std::string& where, std::set<uint32_t>& used) {
  for (const Segment& segment : segments) {
    if (segment.zero_fill()) continue;
    if (segment.file >= index.files().size()) {
      return Status::InvalidArgument(where + ": segment of source file " +
                                     std::to_string(segment.file) + ", the index has " +
                                     std::to_string(index.files().size()));
    }
    const IndexedFile& file = index.files()[segment.file];
    if (segment.widen_bf16 && segment.length % 4 != 0) {
      return Status::InvalidArgument(where + ": a widened segment of " +
                                     std::to_string(segment.length) + " bytes, not whole float32s");
    }
    if (!RangeWithin(segment.offset, segment.source_length(), file.size)) {
      return Status::InvalidArgument(where + ": segment [" + std::to_string(segment.offset) +
                                     ", +" + std::to_string(segment.source_length()) +
                                     ") is outside " + file.path + " (" +
                                     std::to_string(file.size) + " bytes)");
    }
    used.insert(segment.file);
  }
  return Status::Ok();
}

// Adds the source file of `segments` to `files` where they are one plain segment: a storage that
// may be a whole source record, copied unchanged (Execution::UnchangedRecordCrc).
void AddRecordSource(const std::vector<Segment>& segments, std::set<uint32_t>& files) {
  if (segments.size() == 1 && !segments.front().zero_fill() && !segments.front().widen_bf16) {
    files.insert(segments.front().file);
  }
}

}  // namespace

Result<uint64_t> PlannedArchiveSize(const ArchiveOutput& archive) {
  std::map<std::string, uint64_t> storage_sizes;
  for (const OutputStorage& storage : archive.storages) {
    storage_sizes[storage.key] = SegmentBytes(storage.segments);
  }
  TorchArchiveWriter::Options options;
  options.archive_name = archive.archive_name;
  return TorchArchiveWriter::PlannedSize(archive.path, options, archive.graph.root(),
                                         storage_sizes);
}

Result<std::optional<uint64_t>> PlannedFileSize(const OutputPlan& plan, const AtomIndex& index) {
  const size_t outputs =
      plan.archives.size() + plan.safetensors.size() + plan.copies.size() + plan.texts.size();
  if (outputs != 1) {
    return Status::InvalidArgument("planned file size: the plan holds " + std::to_string(outputs) +
                                   " outputs, not one");
  }
  if (!plan.archives.empty()) {
    UCP_ASSIGN_OR_RETURN(const uint64_t size, PlannedArchiveSize(plan.archives.front()));
    return std::optional<uint64_t>(size);
  }
  if (!plan.copies.empty()) {
    const uint32_t file = plan.copies.front().file;
    if (file >= index.files().size()) {
      return Status::InvalidArgument("planned file size: copy of source file " +
                                     std::to_string(file) + ", the index has " +
                                     std::to_string(index.files().size()));
    }
    return std::optional<uint64_t>(index.files()[file].size);
  }
  if (!plan.texts.empty()) return std::optional<uint64_t>(plan.texts.front().contents.size());
  return std::optional<uint64_t>();
}

uint64_t OutputPlan::DataBytes() const {
  uint64_t total = 0;
  for (const ArchiveOutput& archive : archives) {
    for (const OutputStorage& storage : archive.storages) total += SegmentBytes(storage.segments);
  }
  for (const SafetensorsOutput& output : safetensors) {
    for (const SafetensorsOutputTensor& tensor : output.tensors) {
      total += SegmentBytes(tensor.segments);
    }
  }
  return total;
}

namespace {

constexpr uint64_t kPartGrain = 64;  // a storage is cut only at multiples of this, of its own
// At most this many parts (then larger ones): bounds the leases and marks of one file, and keeps
// the cut arithmetic below within 64 bits.
constexpr uint64_t kMaxParts = uint64_t{1} << 20;

// The archive's storages in record order (by key).
std::vector<const OutputStorage*> StoragesByKey(const ArchiveOutput& archive) {
  std::vector<const OutputStorage*> storages;
  for (const OutputStorage& storage : archive.storages) storages.push_back(&storage);
  std::sort(storages.begin(), storages.end(),
            [](const OutputStorage* a, const OutputStorage* b) { return a->key < b->key; });
  return storages;
}

// Bytes [begin, end) of the concatenation of `segments` (a cut inside a widened segment falls on
// a whole float32 of its output: its offset in the segment is a multiple of 4).
std::vector<Segment> SliceSegments(const std::vector<Segment>& segments, uint64_t begin,
                                   uint64_t end) {
  std::vector<Segment> slice;
  uint64_t at = 0;
  for (const Segment& segment : segments) {
    const uint64_t lo = std::max(begin, at);
    const uint64_t hi = std::min(end, at + segment.length);
    if (lo < hi) {
      Segment piece = segment;
      const uint64_t skip = lo - at;
      if (!segment.zero_fill()) piece.offset += segment.widen_bf16 ? skip / 2 : skip;
      piece.length = hi - lo;
      slice.push_back(piece);
    }
    at += segment.length;
  }
  return slice;
}

std::map<std::string, uint64_t> StorageSizes(const ArchiveOutput& archive) {
  std::map<std::string, uint64_t> sizes;
  for (const OutputStorage& storage : archive.storages) {
    sizes[storage.key] = SegmentBytes(storage.segments);
  }
  return sizes;
}

// The writer's options for `archive` built in parts; with its path, whose stem names the archive
// where archive_name is empty, they give the parts and the finisher the same layout.
TorchArchiveWriter::Options PartsWriterOptions(const ArchiveOutput& archive,
                                               const ExecuteOptions& options) {
  TorchArchiveWriter::Options writer_options;
  writer_options.archive_name = archive.archive_name;
  writer_options.sync = options.sync;
  return writer_options;
}

}  // namespace

Result<std::vector<ArchivePart>> PlanArchiveParts(const ArchiveOutput& archive,
                                                  uint64_t part_bytes) {
  if (part_bytes == 0) return Status::InvalidArgument("archive parts: parts of 0 bytes");
  const std::vector<const OutputStorage*> storages = StoragesByKey(archive);
  uint64_t total = 0;
  for (const OutputStorage* storage : storages) total += SegmentBytes(storage->segments);
  const uint64_t count = std::clamp<uint64_t>(total / part_bytes, 1, kMaxParts);
  // Cut k of count at k·total/count, moved back to a 64-byte boundary of the storage it falls in.
  std::vector<uint64_t> cuts = {0};
  size_t s = 0;
  uint64_t storage_start = 0;
  for (uint64_t k = 1; k < count; ++k) {
    const uint64_t cut = total / count * k + total % count * k / count;
    while (storage_start + SegmentBytes(storages[s]->segments) <= cut) {
      storage_start += SegmentBytes(storages[s]->segments);
      ++s;
    }
    const uint64_t snapped = cut - (cut - storage_start) % kPartGrain;
    if (snapped > cuts.back()) cuts.push_back(snapped);
  }
  cuts.push_back(total);
  std::vector<ArchivePart> parts;
  for (size_t k = 0; k + 1 < cuts.size(); ++k) parts.push_back({cuts[k], cuts[k + 1]});
  if (parts.empty()) parts.push_back({0, 0});
  return parts;
}

Result<std::vector<StoragePieceCrc>> ExecuteArchivePart(
    const ArchiveOutput& archive, const ArchivePart& part, const AtomIndex& index,
    const std::string& tag_dir, const std::string& parts_path, const ExecuteOptions& options) {
  const std::string where = "execute plan: part [" + std::to_string(part.begin) + ", " +
                            std::to_string(part.end) + ") of " + archive.path;
  if (options.chunk_bytes == 0) {
    return Status::InvalidArgument(where + ": a copy buffer of 0 bytes");
  }
  const std::map<std::string, uint64_t> sizes = StorageSizes(archive);
  using Offsets = std::map<std::string, uint64_t>;
  UCP_ASSIGN_OR_RETURN(
      const Offsets data_offsets,
      TorchArchiveWriter::PlannedStorageOffsets(archive.path, PartsWriterOptions(archive, options),
                                                archive.graph.root(), sizes));
  // The part's piece of each storage it overlaps: [lo, hi) of the storage.
  struct Piece {
    const OutputStorage* storage;
    uint64_t lo;
    uint64_t hi;
  };
  std::vector<Piece> pieces;
  std::set<uint32_t> used;
  std::set<uint32_t> record_sources;
  uint64_t bytes = 0;
  uint64_t start = 0;
  for (const OutputStorage* storage : StoragesByKey(archive)) {
    const uint64_t size = sizes.at(storage->key);
    const uint64_t lo = std::max(part.begin, start);
    const uint64_t hi = std::min(part.end, start + size);
    if (lo < hi) {
      UCP_RETURN_IF_ERROR(
          CheckSegments(storage->segments, index, where + " storage " + storage->key, used));
      AddRecordSource(storage->segments, record_sources);
      pieces.push_back({storage, lo - start, hi - start});
      bytes += hi - lo;
    }
    start += size;
  }
  if (part.begin > part.end || part.end > start) {
    return Status::InvalidArgument(where + ": outside the archive's " + std::to_string(start) +
                                   " storage bytes");
  }
  UCP_ASSIGN_OR_RETURN(const uint64_t size, PlannedArchiveSize(archive));
  // Whoever comes first creates it; a second opener, on any node, opens the same file.
  Result<File> file = File::Open(parts_path, File::Mode::kCreateExclusive);
  if (!file.ok()) file = File::Open(parts_path, File::Mode::kReadWrite);
  UCP_RETURN_IF_ERROR(file.status().WithContext(where));
  UCP_ASSIGN_OR_RETURN(const uint64_t had, file->Size());
  if (had < size) UCP_RETURN_IF_ERROR(file->Truncate(size).WithContext(where));
  // The writer's path (messages); Execution keeps a reference.
  const std::string out_dir = Parent(parts_path);
  Execution execution(index, out_dir, options, bytes);
  UCP_RETURN_IF_ERROR(execution.OpenSources(used, tag_dir));
  UCP_RETURN_IF_ERROR(execution.LoadRecordCrcs(record_sources, tag_dir).WithContext(where));
  std::vector<StoragePieceCrc> crcs;
  for (const Piece& piece : pieces) {
    const uint64_t at = data_offsets.at(piece.storage->key) + piece.lo;
    if (const std::optional<uint32_t> record_crc =
            execution.UnchangedRecordCrc(piece.storage->segments)) {
      const Status copied =
          execution.CopyRecordPiece(piece.storage->segments.front(), piece.lo, piece.hi, *file, at);
      if (!copied.ok()) return copied.WithContext(where + " storage " + piece.storage->key);
      crcs.push_back({piece.storage->key, piece.lo, piece.hi - piece.lo, *record_crc, true});
      continue;
    }
    const std::vector<ByteRun> runs =
        execution.Runs(SliceSegments(piece.storage->segments, piece.lo, piece.hi));
    Result<uint32_t> crc = execution.WritePiece(runs, *file, at);
    if (!crc.ok()) return crc.status().WithContext(where + " storage " + piece.storage->key);
    crcs.push_back({piece.storage->key, piece.lo, piece.hi - piece.lo, *crc});
  }
  if (options.sync) UCP_RETURN_IF_ERROR(file->Sync().WithContext(where));
  UCP_RETURN_IF_ERROR(file->Close().WithContext(where));
  return crcs;
}

Status FinishArchiveParts(const ArchiveOutput& archive, std::span<const StoragePieceCrc> pieces,
                          const std::string& parts_path, const std::string& out_dir,
                          const ExecuteOptions& options) {
  const std::string path = out_dir + "/" + archive.path;
  const std::string where = "execute plan: finish the parts of " + path;
  if (!IsNormalRelativePath(archive.path)) {
    return Status::InvalidArgument("execute plan: output path \"" + archive.path +
                                   "\" is not a normalised path inside " + out_dir);
  }
  const std::map<std::string, uint64_t> sizes = StorageSizes(archive);
  // Each storage's pieces in order, which must tile it; their CRCs combined.
  std::map<std::string, std::map<uint64_t, const StoragePieceCrc*>> by_storage;
  for (const StoragePieceCrc& piece : pieces) by_storage[piece.key][piece.offset] = &piece;
  std::map<std::string, uint32_t> crcs;
  for (const auto& [key, size] : sizes) {
    uint64_t covered = 0;
    uint32_t crc = 0;
    std::optional<uint32_t> record_crc;  // every piece's, where the pieces copied a record
    size_t record_pieces = 0;
    for (const auto& [offset, piece] : by_storage[key]) {
      if (offset != covered) break;
      crc = Crc32Combine(crc, piece->crc32, piece->length);
      if (piece->record_crc) {
        if (record_crc.value_or(piece->crc32) != piece->crc32) {
          return Status::FailedPrecondition(where + ": storage " + key +
                                            "'s pieces name two CRC-32s of its source record");
        }
        record_crc = piece->crc32;
        ++record_pieces;
      }
      covered += piece->length;
    }
    if (covered != size) {
      return Status::FailedPrecondition(where + ": storage " + key + " has " +
                                        std::to_string(size) + " bytes, its parts wrote [0, " +
                                        std::to_string(covered) + ") in one run");
    }
    if (record_pieces != 0 && record_pieces != by_storage[key].size()) {
      return Status::FailedPrecondition(where + ": storage " + key +
                                        " has pieces copied from a source record and pieces " +
                                        "written through memory (parts of two builds)");
    }
    crcs[key] = record_crc.value_or(crc);
  }
  UCP_ASSIGN_OR_RETURN(File file, File::Open(parts_path, File::Mode::kReadWrite));
  return TorchArchiveWriter::FinishParts(path, PartsWriterOptions(archive, options),
                                         archive.graph.root(), sizes, crcs, std::move(file))
      .status()
      .WithContext(where);
}

std::string PieceCrcsText(std::span<const StoragePieceCrc> pieces) {
  std::string text;
  for (const StoragePieceCrc& piece : pieces) {
    char crc[9];
    std::snprintf(crc, sizeof(crc), "%08x", piece.crc32);
    text += piece.key + " " + std::to_string(piece.offset) + " " + std::to_string(piece.length) +
            " " + crc + (piece.record_crc ? " record\n" : "\n");
  }
  return text;
}

Result<std::vector<StoragePieceCrc>> ParsePieceCrcs(std::string_view text,
                                                    const std::string& where) {
  std::vector<StoragePieceCrc> pieces;
  size_t line_number = 0;
  while (!text.empty()) {
    ++line_number;
    const size_t newline = text.find('\n');
    const std::string_view line = text.substr(0, newline);
    text = newline == std::string_view::npos ? std::string_view() : text.substr(newline + 1);
    StoragePieceCrc piece;
    std::vector<std::string_view> fields;
    for (size_t at = 0; at <= line.size();) {
      const size_t space = std::min(line.find(' ', at), line.size());
      fields.push_back(line.substr(at, space - at));
      at = space + 1;
    }
    const auto number = [](std::string_view field, int base, auto& out) {
      const auto [rest, error] =
          std::from_chars(field.data(), field.data() + field.size(), out, base);
      return !field.empty() && error == std::errc() && rest == field.data() + field.size();
    };
    piece.record_crc = fields.size() == 5 && fields[4] == "record";
    if ((fields.size() != 4 && !piece.record_crc) || fields[0].empty() ||
        !number(fields[1], 10, piece.offset) || !number(fields[2], 10, piece.length) ||
        fields[3].size() != 8 || !number(fields[3], 16, piece.crc32)) {
      return Status::Corrupt(where + ": line " + std::to_string(line_number) + " \"" +
                             std::string(line.substr(0, 200)) +
                             "\" is not \"<storage> <offset> <length> <crc32 hex>[ record]\"");
    }
    piece.key = std::string(fields[0]);
    pieces.push_back(std::move(piece));
  }
  return pieces;
}

Status ExecutePlan(const OutputPlan& plan, const AtomIndex& index, const std::string& tag_dir,
                   const std::string& out_dir, const ExecuteOptions& options) {
  if (options.chunk_bytes == 0) {
    return Status::InvalidArgument("execute plan: a copy buffer of 0 bytes");
  }
  // Everything is checked before the first byte is written.
  std::vector<Task> tasks;
  std::set<std::string> paths;
  std::set<uint32_t> used;
  std::set<uint32_t> record_sources;
  const auto add_path = [&](const std::string& path) -> Status {
    if (!IsNormalRelativePath(path)) {
      return Status::InvalidArgument("execute plan: output path \"" + path +
                                     "\" is not a normalised path inside " + out_dir);
    }
    if (!paths.insert(path).second) {
      return Status::InvalidArgument("execute plan: output path \"" + path + "\" is planned twice");
    }
    return Status::Ok();
  };
  for (const ArchiveOutput& output : plan.archives) {
    UCP_RETURN_IF_ERROR(add_path(output.path));
    uint64_t bytes = 0;
    for (const OutputStorage& storage : output.storages) {
      UCP_RETURN_IF_ERROR(CheckSegments(storage.segments, index,
                                        "execute plan: " + output.path + " storage " + storage.key,
                                        used));
      AddRecordSource(storage.segments, record_sources);
      bytes += SegmentBytes(storage.segments);
    }
    tasks.push_back({bytes, [&output](Execution& e) { return e.Write(output); }});
  }
  for (const SafetensorsOutput& output : plan.safetensors) {
    UCP_RETURN_IF_ERROR(add_path(output.path));
    uint64_t bytes = 0;
    for (const SafetensorsOutputTensor& tensor : output.tensors) {
      UCP_RETURN_IF_ERROR(CheckSegments(
          tensor.segments, index, "execute plan: " + output.path + " tensor " + tensor.name, used));
      bytes += SegmentBytes(tensor.segments);
    }
    tasks.push_back({bytes, [&output](Execution& e) { return e.Write(output); }});
  }
  uint64_t copied = 0;
  for (const CopyOutput& output : plan.copies) {
    UCP_RETURN_IF_ERROR(add_path(output.path));
    if (output.file >= index.files().size()) {
      return Status::InvalidArgument("execute plan: " + output.path + ": copy of source file " +
                                     std::to_string(output.file) + ", the index has " +
                                     std::to_string(index.files().size()));
    }
    used.insert(output.file);
    copied += index.files()[output.file].size;
    tasks.push_back(
        {index.files()[output.file].size, [&output](Execution& e) { return e.Write(output); }});
  }
  for (const TextOutput& output : plan.texts) {
    UCP_RETURN_IF_ERROR(add_path(output.path));
    tasks.push_back({output.contents.size(), [&output](Execution& e) { return e.Write(output); }});
  }

  Execution execution(index, out_dir, options, plan.DataBytes() + copied);
  UCP_RETURN_IF_ERROR(execution.OpenSources(used, tag_dir));
  UCP_RETURN_IF_ERROR(
      execution.LoadRecordCrcs(record_sources, tag_dir).WithContext("execute plan"));

  // Directories: create what is missing, remembering what was created so that its entry in its
  // parent can be made durable.
  std::set<std::string> parents;
  for (const std::string& path : paths) parents.insert(Parent(path));
  std::vector<std::string> created;
  for (const std::string& parent : parents) {
    for (std::string dir = parent; !dir.empty(); dir = Parent(dir)) {
      std::error_code error;
      if (std::filesystem::is_directory(out_dir + "/" + dir, error)) break;
      created.push_back(dir);
    }
    if (!parent.empty()) UCP_RETURN_IF_ERROR(CreateDirectories(out_dir + "/" + parent));
  }

  // Biggest first, so that one large file does not start last and run alone.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.bytes > b.bytes; });
  unsigned threads = options.threads;
  if (threads == 0)
    threads = std::clamp(std::thread::hardware_concurrency(), 1u, kMaxDefaultThreads);
  threads = static_cast<unsigned>(std::min<size_t>(threads, tasks.size()));

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  Status first_error;
  const auto work = [&] {
    for (size_t t = next++; t < tasks.size() && !failed; t = next++) {
      Status status = tasks[t].run(execution);
      if (!status.ok()) {
        std::lock_guard lock(error_mutex);
        if (!failed.exchange(true)) first_error = std::move(status);
      }
    }
  };
  std::vector<std::thread> workers;
  for (unsigned w = 1; w < threads; ++w) {
    // Inside the preload these threads do ucp's own I/O, which the hooks must never see or serve;
    // it belongs to the phase that started them.
    workers.emplace_back([&work, phase = CurrentIoPhase()] {
      ReentrancyGuard guard;
      IoPhaseScope phase_scope(phase);
      work();
    });
  }
  work();
  for (std::thread& worker : workers) worker.join();
  UCP_RETURN_IF_ERROR(first_error);

  if (options.sync) {
    // The writers fsync the directory they rename into; created directories also need their
    // own entries made durable in their parents.
    std::set<std::string> synced;
    for (const std::string& dir : created) {
      const std::string parent = Parent(dir);
      if (synced.insert(parent).second) {
        UCP_RETURN_IF_ERROR(SyncDirectory(parent.empty() ? out_dir : out_dir + "/" + parent));
      }
    }
    for (const std::string& parent : parents) {
      if (synced.insert(parent).second) {
        UCP_RETURN_IF_ERROR(SyncDirectory(parent.empty() ? out_dir : out_dir + "/" + parent));
      }
    }
  }
  return Status::Ok();
}

}  // namespace ucp
