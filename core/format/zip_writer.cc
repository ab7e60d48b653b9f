#include "core/format/zip_writer.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <utility>

#include "core/format/crc32.h"
#include "core/format/zip_spec.h"
#include "core/util/checked.h"

namespace ucp {
namespace {

using zip_spec::Put16;
using zip_spec::Put32;
using zip_spec::Put64;

constexpr uint64_t kMarker32 = 0xFFFFFFFF;
constexpr int kTempAttempts = 100;

std::atomic<uint64_t> temp_counter{0};

// What torch's writer (miniz in ZIP64 mode) puts in a record's headers for these values:
// ZIP64 fields appear only for a size or header offset of 0xFFFFFFFF or more.
struct Zip64Need {
  bool size;
  bool offset;
  bool any() const { return size || offset; }
  // Bytes of the ZIP64 extra field (header included), 0 when absent.
  size_t extra_bytes() const { return any() ? 4 + (size ? 16 : 0) + (offset ? 8 : 0) : 0; }
};

Zip64Need NeedFor(uint64_t size, uint64_t header_offset, bool force) {
  return {force || size >= kMarker32, force || header_offset >= kMarker32};
}

// Bytes of a local header before its 'Z' padding: the fixed header, the name, the ZIP64 extra and
// the 4-byte 'FB' header.
uint64_t UnpaddedLocalBytes(size_t full_name_size, const Zip64Need& zip64) {
  return zip_spec::kLocalHeaderSize + full_name_size + zip64.extra_bytes() + 4;
}

// Where a record's data starts when its local header is at `header_offset`: after the unpadded
// local header plus 'Z' padding to the next multiple of kAlignment (torch's getPadding). nullopt
// on overflow.
std::optional<uint64_t> DataOffsetFor(uint64_t header_offset, size_t full_name_size,
                                      const Zip64Need& zip64) {
  const auto unpadded = CheckedAdd(header_offset, UnpaddedLocalBytes(full_name_size, zip64));
  if (!unpadded) return std::nullopt;
  return *unpadded +
         (ZipWriter::kAlignment - *unpadded % ZipWriter::kAlignment) % ZipWriter::kAlignment;
}

// Bytes of the data descriptor after a record's data: none for an empty record.
uint64_t DescriptorBytes(uint64_t size, const Zip64Need& zip64) {
  return size == 0 ? 0 : zip64.any() ? 24 : 16;
}

// Bytes of a record's central directory entry.
uint64_t CentralEntryBytes(size_t full_name_size, const Zip64Need& zip64) {
  return zip_spec::kCentralHeaderSize + full_name_size + zip64.extra_bytes();
}

constexpr uint64_t kEndRecordsBytes =
    zip_spec::kZip64EocdSize + zip_spec::kZip64LocatorSize + zip_spec::kEocdSize;

uint16_t FlagsFor(uint64_t size) {
  // miniz announces a data descriptor only when there is data to describe.
  return size > 0 ? zip_spec::kFlagUtf8 | zip_spec::kFlagDataDescriptor : zip_spec::kFlagUtf8;
}

std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

// Where the records of an archive go, computed as the writer places them.
struct PlannedLayout {
  std::vector<uint64_t> data_offsets;
  uint64_t directory_offset = 0;  // after the last record
  uint64_t directory_bytes = 0;
};

Result<PlannedLayout> PlanLayout(std::string_view archive_name,
                                 std::span<const ZipWriter::PlannedRecord> records,
                                 bool force_zip64) {
  PlannedLayout layout;
  layout.data_offsets.reserve(records.size());
  uint64_t cursor = 0;
  for (const ZipWriter::PlannedRecord& record : records) {
    const size_t full_name_size = archive_name.size() + 1 + record.name.size();
    const Zip64Need zip64 = NeedFor(record.size, cursor, force_zip64);
    const std::optional<uint64_t> data_offset = DataOffsetFor(cursor, full_name_size, zip64);
    const std::optional<uint64_t> end =
        data_offset ? CheckedAdd(*data_offset, record.size) : std::nullopt;
    if (!end || !CheckedAdd(*end, uint64_t{24})) {
      return Status::OutOfRange("zip: planned size: offset overflow at record " +
                                std::string(record.name));
    }
    layout.data_offsets.push_back(*data_offset);
    cursor = *end + DescriptorBytes(record.size, zip64);
    layout.directory_bytes += CentralEntryBytes(full_name_size, zip64);
  }
  layout.directory_offset = cursor;
  return layout;
}

}  // namespace

Result<ZipWriter> ZipWriter::Create(std::string path, Options options) {
  if (options.archive_name.empty() || options.archive_name.find('/') != std::string::npos ||
      !IsValidZipRecordName(options.archive_name)) {
    return Status::InvalidArgument("zip: writer for " + path + ": invalid archive name \"" +
                                   options.archive_name + "\"");
  }
  if (options.copy_buffer_bytes == 0) {
    return Status::InvalidArgument("zip: writer for " + path + ": copy buffer of 0 bytes");
  }
  Status last;
  for (int attempt = 0; attempt < kTempAttempts; ++attempt) {
    std::string temp = path + ".ucp-tmp-" + std::to_string(::getpid()) + "-" +
                       std::to_string(temp_counter.fetch_add(1));
    auto file = File::Open(temp, File::Mode::kCreateExclusive);
    if (file.ok()) return ZipWriter(std::move(path), std::move(file).value(), std::move(options));
    last = file.status();
    std::error_code ignored;
    if (!std::filesystem::exists(temp, ignored)) break;  // only a name clash is worth a retry
  }
  return last.WithContext("zip: writer for " + path);
}

ZipWriter::ZipWriter(std::string path, File file, Options options)
    : path_(std::move(path)), file_(std::move(file)), options_(std::move(options)) {}

ZipWriter::ZipWriter(ZipWriter&& other) noexcept
    : path_(std::move(other.path_)),
      file_(std::move(other.file_)),
      options_(std::move(other.options_)),
      cursor_(other.cursor_),
      entries_(std::move(other.entries_)),
      names_(std::move(other.names_)),
      buffer_(std::move(other.buffer_)),
      failed_(other.failed_),
      finished_(other.finished_),
      owns_temp_(std::exchange(other.owns_temp_, false)) {}

ZipWriter::~ZipWriter() {
  if (!owns_temp_) return;
  const std::string temp = file_.path();
  (void)file_.Close();
  (void)RemoveFile(temp);
}

Status ZipWriter::CheckWritable(std::string_view operation) const {
  if (finished_) {
    return Status::FailedPrecondition("zip: " + std::string(operation) + " on " + path_ +
                                      ": the archive is already finished");
  }
  if (failed_) {
    return Status::FailedPrecondition("zip: " + std::string(operation) + " on " + path_ +
                                      ": an earlier write failed");
  }
  return Status::Ok();
}

Status ZipWriter::Fail(Status status) {
  failed_ = true;
  return status;
}

Result<uint64_t> ZipWriter::BeginRecord(std::string_view name, uint64_t size,
                                        std::string* full_name) {
  UCP_RETURN_IF_ERROR(CheckWritable("add record"));
  std::string full = options_.archive_name + "/" + std::string(name);
  if (!IsValidZipRecordName(full)) {
    return Status::InvalidArgument("zip: add record to " + path_ + ": invalid record name \"" +
                                   full.substr(0, 256) + "\"");
  }
  if (names_.count(full) != 0) {
    return Status::InvalidArgument("zip: add record to " + path_ + ": record \"" + full +
                                   "\" was already written");
  }
  const uint64_t header_offset = cursor_;
  const Zip64Need zip64 = NeedFor(size, header_offset, options_.force_zip64);

  const std::optional<uint64_t> data_offset_or = DataOffsetFor(header_offset, full.size(), zip64);
  if (!data_offset_or) {
    return Status::OutOfRange("zip: add record to " + path_ + ": offset overflow");
  }
  const uint64_t data_offset = *data_offset_or;
  const uint64_t fixed = UnpaddedLocalBytes(full.size(), zip64);
  const uint64_t padding = data_offset - header_offset - fixed;
  // Room for the data and the largest data descriptor.
  const auto data_end = CheckedAdd(data_offset, size);
  if (!data_end || !CheckedAdd(*data_end, uint64_t{24})) {
    return Status::OutOfRange("zip: add record to " + path_ + ": offset overflow");
  }

  std::string header;
  header.reserve(static_cast<size_t>(fixed + padding));
  Put32(header, zip_spec::kLocalSignature);
  Put16(header, 0);  // version needed: miniz writes 0 for stored records
  Put16(header, FlagsFor(size));
  Put16(header, zip_spec::kMethodStored);
  Put16(header, 0);  // time
  Put16(header, 0);  // date
  Put32(header, 0);  // crc: in the data descriptor
  Put32(header, 0);  // compressed size
  Put32(header, 0);  // size
  Put16(header, static_cast<uint16_t>(full.size()));
  Put16(header, static_cast<uint16_t>(zip64.extra_bytes() + 4 + padding));
  header += full;
  if (zip64.any()) {
    Put16(header, zip_spec::kZip64ExtraId);
    Put16(header, static_cast<uint16_t>(zip64.extra_bytes() - 4));
    if (zip64.size) {
      Put64(header, size);
      Put64(header, 0);  // compressed size, not known to miniz when it writes the local header
    }
    if (zip64.offset) Put64(header, header_offset);
  }
  Put16(header, zip_spec::kPaddingExtraId);
  Put16(header, static_cast<uint16_t>(padding));
  header.append(static_cast<size_t>(padding), 'Z');

  if (Status st = file_.WriteAt(header_offset, AsBytes(header)); !st.ok()) {
    return Fail(st.WithContext("zip: add record \"" + full + "\""));
  }
  cursor_ = data_offset;
  *full_name = std::move(full);
  return data_offset;
}

Status ZipWriter::EndRecord(std::string full_name, uint64_t header_offset, uint64_t size,
                            uint32_t crc32) {
  const uint64_t data_end = cursor_ + size;
  if (size > 0) {
    const Zip64Need zip64 = NeedFor(size, header_offset, options_.force_zip64);
    std::string descriptor;
    Put32(descriptor, zip_spec::kDataDescriptorSignature);
    Put32(descriptor, crc32);
    if (zip64.any()) {
      Put64(descriptor, size);
      Put64(descriptor, size);
    } else {
      Put32(descriptor, static_cast<uint32_t>(size));
      Put32(descriptor, static_cast<uint32_t>(size));
    }
    if (Status st = file_.WriteAt(data_end, AsBytes(descriptor)); !st.ok()) {
      return Fail(st.WithContext("zip: add record \"" + full_name + "\""));
    }
    cursor_ = data_end + DescriptorBytes(size, zip64);
  }
  names_.insert(full_name);
  entries_.push_back(Entry{std::move(full_name), header_offset, size, crc32});
  return Status::Ok();
}

Status ZipWriter::AddRecord(std::string_view name, std::span<const std::byte> data) {
  const uint64_t header_offset = cursor_;
  std::string full;
  UCP_ASSIGN_OR_RETURN(const uint64_t data_offset, BeginRecord(name, data.size(), &full));
  if (Status st = file_.WriteAt(data_offset, data); !st.ok()) {
    return Fail(st.WithContext("zip: add record \"" + full + "\""));
  }
  return EndRecord(std::move(full), header_offset, data.size(), Crc32(data));
}

Status ZipWriter::AddRecord(std::string_view name, std::string_view data) {
  return AddRecord(name, std::as_bytes(std::span(data.data(), data.size())));
}

Status ZipWriter::AddRecordFromFile(std::string_view name, const File& source, uint64_t offset,
                                    uint64_t length, std::optional<uint32_t> crc32) {
  const uint64_t header_offset = cursor_;
  std::string full;
  UCP_ASSIGN_OR_RETURN(const uint64_t data_offset, BeginRecord(name, length, &full));
  const std::string context = "zip: add record \"" + full + "\" from " + source.path();
  if (crc32) {
    if (Status st = CopyRange(source, offset, file_, data_offset, length); !st.ok()) {
      return Fail(st.WithContext(context));
    }
    if (options_.progress) options_.progress(length);
    return EndRecord(std::move(full), header_offset, length, *crc32);
  }
  const ByteRun run{&source, offset, length};
  return StreamRecord(std::move(full), header_offset, data_offset, std::span(&run, 1), length,
                      context);
}

Status ZipWriter::AddRecordFromRuns(std::string_view name, std::span<const ByteRun> runs) {
  UCP_ASSIGN_OR_RETURN(const uint64_t length, ByteRunsLength(runs));
  const uint64_t header_offset = cursor_;
  std::string full;
  UCP_ASSIGN_OR_RETURN(const uint64_t data_offset, BeginRecord(name, length, &full));
  const std::string context = "zip: add record \"" + full + "\"";
  return StreamRecord(std::move(full), header_offset, data_offset, runs, length, context);
}

Status ZipWriter::StreamRecord(std::string full_name, uint64_t header_offset, uint64_t data_offset,
                               std::span<const ByteRun> runs, uint64_t length,
                               const std::string& context) {
  if (!buffer_) buffer_.reset(new std::byte[options_.copy_buffer_bytes]);
  Crc32Stream crc;
  uint64_t done = 0;
  const Status status = StreamRuns(runs, std::span(buffer_.get(), options_.copy_buffer_bytes),
                                   [&](std::span<const std::byte> piece) -> Status {
                                     crc.Update(piece);
                                     UCP_RETURN_IF_ERROR(file_.WriteAt(data_offset + done, piece));
                                     done += piece.size();
                                     if (options_.progress) options_.progress(piece.size());
                                     return Status::Ok();
                                   });
  if (!status.ok()) return Fail(status.WithContext(context));
  return EndRecord(std::move(full_name), header_offset, length, crc.value());
}

Result<uint64_t> ZipWriter::Finish() {
  UCP_RETURN_IF_ERROR(CheckWritable("finish"));
  const bool force = options_.force_zip64;
  std::string tail;
  for (const Entry& e : entries_) {
    const Zip64Need zip64 = NeedFor(e.size, e.header_offset, force);
    Put32(tail, zip_spec::kCentralSignature);
    Put16(tail, 0);  // version made by
    Put16(tail, 0);  // version needed
    Put16(tail, FlagsFor(e.size));
    Put16(tail, zip_spec::kMethodStored);
    Put16(tail, 0);  // time
    Put16(tail, 0);  // date
    Put32(tail, e.crc32);
    const uint32_t size32 = zip64.size ? kMarker32 : static_cast<uint32_t>(e.size);
    Put32(tail, size32);  // compressed size
    Put32(tail, size32);
    Put16(tail, static_cast<uint16_t>(e.name.size()));
    Put16(tail, static_cast<uint16_t>(zip64.extra_bytes()));
    Put16(tail, 0);  // comment length
    Put16(tail, 0);  // disk
    Put16(tail, 0);  // internal attributes
    Put32(tail, 0);  // external attributes
    Put32(tail, zip64.offset ? kMarker32 : static_cast<uint32_t>(e.header_offset));
    tail += e.name;
    if (zip64.any()) {
      Put16(tail, zip_spec::kZip64ExtraId);
      Put16(tail, static_cast<uint16_t>(zip64.extra_bytes() - 4));
      if (zip64.size) {
        Put64(tail, e.size);
        Put64(tail, e.size);
      }
      if (zip64.offset) Put64(tail, e.header_offset);
    }
  }
  const uint64_t cd_offset = cursor_;
  const uint64_t cd_size = tail.size();
  const uint64_t count = entries_.size();
  const uint64_t zip64_eocd_offset = cd_offset + cd_size;

  Put32(tail, zip_spec::kZip64EocdSignature);
  Put64(tail, zip_spec::kZip64EocdSize - 12);  // size of the rest of the record
  Put16(tail, 0x031E);                         // version made by, as miniz writes it
  Put16(tail, 0x002D);                         // version needed: 4.5, ZIP64
  Put32(tail, 0);                              // this disk
  Put32(tail, 0);                              // disk with the central directory
  Put64(tail, count);
  Put64(tail, count);
  Put64(tail, cd_size);
  Put64(tail, cd_offset);

  Put32(tail, zip_spec::kZip64LocatorSignature);
  Put32(tail, 0);  // disk with the zip64 end record
  Put64(tail, zip64_eocd_offset);
  Put32(tail, 1);  // total disks

  Put32(tail, zip_spec::kEocdSignature);
  Put16(tail, 0);
  Put16(tail, 0);
  const uint16_t count16 =
      force ? 0xFFFF : static_cast<uint16_t>(std::min<uint64_t>(count, 0xFFFF));
  Put16(tail, count16);
  Put16(tail, count16);
  Put32(tail, force ? kMarker32 : static_cast<uint32_t>(std::min(cd_size, kMarker32)));
  Put32(tail, force ? kMarker32 : static_cast<uint32_t>(std::min(cd_offset, kMarker32)));
  Put16(tail, 0);  // comment length

  if (Status st = file_.WriteAt(cd_offset, AsBytes(tail)); !st.ok()) {
    return Fail(st.WithContext("zip: finish"));
  }
  cursor_ = cd_offset + tail.size();
  if (options_.sync) {
    if (Status st = file_.Sync(); !st.ok()) return Fail(st.WithContext("zip: finish"));
  }
  if (Status st = file_.Close(); !st.ok()) return Fail(st.WithContext("zip: finish"));
  if (Status st = RenameFile(file_.path(), path_); !st.ok()) {
    return Fail(st.WithContext("zip: finish"));
  }
  owns_temp_ = false;
  finished_ = true;
  if (options_.sync) {
    std::string dir = std::filesystem::path(path_).parent_path().string();
    if (dir.empty()) dir = ".";
    UCP_RETURN_IF_ERROR(SyncDirectory(dir).WithContext("zip: finish"));
  }
  return cursor_;
}

Result<std::vector<uint64_t>> ZipWriter::PlannedDataOffsets(std::string_view archive_name,
                                                            std::span<const PlannedRecord> records,
                                                            bool force_zip64) {
  UCP_ASSIGN_OR_RETURN(PlannedLayout layout, PlanLayout(archive_name, records, force_zip64));
  return std::move(layout.data_offsets);
}

Result<uint64_t> ZipWriter::FinishParts(std::string path, File file, Options options,
                                        std::span<const PartsRecord> records) {
  if (options.archive_name.empty() || options.archive_name.find('/') != std::string::npos ||
      !IsValidZipRecordName(options.archive_name)) {
    return Status::InvalidArgument("zip: finish parts of " + path + ": invalid archive name \"" +
                                   options.archive_name + "\"");
  }
  ZipWriter writer(std::move(path), std::move(file), std::move(options));
  writer.owns_temp_ = false;  // the parts' file: left for another process when this one fails
  // Each record as AddRecord writes it, but for the data the parts wrote: the same offsets.
  for (const PartsRecord& record : records) {
    const uint64_t header_offset = writer.cursor_;
    std::string full;
    UCP_ASSIGN_OR_RETURN(const uint64_t data_offset,
                         writer.BeginRecord(record.name, record.size, &full));
    uint32_t crc32 = record.crc32;
    if (record.data) {
      if (record.data->size() != record.size) {
        return Status::InvalidArgument("zip: finish parts: record \"" + full + "\" of " +
                                       std::to_string(record.size) + " bytes given " +
                                       std::to_string(record.data->size()));
      }
      if (Status st = writer.file_.WriteAt(data_offset, *record.data); !st.ok()) {
        return writer.Fail(st.WithContext("zip: finish parts: record \"" + full + "\""));
      }
      crc32 = Crc32(*record.data);
    }
    UCP_RETURN_IF_ERROR(writer.EndRecord(std::move(full), header_offset, record.size, crc32));
  }
  return writer.Finish();
}

Result<uint64_t> ZipWriter::PlannedSize(std::string_view archive_name,
                                        std::span<const PlannedRecord> records, bool force_zip64) {
  UCP_ASSIGN_OR_RETURN(const PlannedLayout layout, PlanLayout(archive_name, records, force_zip64));
  const std::optional<uint64_t> total =
      CheckedAdd(layout.directory_offset, layout.directory_bytes + kEndRecordsBytes);
  if (!total) return Status::OutOfRange("zip: planned size: overflow");
  return *total;
}

}  // namespace ucp
