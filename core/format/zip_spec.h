// Constants of the zip format (PKWARE APPNOTE.TXT 6.3) shared by ZipReader and ZipWriter, and
// little-endian load/store helpers. Internal to core/format; the byte layouts are documented in
// zip_reader.h and zip_writer.h.
//
// Thread-safety: constants and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace ucp::zip_spec {

inline constexpr uint32_t kLocalSignature = 0x04034b50;           // "PK\3\4"
inline constexpr uint32_t kCentralSignature = 0x02014b50;         // "PK\1\2"
inline constexpr uint32_t kDataDescriptorSignature = 0x08074b50;  // "PK\7\8"
inline constexpr uint32_t kZip64EocdSignature = 0x06064b50;       // "PK\6\6"
inline constexpr uint32_t kZip64LocatorSignature = 0x07064b50;    // "PK\6\7"
inline constexpr uint32_t kEocdSignature = 0x06054b50;            // "PK\5\6"

inline constexpr size_t kLocalHeaderSize = 30;
inline constexpr size_t kCentralHeaderSize = 46;
inline constexpr size_t kZip64EocdSize = 56;
inline constexpr size_t kZip64LocatorSize = 20;
inline constexpr size_t kEocdSize = 22;

inline constexpr uint16_t kZip64ExtraId = 0x0001;
inline constexpr uint16_t kPaddingExtraId = 0x4246;  // 'F','B': torch's alignment padding

inline constexpr uint16_t kFlagEncrypted = 1u << 0;
inline constexpr uint16_t kFlagDataDescriptor = 1u << 3;
inline constexpr uint16_t kFlagStrongEncryption = 1u << 6;
inline constexpr uint16_t kFlagUtf8 = 1u << 11;

inline constexpr uint16_t kMethodStored = 0;

inline uint16_t Le16(const unsigned char* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
inline uint32_t Le32(const unsigned char* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}
inline uint64_t Le64(const unsigned char* p) { return Le32(p) | uint64_t{Le32(p + 4)} << 32; }

// Appends little-endian integers to a byte string.
inline void Put16(std::string& out, uint16_t v) {
  out.push_back(static_cast<char>(v));
  out.push_back(static_cast<char>(v >> 8));
}
inline void Put32(std::string& out, uint32_t v) {
  Put16(out, static_cast<uint16_t>(v));
  Put16(out, static_cast<uint16_t>(v >> 16));
}
inline void Put64(std::string& out, uint64_t v) {
  Put32(out, static_cast<uint32_t>(v));
  Put32(out, static_cast<uint32_t>(v >> 32));
}

}  // namespace ucp::zip_spec
