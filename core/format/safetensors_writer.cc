#include "core/format/safetensors_writer.h"

#include <unistd.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "core/io/byte_run.h"
#include "core/io/file.h"
#include "core/util/checked.h"

namespace ucp {
namespace {

using OrderedJson = nlohmann::ordered_json;

// Long copies are cut into pieces of this size so that progress moves.
constexpr uint64_t kProgressStep = uint64_t{64} << 20;
// The buffer that checked bytes pass through (ExecuteOptions::chunk_bytes' size: L2-sized).
constexpr size_t kCheckedBuffer = size_t{256} << 10;

bool ValidUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto lead = static_cast<unsigned char>(text[i]);
    size_t length = 0;
    uint32_t code = 0;
    if (lead < 0x80) {
      ++i;
      continue;
    } else if ((lead & 0xE0) == 0xC0) {
      length = 2;
      code = lead & 0x1F;
    } else if ((lead & 0xF0) == 0xE0) {
      length = 3;
      code = lead & 0x0F;
    } else if ((lead & 0xF8) == 0xF0) {
      length = 4;
      code = lead & 0x07;
    } else {
      return false;
    }
    if (i + length > text.size()) return false;
    for (size_t k = 1; k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next & 0xC0) != 0x80) return false;
      code = (code << 6) | (next & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8.
    constexpr uint32_t kMinimum[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (code < kMinimum[length] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) {
      return false;
    }
    i += length;
  }
  return true;
}

// Writes `body(file)` to "<path>.tmp.<pid>", fsyncs it and renames it over `path`; the
// temporary file is removed on any failure.
template <typename Body>
Status WriteAtomically(const std::string& path, bool sync, Body body) {
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  UCP_ASSIGN_OR_RETURN(File file, File::Open(temp, File::Mode::kCreate));
  Status status = body(file);
  if (status.ok() && sync) status = file.Sync();
  if (status.ok()) status = file.Close();
  if (status.ok()) status = RenameFile(temp, path);
  if (!status.ok()) {
    file.Close().ok();  // already failing; the first error is the one reported
    RemoveFile(temp).ok();
  }
  return status.ok() ? status : status.WithContext("safetensors");
}

}  // namespace

Status SafetensorsWriter::Add(Entry entry) {
  const std::string where = "safetensors: tensor \"" + entry.name + "\": ";
  if (entry.name.empty() || entry.name == "__metadata__" || !ValidUtf8(entry.name)) {
    return Status::InvalidArgument(where + "name is empty, reserved or not UTF-8");
  }
  if (names_.count(entry.name) != 0) return Status::InvalidArgument(where + "added twice");
  if (!SafetensorsName(entry.dtype)) {
    return Status::Unsupported(where + "safetensors has no dtype for torch." +
                               std::string(TorchName(entry.dtype)));
  }
  uint64_t numel = 1;
  for (uint64_t dim : entry.shape) {
    const std::optional<uint64_t> product = CheckedMul(numel, dim);
    if (!product) return Status::OutOfRange(where + "shape overflows");
    numel = *product;
  }
  const std::optional<uint64_t> size = CheckedMul(numel, ItemSize(entry.dtype));
  const std::optional<uint64_t> total = size ? CheckedAdd(data_size_, *size) : std::nullopt;
  if (!total) return Status::OutOfRange(where + "byte size overflows");
  if (!entry.runs.empty()) {
    const Result<uint64_t> runs_size = ByteRunsLength(entry.runs);
    if (!runs_size.ok() || *runs_size != *size) {
      return Status::InvalidArgument(where + "runs of " +
                                     (runs_size.ok() ? std::to_string(*runs_size) : "too many") +
                                     " bytes given for a tensor of " + std::to_string(*size));
    }
  } else if (entry.source.empty() && entry.memory.size() != *size) {
    return Status::InvalidArgument(where + std::to_string(entry.memory.size()) +
                                   " bytes given for a tensor of " + std::to_string(*size));
  }
  entry.size = *size;
  data_size_ = *total;
  names_.insert(entry.name);
  entries_.push_back(std::move(entry));
  return Status::Ok();
}

Status SafetensorsWriter::AddFromMemory(std::string name, DType dtype, std::vector<uint64_t> shape,
                                        std::span<const std::byte> data) {
  return Add(Entry{std::move(name), dtype, std::move(shape), 0, data, "", 0, {}});
}

Status SafetensorsWriter::AddFromFile(std::string name, DType dtype, std::vector<uint64_t> shape,
                                      std::string source, uint64_t offset) {
  if (source.empty()) return Status::InvalidArgument("safetensors: empty source path for " + name);
  return Add(Entry{std::move(name), dtype, std::move(shape), 0, {}, std::move(source), offset, {}});
}

Status SafetensorsWriter::AddFromRuns(std::string name, DType dtype, std::vector<uint64_t> shape,
                                      std::span<const ByteRun> runs) {
  // A tensor of no bytes has no runs to copy: its (empty) memory says the same.
  if (runs.empty()) return AddFromMemory(std::move(name), dtype, std::move(shape), {});
  return Add(Entry{std::move(name),
                   dtype,
                   std::move(shape),
                   0,
                   {},
                   "",
                   0,
                   std::vector<ByteRun>(runs.begin(), runs.end())});
}

