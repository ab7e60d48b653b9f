// ZipWriter: writes a zip archive byte-compatible with torch's PyTorchStreamWriter as torch 1.13
// writes it (miniz in ZIP64 mode), streaming record data from memory or from another file.
//
// Byte layout written (little-endian; see zip_reader.h for the field-level format):
//
//   for each record, in AddRecord order, name = "<archive_name>/<name>":
//     local file header  PK\3\4, version needed 0, flags 0x0808 (UTF-8 name, data descriptor;
//                        0x0800 for an empty record), method 0, time/date 0, crc/sizes 0
//     name
//     [ZIP64 extra 0x0001]  only when size >= 0xFFFFFFFF or header offset >= 0xFFFFFFFF
//                           (or Options::force_zip64): [size, 0]? [header offset]?
//     'FB' extra            id 0x4246, u16 n, n x 'Z' — pads so the data starts at a multiple of 64
//     data
//     data descriptor    PK\7\8 crc32 + sizes as 4+4 bytes (8+8 when the ZIP64 extra is present);
//                        omitted for an empty record
//   central directory: PK\1\2 per record (version 0, same flags, real crc, sizes/offset or
//                      0xFFFFFFFF + ZIP64 extra [size, size]? [offset]?)
//   ZIP64 end of central directory record (PK\6\6) and locator (PK\6\7), always
//   end of central directory record (PK\5\6), counts/size/offset capped at 0xFFFF / 0xFFFFFFFF,
//   no comment.
// Rewriting a torch 1.13 file record by record with this writer reproduces it byte for byte
// (checked by the tests, and by hand for a 4 GiB + 1.5 KiB file with ZIP64 size and offset fields).
//
// The zip layer writes only what it is given: torch's `version` record (and `data.pkl`, `byteorder`
// ...) are the archive layer's to add.
//
// Atomicity: records go to a temporary file "<path>.ucp-tmp-<pid>-<n>" in the same directory;
// Finish() writes the directory, fsyncs (Options::sync), renames it to `path` and fsyncs the
// directory. A ZipWriter destroyed before Finish() succeeded, or whose Finish() failed, removes the
// temporary: `path` is either untouched or the complete archive.
//
// Memory: the central directory (~100 bytes per record) plus one bounded copy buffer; record data
// is never held whole.
//
// Thread-safety: none; one thread drives a writer. Call order: Create → AddRecord* /
// AddRecordFromFile* / AddRecordFromRuns* → Finish. After a failed write (I/O error, source too
// short) the writer is poisoned: later calls fail with kFailedPrecondition and the temporary is
// removed on destruction. A rejected name (kInvalidArgument) writes nothing and does not poison it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "core/format/zip_reader.h"
#include "core/io/byte_run.h"
#include "core/io/file.h"
#include "core/util/status.h"

namespace ucp {

class ZipWriter {
 public:
  static constexpr uint64_t kAlignment = 64;

  struct Options {
    // The top-level folder (torch: the saved file's stem, or "archive"): non-empty, no '/'.
    std::string archive_name = "archive";
    // Writes ZIP64 extra fields, 8-byte descriptors and capped end-record fields for every
    // record, as if every size and offset were >= 4 GiB (for tests of the ZIP64 structures).
    bool force_zip64 = false;
    // fsync the archive before the rename and the directory after it.
    bool sync = true;
    // Bytes of the buffer through which file-sourced data is read (to CRC it) and written.
    // 256 KiB stays in L2 between the read, the CRC and the write (fastest in the benchmark).
    size_t copy_buffer_bytes = size_t{256} << 10;
    // When set, called with a byte count each time record data streamed from a file or from
    // runs has been written (per copy-buffer chunk; once per record moved by copy_file_range).
    std::function<void(uint64_t)> progress;
  };

  // A record of an archive not written yet: its name in the archive folder and its data's size.
  struct PlannedRecord {
    std::string_view name;
    uint64_t size = 0;
  };
  // The size Finish() returns for an archive named `archive_name` holding `records` in this order,
  // computed without writing (the writer's own layout arithmetic; names are not validated).
  static Result<uint64_t> PlannedSize(std::string_view archive_name,
                                      std::span<const PlannedRecord> records,
                                      bool force_zip64 = false);

  // Opens the temporary next to `path` (nothing is written to `path` before Finish).
  static Result<ZipWriter> Create(std::string path, Options options);
  static Result<ZipWriter> Create(std::string path) { return Create(std::move(path), Options{}); }

