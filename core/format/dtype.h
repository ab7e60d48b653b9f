// Element types of tensor data as torch and safetensors name them.
//
// One enum for both formats, so a tensor read from a torch archive can be written to safetensors
// (and back) without a second mapping. All data is little-endian.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace ucp {

enum class DType : uint8_t {
  kBool,
  kUInt8,
  kInt8,
  kInt16,
  kUInt16,
  kInt32,
  kUInt32,
  kInt64,
  kUInt64,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
  kComplex64,   // two float32
  kComplex128,  // two float64
  kFloat8E5M2,
  kFloat8E4M3,
};

// Bytes per element (1 for kBool).
uint64_t ItemSize(DType dtype);

// The safetensors header name: "F32", "BF16", "BOOL", ... ("C64" for kComplex64). kComplex128
// has no safetensors name: returns nullopt.
std::optional<std::string_view> SafetensorsName(DType dtype);
std::optional<DType> DTypeFromSafetensorsName(std::string_view name);

// torch's name without the "torch." prefix: "float32", "bfloat16", "bool", ...
std::string_view TorchName(DType dtype);
// The inverse of TorchName: "float32" → kFloat32; nullopt for any other string (aliases such as
// "float" or "half" included).
std::optional<DType> DTypeFromTorchName(std::string_view name);

// The legacy typed-storage class torch.save pickles for the dtype, e.g. "FloatStorage",
// "BFloat16Storage" (module "torch"). Returns nullopt for dtypes torch 1.13 has no storage
// class for (the unsigned types wider than 8 bits, float8).
std::optional<std::string_view> TorchStorageClass(DType dtype);
std::optional<DType> DTypeFromTorchStorageClass(std::string_view class_name);

// The element type whose size lays out a pickled storage of class `class_name` (module torch):
// the typed storages above, "UntypedStorage" (bytes), and the quantized storages
// ("QInt8Storage" → kInt8, "QUInt8Storage"/"QUInt4x2Storage"/"QUInt2x4Storage" → kUInt8,
// "QInt32Storage" → kInt32), whose bytes ucp carries without interpreting them.
std::optional<DType> StorageElementType(std::string_view class_name);

}  // namespace ucp
