#include "core/format/zip_reader.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <utility>

#include "core/format/crc32.h"
#include "core/format/zip_spec.h"
#include "core/util/checked.h"

namespace ucp {
namespace {

using zip_spec::Le16;
using zip_spec::Le32;
using zip_spec::Le64;

// Large enough for any central directory of max_records entries with torch-sized names, small
// enough that a crafted end record cannot make us allocate without bound.
constexpr uint64_t kMaxCentralDirectoryBytes = uint64_t{1} << 30;
constexpr size_t kVerifyChunkBytes = size_t{1} << 20;

std::string Where(std::string_view what, const std::string& path) {
  return "zip: " + std::string(what) + " of " + path;
}

Status CorruptAt(std::string_view what, const std::string& path, const std::string& problem) {
  return Status::Corrupt(Where(what, path) + ": " + problem);
}

std::string EntryName(size_t index) { return "central directory entry " + std::to_string(index); }

// The zip64 end records, when the archive has them.
struct EndRecords {
  uint64_t entries = 0;
  uint64_t cd_size = 0;
  uint64_t cd_offset = 0;
  uint64_t cd_limit = 0;  // the central directory must end at or before this offset
  bool zip64 = false;
};

Result<EndRecords> ReadEndRecords(const File& file, uint64_t file_size, uint64_t max_records) {
  const std::string& path = file.path();
  if (file_size < zip_spec::kEocdSize) {
    return CorruptAt("end of central directory", path,
                     "file of " + std::to_string(file_size) + " bytes is too small for a zip");
  }
  // The record sits at the end, followed only by its comment (at most 65535 bytes).
  const uint64_t tail_size = std::min<uint64_t>(file_size, zip_spec::kEocdSize + 0xFFFF);
  std::vector<unsigned char> tail(tail_size);
  UCP_RETURN_IF_ERROR(file.ReadAt(file_size - tail_size, std::as_writable_bytes(std::span(tail))));
  std::optional<size_t> found;
  for (size_t i = tail_size - zip_spec::kEocdSize + 1; i-- > 0;) {
    if (Le32(&tail[i]) != zip_spec::kEocdSignature) continue;
    const uint16_t comment = Le16(&tail[i + 20]);
    if (i + zip_spec::kEocdSize + comment == tail_size) {
      found = i;
      break;
    }
  }
  if (!found) {
    return CorruptAt("end of central directory", path,
                     "no end of central directory record (not a zip, or truncated)");
  }
  const unsigned char* e = &tail[*found];
  const uint64_t eocd_offset = file_size - tail_size + *found;
  if (Le16(e + 4) != 0 || Le16(e + 6) != 0) {
    return Status::Unsupported(Where("end of central directory", path) +
                               ": multi-disk archives are not supported");
  }
  EndRecords out;
  const uint16_t entries_disk = Le16(e + 8);
  const uint16_t entries16 = Le16(e + 10);
  const uint32_t cd_size32 = Le32(e + 12);
  const uint32_t cd_offset32 = Le32(e + 16);
  if (entries_disk != entries16) {
    return CorruptAt("end of central directory", path,
                     "entries on this disk " + std::to_string(entries_disk) + " != total " +
                         std::to_string(entries16));
  }
  out.entries = entries16;
  out.cd_size = cd_size32;
  out.cd_offset = cd_offset32;
  out.cd_limit = eocd_offset;

  if (eocd_offset >= zip_spec::kZip64LocatorSize) {
    const uint64_t locator_offset = eocd_offset - zip_spec::kZip64LocatorSize;
    unsigned char loc[zip_spec::kZip64LocatorSize];
    UCP_RETURN_IF_ERROR(file.ReadAt(locator_offset, std::as_writable_bytes(std::span(loc))));
    if (Le32(loc) == zip_spec::kZip64LocatorSignature) {
      const uint32_t disk = Le32(loc + 4);
      const uint64_t record_offset = Le64(loc + 8);
      const uint32_t disks = Le32(loc + 16);
      if (disk != 0 || disks > 1) {
        return Status::Unsupported(Where("zip64 end of central directory locator", path) +
                                   ": multi-disk archives are not supported");
      }
      if (!RangeWithin(record_offset, zip_spec::kZip64EocdSize, locator_offset)) {
        return CorruptAt("zip64 end of central directory locator", path,
                         "record offset " + std::to_string(record_offset) +
                             " does not leave room for the record before the locator at " +
                             std::to_string(locator_offset));
      }
      unsigned char z[zip_spec::kZip64EocdSize];
      UCP_RETURN_IF_ERROR(file.ReadAt(record_offset, std::as_writable_bytes(std::span(z))));
      const std::string what = "zip64 end of central directory record";
      if (Le32(z) != zip_spec::kZip64EocdSignature) {
        return CorruptAt(what, path, "bad signature at offset " + std::to_string(record_offset));
      }
      const uint64_t record_size = Le64(z + 4);
      if (record_size < zip_spec::kZip64EocdSize - 12 ||
          !RangeWithin(record_offset, record_size + 12, locator_offset)) {
        return CorruptAt(what, path, "record size " + std::to_string(record_size) + " is invalid");
      }
      if (Le32(z + 16) != 0 || Le32(z + 20) != 0) {
        return Status::Unsupported(Where(what, path) + ": multi-disk archives are not supported");
      }
      const uint64_t entries_disk64 = Le64(z + 24);
      const uint64_t entries64 = Le64(z + 32);
      const uint64_t cd_size64 = Le64(z + 40);
      const uint64_t cd_offset64 = Le64(z + 48);
      if (entries_disk64 != entries64) {
        return CorruptAt(what, path,
                         "entries on this disk " + std::to_string(entries_disk64) + " != total " +
                             std::to_string(entries64));
      }
      // A 32-bit field that is not the "see zip64" marker must say the same as the zip64 one.
      if ((entries16 != 0xFFFF && entries16 != entries64) ||
          (cd_size32 != 0xFFFFFFFF && cd_size32 != cd_size64) ||
          (cd_offset32 != 0xFFFFFFFF && cd_offset32 != cd_offset64)) {
        return CorruptAt("end of central directory", path,
                         "disagrees with the zip64 end of central directory record");
      }
      out.entries = entries64;
      out.cd_size = cd_size64;
      out.cd_offset = cd_offset64;
      out.cd_limit = record_offset;
      out.zip64 = true;
    }
  }
  if (out.entries > max_records) {
    return Status::OutOfRange(Where("end of central directory", path) + ": " +
                              std::to_string(out.entries) + " records exceed the limit of " +
                              std::to_string(max_records));
  }
  if (!RangeWithin(out.cd_offset, out.cd_size, out.cd_limit)) {
    return CorruptAt("end of central directory", path,
                     "central directory [" + std::to_string(out.cd_offset) + ", +" +
                         std::to_string(out.cd_size) + ") exceeds the space before offset " +
                         std::to_string(out.cd_limit));
  }
  if (out.cd_size > kMaxCentralDirectoryBytes) {
    return Status::OutOfRange(Where("central directory", path) + ": " +
                              std::to_string(out.cd_size) + " bytes exceed the limit");
  }
  if (out.entries > out.cd_size / zip_spec::kCentralHeaderSize) {
    return CorruptAt("end of central directory", path,
                     std::to_string(out.entries) +
                         " records cannot fit in a central directory of " +
                         std::to_string(out.cd_size) + " bytes");
  }
  return out;
}

// The values a central directory header stores, after the ZIP64 extra field replaced markers.
struct CentralEntry {
  std::string name;
  uint16_t flags;
  uint16_t method;
  uint32_t crc32;
  uint64_t compressed_size;
  uint64_t size;
  uint64_t header_offset;
};

// Parses the ZIP64 extra field (id 0x0001) inside `extra`, replacing each field of `entry` whose
// 32-bit header value was the 0xFFFFFFFF marker, in the APPNOTE order.
Status ApplyZip64Extra(std::span<const unsigned char> extra, bool size_marked,
                       bool compressed_marked, bool offset_marked, CentralEntry& entry,
                       const std::string& what, const std::string& path) {
  size_t pos = 0;
  while (pos < extra.size()) {
    if (extra.size() - pos < 4) return CorruptAt(what, path, "truncated extra field");
    const uint16_t id = Le16(&extra[pos]);
    const uint16_t len = Le16(&extra[pos + 2]);
    pos += 4;
    if (extra.size() - pos < len) {
      return CorruptAt(what, path,
                       "extra field " + std::to_string(id) + " of " + std::to_string(len) +
                           " bytes overruns the header");
    }
    if (id == zip_spec::kZip64ExtraId) {
      size_t field = pos;
      const size_t end = pos + len;
      auto take = [&](uint64_t& value) -> bool {
        if (end - field < 8) return false;
        value = Le64(&extra[field]);
        field += 8;
        return true;
      };
      if ((size_marked && !take(entry.size)) ||
          (compressed_marked && !take(entry.compressed_size)) ||
          (offset_marked && !take(entry.header_offset))) {
        return CorruptAt(what, path,
                         "zip64 extra field of " + std::to_string(len) +
                             " bytes lacks a field its header marks");
      }
      return Status::Ok();
    }
    pos += len;
  }
  return Status::Ok();
}

Result<std::vector<CentralEntry>> ParseCentralDirectory(std::span<const unsigned char> cd,
                                                        uint64_t entries, const std::string& path) {
  std::vector<CentralEntry> out;
  out.reserve(entries);
  size_t pos = 0;
  for (uint64_t i = 0; i < entries; ++i) {
    const std::string what = EntryName(i);
    if (cd.size() - pos < zip_spec::kCentralHeaderSize) {
      return CorruptAt(what, path, "truncated central directory");
    }
    const unsigned char* h = &cd[pos];
    if (Le32(h) != zip_spec::kCentralSignature) {
      return CorruptAt(what, path, "bad signature at directory offset " + std::to_string(pos));
    }
    CentralEntry entry;
    entry.flags = Le16(h + 8);
    entry.method = Le16(h + 10);
    entry.crc32 = Le32(h + 16);
    const uint32_t compressed32 = Le32(h + 20);
    const uint32_t size32 = Le32(h + 24);
    const uint16_t name_len = Le16(h + 28);
    const uint16_t extra_len = Le16(h + 30);
    const uint16_t comment_len = Le16(h + 32);
    const uint16_t disk = Le16(h + 34);
    const uint32_t offset32 = Le32(h + 42);
    const size_t variable = size_t{name_len} + extra_len + comment_len;
    if (cd.size() - pos - zip_spec::kCentralHeaderSize < variable) {
      return CorruptAt(what, path,
                       "name, extra and comment (" + std::to_string(variable) +
                           " bytes) overrun the central directory");
    }
    const unsigned char* name = h + zip_spec::kCentralHeaderSize;
    entry.name.assign(reinterpret_cast<const char*>(name), name_len);
    entry.compressed_size = compressed32;
    entry.size = size32;
    entry.header_offset = offset32;
    UCP_RETURN_IF_ERROR(ApplyZip64Extra({name + name_len, extra_len}, size32 == 0xFFFFFFFF,
                                        compressed32 == 0xFFFFFFFF, offset32 == 0xFFFFFFFF, entry,
                                        what, path));
    if (!IsValidZipRecordName(entry.name)) {
      return CorruptAt(what, path, "invalid record name \"" + entry.name.substr(0, 256) + "\"");
    }
    const std::string record = what + " (\"" + entry.name + "\")";
    if (disk != 0) {
      return Status::Unsupported(Where(record, path) + ": multi-disk archives are not supported");
    }
    if ((entry.flags & (zip_spec::kFlagEncrypted | zip_spec::kFlagStrongEncryption)) != 0) {
      return Status::Unsupported(Where(record, path) + ": encrypted records are not supported");
    }
    if (entry.method != zip_spec::kMethodStored) {
      return Status::Unsupported(Where(record, path) + ": compression method " +
                                 std::to_string(entry.method) +
                                 " is not supported (ucp reads stored records only)");
    }
    if (entry.compressed_size != entry.size) {
      return CorruptAt(record, path,
                       "stored record with compressed size " +
                           std::to_string(entry.compressed_size) + " != size " +
                           std::to_string(entry.size));
    }
    out.push_back(std::move(entry));
    pos += zip_spec::kCentralHeaderSize + variable;
  }
  return out;
}

// Reads the local header of `entry` and returns the absolute offset of its data.
Result<uint64_t> LocateData(const File& file, const CentralEntry& entry, uint64_t cd_offset,
                            const std::string& what) {
  const std::string& path = file.path();
  const size_t header_len = zip_spec::kLocalHeaderSize + entry.name.size();
  if (!RangeWithin(entry.header_offset, header_len, cd_offset)) {
    return CorruptAt(what, path,
                     "local header offset " + std::to_string(entry.header_offset) +
                         " is outside the data area (central directory at " +
                         std::to_string(cd_offset) + ")");
  }
  std::vector<unsigned char> buf(header_len);
  UCP_RETURN_IF_ERROR(file.ReadAt(entry.header_offset, std::as_writable_bytes(std::span(buf))));
  const unsigned char* h = buf.data();
  const std::string local = "local header of " + what;
  if (Le32(h) != zip_spec::kLocalSignature) {
    return CorruptAt(local, path, "bad signature at offset " + std::to_string(entry.header_offset));
  }
  const uint16_t flags = Le16(h + 6);
  const uint16_t method = Le16(h + 8);
  const uint32_t crc = Le32(h + 14);
  const uint32_t size32 = Le32(h + 22);
  const uint16_t name_len = Le16(h + 26);
  const uint16_t extra_len = Le16(h + 28);
  if (method != entry.method) {
    return CorruptAt(local, path,
                     "method " + std::to_string(method) + " != central directory's " +
                         std::to_string(entry.method));
  }
  if (name_len != entry.name.size() ||
      std::memcmp(h + zip_spec::kLocalHeaderSize, entry.name.data(), name_len) != 0) {
    return CorruptAt(local, path, "name differs from the central directory's");
  }
  // Without a data descriptor the local header must carry the real CRC and size.
  if ((flags & zip_spec::kFlagDataDescriptor) == 0 &&
      (crc != entry.crc32 || (size32 != 0xFFFFFFFF && size32 != entry.size))) {
    return CorruptAt(local, path, "CRC or size differs from the central directory's");
  }
  const uint64_t data_offset = entry.header_offset + header_len + extra_len;
  if (!RangeWithin(data_offset, entry.size, cd_offset)) {
    return CorruptAt(what, path,
                     "data [" + std::to_string(data_offset) + ", +" + std::to_string(entry.size) +
                         ") overruns the data area (central directory at " +
                         std::to_string(cd_offset) + ")");
  }
  return data_offset;
}

}  // namespace

bool IsValidZipRecordName(std::string_view name) {
  if (name.empty() || name.size() > kMaxZipNameBytes) return false;
  if (name.find('\0') != std::string_view::npos || name.find('\\') != std::string_view::npos) {
    return false;
  }
  size_t start = 0;
  while (true) {
    const size_t slash = name.find('/', start);
    const std::string_view part = name.substr(
        start, slash == std::string_view::npos ? std::string_view::npos : slash - start);
    if (part.empty() || part == "." || part == "..") return false;
    if (slash == std::string_view::npos) return true;
    start = slash + 1;
  }
}

Result<ZipReader> ZipReader::Open(std::string path, const Limits& limits) {
  UCP_ASSIGN_OR_RETURN(File file, File::Open(std::move(path), File::Mode::kRead));
  return Open(std::move(file), limits);
}

Result<ZipReader> ZipReader::Open(File file, const Limits& limits) {
  const std::string path = file.path();
  UCP_ASSIGN_OR_RETURN(const uint64_t file_size, file.Size());
  UCP_ASSIGN_OR_RETURN(const EndRecords end, ReadEndRecords(file, file_size, limits.max_records));

  std::vector<unsigned char> cd(end.cd_size);
  UCP_RETURN_IF_ERROR(file.ReadAt(end.cd_offset, std::as_writable_bytes(std::span(cd))));
  UCP_ASSIGN_OR_RETURN(std::vector<CentralEntry> entries,
                       ParseCentralDirectory(cd, end.entries, path));
  cd = {};

  std::vector<ZipRecord> records;
  records.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    CentralEntry& entry = entries[i];
    const std::string what = EntryName(i) + " (\"" + entry.name + "\")";
    UCP_ASSIGN_OR_RETURN(const uint64_t data_offset, LocateData(file, entry, end.cd_offset, what));
    records.push_back(ZipRecord{std::move(entry.name), entry.header_offset, data_offset, entry.size,
                                entry.crc32, entry.method});
  }

