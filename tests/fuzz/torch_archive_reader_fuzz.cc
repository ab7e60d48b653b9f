// Fuzzes TorchArchiveReader::Open (zip directory, data.pkl, storage and tensor location): the
// input is a whole file, written to a per-process scratch file because the reader opens paths.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "core/format/torch_archive_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/ucp_torch_archive_fuzz_" + std::to_string(::getpid());
  FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) return 0;
  const bool written = std::fwrite(data, 1, size, file) == size;
  std::fclose(file);
  if (!written) return 0;
  ucp::Result<ucp::TorchArchiveReader> reader = ucp::TorchArchiveReader::Open(path);
  if (!reader.ok()) return 0;
  for (const ucp::TorchTensor& tensor : reader->tensors()) {
    // Open promised every element lies inside its storage, and every storage inside the file.
    if (tensor.storage->offset + tensor.storage->size > size) __builtin_trap();
    if (tensor.numel() > 0 && tensor.file_offset() >= tensor.storage->offset + tensor.storage->size)
      __builtin_trap();
    (void)tensor.contiguous();
  }
  (void)reader->Find("module/0/weight");
  return 0;
}
