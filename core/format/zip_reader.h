// ZipReader: lists the records of a zip archive as torch writes them (torch.save's
// PyTorchStreamWriter, torch 1.6 – 2.x) without reading record data.
//
// Byte layout read (all integers little-endian; APPNOTE.TXT 6.3):
//
//   for each record:
//     local file header   PK\3\4  (30 bytes + name + extra)   extra may hold ZIP64 (0x0001) and
//                                                               torch's 'FB' padding field
//     data                stored (method 0), torch aligns its first byte to 64
//     [data descriptor]   optional (flag bit 3): [PK\7\8] crc32, sizes (4+4 or 8+8)
//   central directory    PK\1\2 (46 bytes + name + extra + comment) per record, in record order;
//                        a size/offset of 0xFFFFFFFF is taken from the ZIP64 extra field
//   [ZIP64 end of central directory record   PK\6\6 (56 bytes)]
//   [ZIP64 end of central directory locator  PK\6\7 (20 bytes)]   torch always writes both
//   end of central directory record          PK\5\6 (22 bytes + comment)
//
// What the reader guarantees about an opened archive (anything else fails Open):
//   - single disk; every record stored (method 0) and unencrypted; compressed or encrypted
//     records are kUnsupported;
//   - every header, name and data range lies within the file, computed with checked arithmetic;
//     local and central headers agree on name and method (and on CRC and size when the record
//     has no data descriptor); records [local header, end of data) do not overlap each other or
//     the central directory; 32-bit end-record fields agree with the ZIP64 record;
//   - names are unique and valid (IsValidZipRecordName);
//   - at most Limits::max_records records and a central directory of at most 1 GiB.
// Malformed bytes are kCorrupt, limits exceeded kOutOfRange; messages name the file and the field,
// e.g. "zip: central directory entry 3 of /x/model.pt: name, extra and comment (70000 bytes)
// overrun the central directory".
// Record CRCs are not checked by Open (that reads all data): call VerifyCrc.
//
// Thread-safety: after Open, every const method may be called from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/io/file.h"
#include "core/util/status.h"

namespace ucp {

// One record of the archive, as its headers describe it.
struct ZipRecord {
  std::string name;        // full name as stored, e.g. "archive/data/0"
  uint64_t header_offset;  // offset of its local file header
  uint64_t data_offset;    // absolute file offset of its first data byte
  uint64_t size;           // data length in bytes (stored: compressed == uncompressed)
  uint32_t crc32;          // CRC-32 from the central directory
  uint16_t method;         // compression method (always 0 once Open succeeded)
};

// True when `name` obeys the record-name rules above: non-empty, at most kMaxZipNameBytes, no NUL
// or backslash, no leading '/', no empty, "." or ".." component.
inline constexpr size_t kMaxZipNameBytes = 4096;
[[nodiscard]] bool IsValidZipRecordName(std::string_view name);

class ZipReader {
 public:
  struct Limits {
    uint64_t max_records = uint64_t{1} << 22;
  };

  // Opens `path` and reads its end records, central directory and every local header.
  static Result<ZipReader> Open(std::string path, const Limits& limits);
  static Result<ZipReader> Open(std::string path) { return Open(std::move(path), Limits{}); }
  // Same over an already opened file (the reader takes it); its path() names it in messages.
  static Result<ZipReader> Open(File file, const Limits& limits);

  ZipReader(ZipReader&&) = default;
  ZipReader& operator=(ZipReader&&) = default;
  ZipReader(const ZipReader&) = delete;
  ZipReader& operator=(const ZipReader&) = delete;

  const std::string& path() const { return file_.path(); }
  // The open archive, for ranged reads of record data (ReadAt at record.data_offset).
  const File& file() const { return file_; }
  // File size when opened.
  uint64_t file_size() const { return file_size_; }
  // True when the archive has ZIP64 end records.
  bool zip64() const { return zip64_; }

  // All records in central-directory order (torch: data.pkl first, version last).
  std::span<const ZipRecord> records() const { return records_; }

  // The top-level folder torch puts every record under: the first record's name up to its first
  // '/' ("archive", or the saved file's stem in torch 1.x). Empty when the first name has no '/'.
  const std::string& archive_name() const { return archive_name_; }

  // The record called `name`, matched against the full name first, then against
  // "<archive_name>/<name>" ("data.pkl" finds "archive/data.pkl"). nullptr when absent.
  const ZipRecord* Find(std::string_view name) const;
  // As Find, but a missing record is kNotFound naming the archive and the record.
  Result<const ZipRecord*> Get(std::string_view name) const;

  // Reads the whole record into memory. A record larger than `max_bytes` is kOutOfRange (this is
  // for small records such as data.pkl, version, byteorder; stream big ones from file()).
  Result<std::string> ReadRecord(const ZipRecord& record, size_t max_bytes = 256u << 20) const;

  // Reads the record's data through a bounded buffer and compares its CRC-32 with the central
  // directory's: a mismatch is kCorrupt naming the record and both values.
  Status VerifyCrc(const ZipRecord& record) const;

 private:
  ZipReader(File file, uint64_t file_size, bool zip64, std::vector<ZipRecord> records);

  File file_;
  uint64_t file_size_ = 0;
  bool zip64_ = false;
  std::vector<ZipRecord> records_;
  std::string archive_name_;
  std::unordered_map<std::string_view, size_t> by_name_;  // views into records_[i].name
};

}  // namespace ucp