  // Each record occupies [local header, end of data); no two may share a byte.
  std::vector<size_t> order(records.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return records[a].header_offset < records[b].header_offset;
  });
  for (size_t k = 1; k < order.size(); ++k) {
    const ZipRecord& prev = records[order[k - 1]];
    const ZipRecord& next = records[order[k]];
    if (prev.data_offset + prev.size > next.header_offset) {
      return CorruptAt("central directory", path,
                       "records \"" + prev.name + "\" and \"" + next.name + "\" overlap");
    }
  }

  ZipReader reader(std::move(file), file_size, end.zip64, std::move(records));
  if (reader.by_name_.size() != reader.records_.size()) {
    return CorruptAt("central directory", path, "duplicate record names");
  }
  return reader;
}

ZipReader::ZipReader(File file, uint64_t file_size, bool zip64, std::vector<ZipRecord> records)
    : file_(std::move(file)), file_size_(file_size), zip64_(zip64), records_(std::move(records)) {
  by_name_.reserve(records_.size());
  for (size_t i = 0; i < records_.size(); ++i) by_name_.emplace(records_[i].name, i);
  if (!records_.empty()) {
    const std::string& first = records_.front().name;
    const size_t slash = first.find('/');
    if (slash != std::string::npos) archive_name_ = first.substr(0, slash);
  }
}

