#pragma once
// Staging: the small cross-device messages of a round in pinned host memory (cudaHostAlloc with CUDA,
// 64-byte aligned host memory on the CPU backend), double-buffered: while a lane copies into one phase,
// the host reads the other. The caller names the phase (0 or 1) on every access, e.g. from the round's
// parity, so producer and consumer of a round agree without shared mutable state. Regions per phase:
//   rb       int32 [batch, 2]   (r, bonus) per request
//   draft    int32 [batch, d]   draft tokens
//   features uint8 [feature_bytes]  accepted-token features, in whatever layout the caller uses
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "dpara_rt/lane.h"
#include "dpara_rt/memory.h"

namespace dpara_rt {

enum class StagingRegion : std::uint8_t { rb, draft, features };
// "rb" | "draft" | "features"; anything else -> std::invalid_argument naming it.
StagingRegion parse_staging_region(const std::string& name);
const char* staging_region_name(StagingRegion r);

class Staging {
 public:
  static constexpr int kPhases = 2;
  static constexpr std::size_t kMaxFeatureBytes = std::size_t(1) << 40;  // far above any round's features
  // device >= 0: page-locked memory through cudaHostAlloc for transfers with that CUDA device;
  // device -1: plain aligned host memory (CPU backend). feature_bytes <= kMaxFeatureBytes. shared (host only):
  // the phases live in a memfd (shared_fd()) that a drafter worker process maps; offset() locates a region.
  Staging(int batch, int d, std::size_t feature_bytes, int device = -1, bool shared = false);

  // phase: 0 or 1 (anything else -> std::invalid_argument naming it).
  void* data(StagingRegion region, int phase) const;
  std::size_t bytes(StagingRegion region) const;
  TensorView view(StagingRegion region, int phase) const;
  std::size_t offset(StagingRegion region, int phase) const;  // bytes from the start of the buffer
  int shared_fd() const { return buf_->fd(); }                // -1 unless shared
  std::size_t nbytes() const { return buf_->bytes(); }

  // Copy `bytes` bytes from `src` into the region (copy_in) or from the region to `dst` (copy_out) in
  // `lane`'s order; src/dst may be device memory on a CudaLane. bytes must fit in the region.
  // A null pointer with bytes > 0 is refused (std::invalid_argument).
  void copy_in(Lane& lane, StagingRegion region, const void* src, std::size_t bytes, int phase);
  void copy_out(Lane& lane, StagingRegion region, void* dst, std::size_t bytes, int phase);

  int batch() const { return batch_; }
  int d() const { return d_; }
  std::size_t feature_bytes() const { return feature_bytes_; }
  bool pinned() const { return buf_->kind() == MemoryKind::host_pinned; }
  int device() const { return device_; }

 private:
  static int check_phase(int phase);
  void check_fits(StagingRegion region, std::size_t bytes) const;
  int batch_, d_;
  std::size_t feature_bytes_;
  int device_;
  std::size_t offset_[3] = {0, 0, 0};  // region offsets inside one phase
  std::size_t phase_bytes_ = 0;
  std::shared_ptr<Buffer> buf_;
};

}  // namespace dpara_rt
