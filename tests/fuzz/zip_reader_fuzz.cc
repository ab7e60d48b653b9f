// libFuzzer target: ZipReader over arbitrary bytes. Every input must give a Status or a reader
// whose records lie inside the file; reading and CRC-checking those records must not crash.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/format/zip_reader.h"
#include "core/io/file.h"

namespace {

// One in-memory file reused by every run (the reader takes a path-named File).
int MemoryFile() {
  static const int fd = ::memfd_create("zip_reader_fuzz", MFD_CLOEXEC);
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = MemoryFile();
  if (fd < 0 || ::ftruncate(fd, 0) != 0) std::abort();
  if (size > 0 && ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) std::abort();
  auto file = ucp::File::Open("/proc/self/fd/" + std::to_string(fd), ucp::File::Mode::kRead);
  if (!file.ok()) std::abort();
  ucp::ZipReader::Limits limits;
  limits.max_records = 1 << 16;
  auto reader = ucp::ZipReader::Open(std::move(file).value(), limits);
  if (!reader.ok()) return 0;
  for (const ucp::ZipRecord& record : reader->records()) {
    if (record.data_offset + record.size > size || !ucp::IsValidZipRecordName(record.name)) {
      std::abort();
    }
    if (reader->Find(record.name) == nullptr) std::abort();
    (void)reader->ReadRecord(record, 1 << 16);
    (void)reader->VerifyCrc(record);
  }
  (void)reader->Find("data.pkl");
  return 0;
}
