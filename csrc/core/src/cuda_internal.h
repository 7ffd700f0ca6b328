#pragma once
// Entry points into the CUDA backend used by the CPU-side sources. cuda_backend.cu defines them when the
// core is built with CUDA; no_cuda.cpp defines them as clear errors otherwise.
#include <cstddef>
#include <string>

namespace dpara_rt::detail {

// Throws std::runtime_error naming `device`, `what` needed it, and the CUDA status, unless it is usable.
void require_cuda_device(int device, const char* what);
void* cuda_malloc(std::size_t bytes, int device);
void cuda_free(void* p, int device);
void* cuda_host_alloc(std::size_t bytes);
void cuda_host_free(void* p);
void cuda_memset_zero(void* p, std::size_t bytes, int device);

}  // namespace dpara_rt::detail