const ZipRecord* ZipReader::Find(std::string_view name) const {
  if (auto it = by_name_.find(name); it != by_name_.end()) return &records_[it->second];
  if (archive_name_.empty()) return nullptr;
  std::string full;
  full.reserve(archive_name_.size() + 1 + name.size());
  full.append(archive_name_).append("/").append(name);
  if (auto it = by_name_.find(full); it != by_name_.end()) return &records_[it->second];
  return nullptr;
}

Result<const ZipRecord*> ZipReader::Get(std::string_view name) const {
  if (const ZipRecord* record = Find(name)) return record;
  return Status::NotFound("zip: record \"" + std::string(name) + "\" not found in " + path());
}

Result<std::string> ZipReader::ReadRecord(const ZipRecord& record, size_t max_bytes) const {
  if (record.size > max_bytes) {
    return Status::OutOfRange("zip: record \"" + record.name + "\" of " + path() + ": " +
                              std::to_string(record.size) + " bytes exceed the limit of " +
                              std::to_string(max_bytes) + " for an in-memory read");
  }
  std::string out(record.size, '\0');
  UCP_RETURN_IF_ERROR(file_.ReadAt(record.data_offset, std::as_writable_bytes(std::span(out))));
  return out;
}

Status ZipReader::VerifyCrc(const ZipRecord& record) const {
  const size_t chunk_size = static_cast<size_t>(std::min<uint64_t>(record.size, kVerifyChunkBytes));
  std::unique_ptr<std::byte[]> buffer(new std::byte[std::max<size_t>(chunk_size, 1)]);
  Crc32Stream crc;
  for (uint64_t done = 0; done < record.size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(record.size - done, chunk_size));
    UCP_RETURN_IF_ERROR(file_.ReadAt(record.data_offset + done, {buffer.get(), n}));
    crc.Update({buffer.get(), n});
    done += n;
  }
  if (crc.value() != record.crc32) {
    char msg[64];
    std::snprintf(msg, sizeof(msg), ": CRC-32 %08x != %08x in the directory", crc.value(),
                  record.crc32);
    return Status::Corrupt("zip: record \"" + record.name + "\" of " + path() + msg);
  }
  return Status::Ok();
}

}  // namespace ucp
