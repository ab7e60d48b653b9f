#include "core/format/safetensors_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "core/util/checked.h"

namespace ucp {
namespace {

using OrderedJson = nlohmann::ordered_json;

constexpr size_t kCopyChunk = 8 << 20;

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

// An open descriptor, closed with the object.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now, reporting the error close() returns (it can carry a delayed write error).
  Status Close(const std::string& path) {
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) return PosixError("safetensors: close " + path, errno);
    return Status::Ok();
  }

 private:
  int fd_;
};

Status WriteAll(int fd, const std::string& path, const void* data, size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, bytes, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PosixError("safetensors: write " + path, errno);
    bytes += n;
    size -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

// Appends [offset, offset + size) of `source` to `out_fd`: copy_file_range keeps the bytes in
// the kernel; where it cannot (other file systems, old kernels) a buffered copy takes over.
Status CopyRange(int out_fd, const std::string& out_path, const std::string& source,
                 uint64_t offset, uint64_t size, std::vector<char>& buffer) {
  Fd in(::open(source.c_str(), O_RDONLY | O_CLOEXEC));
  if (in.get() < 0) return PosixError("safetensors: open " + source, errno);
  struct stat st;
  if (::fstat(in.get(), &st) != 0) return PosixError("safetensors: stat " + source, errno);
  if (!RangeWithin(offset, size, static_cast<uint64_t>(st.st_size))) {
    return Status::InvalidArgument("safetensors: range [" + std::to_string(offset) + ", +" +
                                   std::to_string(size) + ") is outside " + source);
  }
  auto in_offset = static_cast<off_t>(offset);
  uint64_t left = size;
  bool kernel_copy = true;
  while (left > 0) {
    if (kernel_copy) {
      const ssize_t n = ::copy_file_range(in.get(), &in_offset, out_fd, nullptr,
                                          std::min<uint64_t>(left, 1u << 30), 0);
      if (n > 0) {
        left -= static_cast<uint64_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) return Status::Corrupt("safetensors: " + source + " shrank while being copied");
      if (errno != EXDEV && errno != ENOSYS && errno != EINVAL && errno != EOPNOTSUPP) {
        return PosixError("safetensors: copy " + source + " to " + out_path, errno);
      }
      kernel_copy = false;
    }
    if (buffer.empty()) buffer.resize(kCopyChunk);
    const size_t want = static_cast<size_t>(std::min<uint64_t>(left, buffer.size()));
    const ssize_t n = ::pread(in.get(), buffer.data(), want, in_offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PosixError("safetensors: read " + source, errno);
    if (n == 0) return Status::Corrupt("safetensors: " + source + " shrank while being copied");
    UCP_RETURN_IF_ERROR(WriteAll(out_fd, out_path, buffer.data(), static_cast<size_t>(n)));
    in_offset += n;
    left -= static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

// Writes `body(fd)` to "<path>.tmp.<pid>", fsyncs it and renames it over `path`; the temporary
// file is removed on any failure.
template <typename Body>
Status WriteAtomically(const std::string& path, Body body) {
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  Fd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return PosixError("safetensors: create " + temp, errno);
  Status status = body(fd.get(), temp);
  if (status.ok() && ::fsync(fd.get()) != 0)
    status = PosixError("safetensors: fsync " + temp, errno);
  if (status.ok()) status = fd.Close(temp);
  if (status.ok() && ::rename(temp.c_str(), path.c_str()) != 0) {
    status = PosixError("safetensors: rename " + temp + " to " + path, errno);
  }
  if (!status.ok()) ::unlink(temp.c_str());
  return status;
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
  if (entry.source.empty() && entry.memory.size() != *size) {
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
  return Add(Entry{std::move(name), dtype, std::move(shape), 0, data, "", 0});
}

Status SafetensorsWriter::AddFromFile(std::string name, DType dtype, std::vector<uint64_t> shape,
                                      std::string source, uint64_t offset) {
  if (source.empty()) return Status::InvalidArgument("safetensors: empty source path for " + name);
  return Add(Entry{std::move(name), dtype, std::move(shape), 0, {}, std::move(source), offset});
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

Status SafetensorsWriter::Write(const std::string& path) const {
  const std::string header = Header();
  if (header.size() > kMaxSafetensorsHeader) {
    return Status::OutOfRange("safetensors: header of " + path + " exceeds the size limit");
  }
  return WriteAtomically(path, [&](int fd, const std::string& temp) -> Status {
    unsigned char length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(header.size() >> (8 * i));
    UCP_RETURN_IF_ERROR(WriteAll(fd, temp, length, sizeof(length)));
    UCP_RETURN_IF_ERROR(WriteAll(fd, temp, header.data(), header.size()));
    std::vector<char> buffer;
    for (const Entry& entry : entries_) {
      if (entry.source.empty()) {
        UCP_RETURN_IF_ERROR(WriteAll(fd, temp, entry.memory.data(), entry.memory.size()));
      } else {
        UCP_RETURN_IF_ERROR(
            CopyRange(fd, temp, entry.source, entry.source_offset, entry.size, buffer));
      }
    }
    return Status::Ok();
  });
}

Status WriteSafetensorsIndex(const std::string& path, const SafetensorsIndex& index) {
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
  const std::string text =
      OrderedJson{{"metadata", std::move(metadata)}, {"weight_map", std::move(weight_map)}}.dump(
          2) +
      "\n";
  return WriteAtomically(path, [&](int fd, const std::string& temp) {
    return WriteAll(fd, temp, text.data(), text.size());
  });
}

}  // namespace ucp