  // An archive whose record data several writers (processes, on any node) write into one shared
  // file, each a byte range at the offsets the whole archive gives it, and which one of them then
  // completes (FinishParts): the bytes one writer writes.
  //
  // Where the data of each of `records` starts in the archive Finish() writes.
  static Result<std::vector<uint64_t>> PlannedDataOffsets(std::string_view archive_name,
                                                          std::span<const PlannedRecord> records,
                                                          bool force_zip64 = false);
  // A record of such an archive: its data in the file already and its CRC-32, or `data`, which
  // FinishParts writes.
  struct PartsRecord {
    std::string_view name;
    uint64_t size = 0;
    uint32_t crc32 = 0;
    std::optional<std::span<const std::byte>> data;
  };
  // Completes the archive of `records` in `file`: every local header, the data given here, every
  // data descriptor, the central directory and end records; then syncs `file`, renames it to
  // `path` and syncs the directory (Options::sync). `file` stays in place when this fails.
  // Returns the archive's size.
  static Result<uint64_t> FinishParts(std::string path, File file, Options options,
                                      std::span<const PartsRecord> records);

  ZipWriter(ZipWriter&& other) noexcept;
  ZipWriter& operator=(ZipWriter&&) = delete;
  ZipWriter(const ZipWriter&) = delete;
  ZipWriter& operator=(const ZipWriter&) = delete;
  // Removes the temporary unless Finish() succeeded.
  ~ZipWriter();

  // Appends record "<archive_name>/<name>" holding `data`. The full name must be valid
  // (IsValidZipRecordName) and not added before, else kInvalidArgument.
  Status AddRecord(std::string_view name, std::span<const std::byte> data);
  Status AddRecord(std::string_view name, std::string_view data);

  // Appends a record whose data is [offset, offset + length) of `source`, streamed. With `crc32`
  // given (the caller knows the bytes' CRC, e.g. from the source archive's directory) the bytes
  // move with copy_file_range and are not read by ucp; otherwise they are read through the copy
  // buffer, CRC'd and written. The source ending early is kCorrupt.
  Status AddRecordFromFile(std::string_view name, const File& source, uint64_t offset,
                           uint64_t length, std::optional<uint32_t> crc32 = std::nullopt);

  // Appends a record whose data is the concatenation of `runs` (byte ranges of open files and
  // runs of zeros), read through the copy buffer, CRC'd and written: memory stays at one buffer
  // whatever the record's size. A source ending early is kCorrupt.
  Status AddRecordFromRuns(std::string_view name, std::span<const ByteRun> runs);

  // Writes the central directory and end records, then commits (see Atomicity). Returns the final
  // archive size. No call is valid afterwards.
  Result<uint64_t> Finish();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return file_.path(); }
  // Bytes written so far (the offset where the next local header goes).
  uint64_t offset() const { return cursor_; }
  size_t record_count() const { return entries_.size(); }

 private:
  struct Entry {
    std::string name;  // full name
    uint64_t header_offset;
    uint64_t size;
    uint32_t crc32;
  };

  ZipWriter(std::string path, File file, Options options);
  Status CheckWritable(std::string_view operation) const;
  // Validates `name`, writes the local header + padding for a record of `size` bytes, and returns
  // the full name and the data offset.
  Result<uint64_t> BeginRecord(std::string_view name, uint64_t size, std::string* full_name);
  Status EndRecord(std::string full_name, uint64_t header_offset, uint64_t size, uint32_t crc32);
  // Writes the record `full_name` (begun at `header_offset`, data at `data_offset`) from `runs`
  // of `length` bytes in total, CRC'ing them on the way; `context` prefixes errors.
  Status StreamRecord(std::string full_name, uint64_t header_offset, uint64_t data_offset,
                      std::span<const ByteRun> runs, uint64_t length, const std::string& context);
  Status Fail(Status status);

  std::string path_;
  File file_;
  Options options_;
  uint64_t cursor_ = 0;
  std::vector<Entry> entries_;
  std::unordered_set<std::string> names_;
  std::unique_ptr<std::byte[]> buffer_;  // lazily allocated copy buffer
  bool failed_ = false;
  bool finished_ = false;
  bool owns_temp_ = true;  // the temporary exists and is this writer's to remove
};

}  // namespace ucp
