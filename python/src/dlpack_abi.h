// The DLPack C ABI (https://dmlc.github.io/dlpack), version 1.0: the
// structures a producer hands a consumer through a PyCapsule named
// "dltensor" (DLManagedTensor) or "dltensor_versioned"
// (DLManagedTensorVersioned). A consumer renames the capsule to
// "used_dltensor" / "used_dltensor_versioned" and then owns the tensor.
#pragma once

#include <cstdint>

namespace shoal::python::dlpack {

inline constexpr std::uint32_t major_version = 1;
inline constexpr std::uint32_t minor_version = 0;

enum device_type : std::int32_t { kDLCPU = 1, kDLCUDA = 2 };
enum type_code : std::uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLComplex = 5, kDLBool = 6 };
inline constexpr std::uint64_t flag_read_only = std::uint64_t{1} << 0;

struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};

struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements; always set by shoal
  std::uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

struct DLPackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};

struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  std::uint64_t flags;
  DLTensor dl_tensor;
};

}  // namespace shoal::python::dlpack
