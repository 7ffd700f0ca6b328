#pragma once
// Owned memory blocks and non-owning views of them. A TensorView keeps its block alive, so a tensor made
// from it (through DLPack) stays valid however long the core object that handed it out lives.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "dpara_rt/types.h"

namespace dpara_rt {

enum class MemoryKind : std::uint8_t {
  host,         // 64-byte aligned host memory (CPU backend)
  host_pinned,  // page-locked host memory from cudaHostAlloc
  device,       // cudaMalloc on `device`
  host_shared,  // a memfd mapped MAP_SHARED: another process maps fd() and sees the same bytes (Linux)
};

class Buffer {
 public:
  // Zero-filled block of `bytes` bytes. device: the CUDA device for `device` memory (ignored otherwise).
  Buffer(MemoryKind kind, std::size_t bytes, int device = -1);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  MemoryKind kind() const { return kind_; }
  int device() const { return device_; }  // -1 unless kind == device
  int fd() const { return fd_; }          // the memfd of host_shared memory, else -1 (closed with the block)
  static constexpr std::size_t kAlignment = 64;

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t mapped_ = 0;  // host_shared: the mapping's length
  MemoryKind kind_;
  int device_;
  int fd_ = -1;
};

struct TensorView {
  std::shared_ptr<Buffer> owner;
  void* data = nullptr;
  DType dtype = DType::float32;
  std::vector<std::int64_t> shape;  // contiguous, row-major
  int device = -1;                  // -1: host memory (pinned or not)

  std::int64_t numel() const;
  std::size_t nbytes() const { return std::size_t(numel()) * dtype_size(dtype); }
};

}  // namespace dpara_rt
