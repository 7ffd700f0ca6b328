#pragma once
// The DLPack C ABI (legacy, unversioned "dltensor" capsule layout, DLPack 0.8), written out here so the
// core needs no framework headers, plus the export of a TensorView.
#include <cstdint>

#include "dpara_rt/memory.h"

namespace dpara_rt {
namespace dlpack {

enum DLDeviceType : std::int32_t { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3 };
enum DLDataTypeCode : std::uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4 };

struct DLDevice {
  DLDeviceType device_type;
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
  std::int64_t* strides;  // in elements
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

}  // namespace dlpack

// A heap DLManagedTensor describing `v`; it holds a reference to v.owner until its deleter runs.
dlpack::DLManagedTensor* to_dlpack(const TensorView& v);
// (device_type, device_id) as __dlpack_device__ reports it.
dlpack::DLDevice dlpack_device(const TensorView& v);

}  // namespace dpara_rt
