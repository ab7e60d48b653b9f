#include "core/format/dtype.h"

#include <array>

namespace ucp {
namespace {

struct DTypeNames {
  DType dtype;
  uint64_t item_size;
  std::string_view safetensors;  // empty: none
  std::string_view torch;
  std::string_view storage_class;  // empty: none
};

constexpr std::array<DTypeNames, 17> kNames = {{
    {DType::kBool, 1, "BOOL", "bool", "BoolStorage"},
    {DType::kUInt8, 1, "U8", "uint8", "ByteStorage"},
    {DType::kInt8, 1, "I8", "int8", "CharStorage"},
    {DType::kInt16, 2, "I16", "int16", "ShortStorage"},
    {DType::kUInt16, 2, "U16", "uint16", ""},
    {DType::kInt32, 4, "I32", "int32", "IntStorage"},
    {DType::kUInt32, 4, "U32", "uint32", ""},
    {DType::kInt64, 8, "I64", "int64", "LongStorage"},
    {DType::kUInt64, 8, "U64", "uint64", ""},
    {DType::kFloat16, 2, "F16", "float16", "HalfStorage"},
    {DType::kBFloat16, 2, "BF16", "bfloat16", "BFloat16Storage"},
    {DType::kFloat32, 4, "F32", "float32", "FloatStorage"},
    {DType::kFloat64, 8, "F64", "float64", "DoubleStorage"},
    {DType::kComplex64, 8, "C64", "complex64", "ComplexFloatStorage"},
    {DType::kComplex128, 16, "", "complex128", "ComplexDoubleStorage"},
    {DType::kFloat8E5M2, 1, "F8_E5M2", "float8_e5m2", ""},
    {DType::kFloat8E4M3, 1, "F8_E4M3", "float8_e4m3fn", ""},
}};

constexpr bool InEnumOrder() {
  for (size_t i = 0; i < kNames.size(); ++i) {
    if (static_cast<size_t>(kNames[i].dtype) != i) return false;
  }
  return true;
}
static_assert(InEnumOrder(), "kNames is indexed by DType");

const DTypeNames& Names(DType dtype) { return kNames[static_cast<size_t>(dtype)]; }

}  // namespace

uint64_t ItemSize(DType dtype) { return Names(dtype).item_size; }

std::optional<std::string_view> SafetensorsName(DType dtype) {
  if (Names(dtype).safetensors.empty()) return std::nullopt;
  return Names(dtype).safetensors;
}

std::optional<DType> DTypeFromSafetensorsName(std::string_view name) {
  for (const DTypeNames& names : kNames) {
    if (!names.safetensors.empty() && names.safetensors == name) return names.dtype;
  }
  return std::nullopt;
}

std::string_view TorchName(DType dtype) { return Names(dtype).torch; }

std::optional<DType> DTypeFromTorchName(std::string_view name) {
  for (const DTypeNames& names : kNames) {
    if (names.torch == name) return names.dtype;
  }
  return std::nullopt;
}

std::optional<std::string_view> TorchStorageClass(DType dtype) {
  if (Names(dtype).storage_class.empty()) return std::nullopt;
  return Names(dtype).storage_class;
}

std::optional<DType> DTypeFromTorchStorageClass(std::string_view class_name) {
  for (const DTypeNames& names : kNames) {
    if (!names.storage_class.empty() && names.storage_class == class_name) return names.dtype;
  }
  return std::nullopt;
}

std::optional<DType> StorageElementType(std::string_view class_name) {
  if (class_name == "UntypedStorage") return DType::kUInt8;
  if (class_name == "QInt8Storage") return DType::kInt8;
  if (class_name == "QUInt8Storage" || class_name == "QUInt4x2Storage" ||
      class_name == "QUInt2x4Storage") {
    return DType::kUInt8;
  }
  if (class_name == "QInt32Storage") return DType::kInt32;
  return DTypeFromTorchStorageClass(class_name);
}

}  // namespace ucp