Status SafetensorsWriter::SetMetadata(std::string key, std::string value) {
  if (!ValidUtf8(key) || !ValidUtf8(value)) {
    return Status::InvalidArgument("safetensors: metadata \"" + key + "\" is not UTF-8");
  }
  metadata_[std::move(key)] = std::move(value);
  return Status::Ok();
}

std::string SafetensorsWriter::Header() const {
  OrderedJson header = OrderedJson::object();
  if (!metadata_.empty()) {
    OrderedJson metadata = OrderedJson::object();
    for (const auto& [key, value] : metadata_) metadata[key] = value;
    header["__metadata__"] = std::move(metadata);
  }
  uint64_t offset = 0;
  for (const Entry& entry : entries_) {
    header[entry.name] = {{"dtype", std::string(*SafetensorsName(entry.dtype))},
                          {"shape", entry.shape},
                          {"data_offsets", {offset, offset + entry.size}}};
    offset += entry.size;
  }
  std::string text = header.dump();
  text.resize((8 + text.size() + 7) / 8 * 8 - 8, ' ');
  return text;
}

Status SafetensorsWriter::Write(const std::string& path, const WriteOptions& options) const {
  const std::string header = Header();
  if (header.size() > kMaxSafetensorsHeader) {
    return Status::OutOfRange("safetensors: header of " + path + " exceeds the size limit");
  }
  return WriteAtomically(path, options.sync, [&](File& out) -> Status {
    std::byte length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<std::byte>(header.size() >> (8 * i));
    // Explicit offsets throughout: CopyRange writes at an offset and leaves the file position.
    UCP_RETURN_IF_ERROR(out.WriteAt(0, length));
    UCP_RETURN_IF_ERROR(out.WriteAt(sizeof(length), std::as_bytes(std::span(header))));
    uint64_t cursor = sizeof(length) + header.size();
    std::unique_ptr<std::byte[]> checked_buffer;
    for (const Entry& entry : entries_) {
      if (!entry.runs.empty()) {
        uint64_t at = cursor;
        for (const ByteRun& run : entry.runs) {
          if (run.checked != nullptr || run.widen_bf16) {
            // Bytes to be checked or widened pass through memory: copy_file_range would neither
            // show nor convert them.
            if (checked_buffer == nullptr) checked_buffer.reset(new std::byte[kCheckedBuffer]);
            const Status streamed =
                WriteRuns(std::span(&run, 1), out, at,
                          std::span(checked_buffer.get(), kCheckedBuffer), options.progress);
            if (!streamed.ok()) return streamed;
            at += run.length;
            continue;
          }
          // The new file reads as zeros wherever nothing was written; its size is set below.
          for (uint64_t done = 0; run.file != nullptr && done < run.length;) {
            const uint64_t n = std::min(run.length - done, kProgressStep);
            UCP_RETURN_IF_ERROR(CopyRange(*run.file, run.offset + done, out, at + done, n));
            if (options.progress) options.progress(n);
            done += n;
          }
          if (run.file == nullptr && run.length > 0 && options.progress) {
            options.progress(run.length);
          }
          at += run.length;
        }
      } else if (entry.source.empty()) {
        UCP_RETURN_IF_ERROR(out.WriteAt(cursor, entry.memory));
      } else {
        // The source is opened per tensor: many tensors of one file cost one open each, which
        // is noise next to copying their bytes.
        UCP_ASSIGN_OR_RETURN(File source, File::Open(entry.source, File::Mode::kRead));
        UCP_ASSIGN_OR_RETURN(uint64_t source_size, source.Size());
        if (!RangeWithin(entry.source_offset, entry.size, source_size)) {
          return Status::InvalidArgument("range [" + std::to_string(entry.source_offset) + ", +" +
                                         std::to_string(entry.size) + ") is outside " +
                                         entry.source);
        }
        UCP_RETURN_IF_ERROR(CopyRange(source, entry.source_offset, out, cursor, entry.size));
        if (options.progress) options.progress(entry.size);
      }
      cursor += entry.size;
    }
    // Trailing runs of zeros were skipped: the file must still end where the data does.
    return out.Truncate(cursor);
  });
}

Result<std::string> SafetensorsIndexJson(const SafetensorsIndex& index) {
  OrderedJson metadata = OrderedJson::object();
  if (index.total_size) metadata["total_size"] = *index.total_size;
  for (const auto& [key, value] : index.metadata) {
    OrderedJson parsed = OrderedJson::parse(value, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded() || !ValidUtf8(key)) {
      return Status::InvalidArgument("safetensors: index metadata \"" + key +
                                     "\" is not UTF-8 JSON");
    }
    metadata[key] = std::move(parsed);
  }
  OrderedJson weight_map = OrderedJson::object();
  for (const auto& [name, file] : index.weight_map) {
    if (!ValidUtf8(name) || !ValidUtf8(file)) {
      return Status::InvalidArgument("safetensors: index entry \"" + name + "\" is not UTF-8");
    }
    weight_map[name] = file;
  }
  return OrderedJson{{"metadata", std::move(metadata)}, {"weight_map", std::move(weight_map)}}.dump(
             2) +
         "\n";
}

Status WriteSafetensorsIndex(const std::string& path, const SafetensorsIndex& index) {
  UCP_ASSIGN_OR_RETURN(const std::string text, SafetensorsIndexJson(index));
  return WriteAtomically(path, /*sync=*/true,
                         [&](File& out) { return out.WriteAt(0, std::as_bytes(std::span(text))); });
}

}  // namespace ucp
