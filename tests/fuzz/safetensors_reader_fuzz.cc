// Fuzzes the safetensors header validation: the input is a whole file.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/format/safetensors_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view file(reinterpret_cast<const char*>(data), size);
  ucp::Result<uint64_t> length =
      ucp::SafetensorsHeader::HeaderLength("fuzz", file.substr(0, 8), file.size());
  if (!length.ok()) return 0;
  ucp::Result<ucp::SafetensorsHeader> header =
      ucp::SafetensorsHeader::Parse("fuzz", file.substr(8, *length), file.size());
  if (header.ok()) {
    for (const ucp::SafetensorsTensor& tensor : header->tensors()) {
      if (tensor.offset + tensor.size > file.size()) __builtin_trap();
    }
  }
  return 0;
}
