#include "dpara_rt/memory.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "cuda_internal.h"
#include "dpara_rt/dlpack.h"
#include "util.h"

namespace dpara_rt {

namespace {

// n bytes of a fresh memfd mapped MAP_SHARED (zero-filled by the kernel); *fd receives the memfd.
void* map_shared(std::size_t n, int* fd) {
#ifdef __linux__
  const int f = ::memfd_create("dpara_rt", MFD_CLOEXEC);
  if (f < 0) detail::runtime_error("memfd_create for ", n, " bytes of shared host memory failed: ", std::strerror(errno));
  if (::ftruncate(f, off_t(n)) != 0) {
    const int e = errno;
    ::close(f);
    detail::runtime_error("sizing shared host memory to ", n, " bytes failed: ", std::strerror(e));
  }
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    ::close(f);
    detail::runtime_error("mapping ", n, " bytes of shared host memory failed: ", std::strerror(e));
  }
  *fd = f;
  return p;
#else
  (void)n;
  (void)fd;
  detail::runtime_error("shared host memory needs Linux (memfd_create); this platform has none");
#endif
}

void free_block(MemoryKind kind, void* p, int device, std::size_t mapped, int fd) {
  switch (kind) {
    case MemoryKind::host: std::free(p); break;
    case MemoryKind::host_pinned: detail::cuda_host_free(p); break;
    case MemoryKind::device: detail::cuda_free(p, device); break;
    case MemoryKind::host_shared:
#ifdef __linux__
      ::munmap(p, mapped);
      ::close(fd);
#endif
      (void)mapped;
      (void)fd;
      break;
  }
}

}  // namespace

Buffer::Buffer(MemoryKind kind, std::size_t bytes, int device)
    : bytes_(bytes), kind_(kind), device_(kind == MemoryKind::device ? device : -1) {
  // Never hand out a null pointer, even for an empty block: DLPack consumers reject null data.
  const std::size_t n = detail::align_up(bytes ? bytes : 1, kAlignment);
  switch (kind) {
    case MemoryKind::host:
      data_ = std::aligned_alloc(kAlignment, n);
      if (!data_) throw std::bad_alloc();
      break;
    case MemoryKind::host_pinned: data_ = detail::cuda_host_alloc(n); break;
    case MemoryKind::device: data_ = detail::cuda_malloc(n, device); break;
    case MemoryKind::host_shared:
      data_ = map_shared(n, &fd_);
      mapped_ = n;
      return;  // a new memfd reads as zeros already
  }
  // A constructor that throws runs no destructor: free the block here, or it leaks.
  try {
    if (kind == MemoryKind::device) detail::cuda_memset_zero(data_, n, device);
    else std::memset(data_, 0, n);
  } catch (...) {
    free_block(kind_, data_, device_, mapped_, fd_);
    throw;
  }
}

Buffer::~Buffer() { free_block(kind_, data_, device_, mapped_, fd_); }

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

namespace {

struct ManagerCtx {
  std::shared_ptr<Buffer> owner;
  std::vector<std::int64_t> shape, strides;
};

dlpack::DLDataType dl_dtype(DType t) {
  const auto bits = std::uint8_t(dtype_size(t) * 8);
  switch (t) {
    case DType::float32: case DType::float16: return {dlpack::kDLFloat, bits, 1};
    case DType::bfloat16: return {dlpack::kDLBfloat, bits, 1};
    case DType::int32: case DType::int64: return {dlpack::kDLInt, bits, 1};
    case DType::uint8: return {dlpack::kDLUInt, bits, 1};
  }
  return {dlpack::kDLUInt, 8, 1};
}

}  // namespace

dlpack::DLDevice dlpack_device(const TensorView& v) {
  // Pinned host memory is ordinary CPU memory to a consumer such as torch.
  if (v.device >= 0) return {dlpack::kDLCUDA, v.device};
  return {dlpack::kDLCPU, 0};
}

dlpack::DLManagedTensor* to_dlpack(const TensorView& v) {
  // Explicit row-major strides: some consumers reject the legacy "null strides" shorthand.
  auto* ctx = new ManagerCtx{v.owner, v.shape, std::vector<std::int64_t>(v.shape.size())};
  std::int64_t stride = 1;
  for (std::size_t i = v.shape.size(); i-- > 0;) {
    ctx->strides[i] = stride;
    stride *= v.shape[i];
  }
  auto* m = new dlpack::DLManagedTensor{};
  m->dl_tensor.data = v.data;
  m->dl_tensor.device = dlpack_device(v);
  m->dl_tensor.ndim = std::int32_t(ctx->shape.size());
  m->dl_tensor.dtype = dl_dtype(v.dtype);
  m->dl_tensor.shape = ctx->shape.data();
  m->dl_tensor.strides = ctx->strides.data();
  m->dl_tensor.byte_offset = 0;
  m->manager_ctx = ctx;
  m->deleter = [](dlpack::DLManagedTensor* self) {
    delete static_cast<ManagerCtx*>(self->manager_ctx);
    delete self;
  };
  return m;
}

}  // namespace dpara_rt
