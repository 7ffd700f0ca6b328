#include "dpara_rt/staging.h"

#include "cuda_internal.h"
#include "util.h"

namespace dpara_rt {

StagingRegion parse_staging_region(const std::string& name) {
  if (name == "rb") return StagingRegion::rb;
  if (name == "draft") return StagingRegion::draft;
  if (name == "features") return StagingRegion::features;
  detail::value_error("unknown staging region '", name, "': expected rb, draft or features");
}

const char* staging_region_name(StagingRegion r) {
  switch (r) {
    case StagingRegion::rb: return "rb";
    case StagingRegion::draft: return "draft";
    case StagingRegion::features: return "features";
  }
  return "?";
}

Staging::Staging(int batch, int d, std::size_t feature_bytes, int device, bool shared)
    : batch_(batch), d_(d), feature_bytes_(feature_bytes), device_(device) {
  if (batch < 1) detail::value_error("staging batch must be >= 1, got ", batch);
  detail::check_draft_length(d, "staging");
  if (device < -1) detail::value_error("staging device must be -1 (host) or a CUDA device index, got ", device);
  // Bounded before any arithmetic: sizes near 2^64 would wrap in the alignment and allocate a tiny buffer.
  if (feature_bytes > kMaxFeatureBytes)
    detail::value_error("staging feature_bytes = ", feature_bytes, " exceeds the limit of ", kMaxFeatureBytes, " bytes");
  // Each region starts on a 64-byte boundary so a DMA engine or a vector load never straddles regions.
  const std::size_t a = Buffer::kAlignment;
  offset_[0] = 0;
  offset_[1] = detail::align_up(bytes(StagingRegion::rb), a);
  offset_[2] = offset_[1] + detail::align_up(bytes(StagingRegion::draft), a);
  phase_bytes_ = offset_[2] + detail::align_up(feature_bytes, a);
  if (shared && device >= 0)
    detail::value_error("shared staging lives in host memory for a drafter process: device must be -1, got ", device);
  if (shared) {
    buf_ = std::make_shared<Buffer>(MemoryKind::host_shared, kPhases * phase_bytes_);
  } else if (device >= 0) {
    detail::require_cuda_device(device, "pinned staging buffers");
    buf_ = std::make_shared<Buffer>(MemoryKind::host_pinned, kPhases * phase_bytes_);
  } else {
    buf_ = std::make_shared<Buffer>(MemoryKind::host, kPhases * phase_bytes_);
  }
}

int Staging::check_phase(int phase) {
  if (phase != 0 && phase != 1) detail::value_error("staging phase must be 0 or 1, got ", phase);
  return phase;
}

std::size_t Staging::bytes(StagingRegion region) const {
  switch (region) {
    case StagingRegion::rb: return std::size_t(batch_) * 2 * sizeof(std::int32_t);
    case StagingRegion::draft: return std::size_t(batch_) * std::size_t(d_) * sizeof(std::int32_t);
    case StagingRegion::features: return feature_bytes_;
  }
  return 0;
}

std::size_t Staging::offset(StagingRegion region, int phase) const {
  return std::size_t(check_phase(phase)) * phase_bytes_ + offset_[std::size_t(region)];
}

void* Staging::data(StagingRegion region, int phase) const {
  return static_cast<char*>(buf_->data()) + offset(region, phase);
}

TensorView Staging::view(StagingRegion region, int phase) const {
  TensorView v{buf_, data(region, phase), DType::int32, {}, -1};
  switch (region) {
    case StagingRegion::rb: v.shape = {batch_, 2}; break;
    case StagingRegion::draft: v.shape = {batch_, d_}; break;
    case StagingRegion::features:
      v.dtype = DType::uint8;
      v.shape = {std::int64_t(feature_bytes_)};
      break;
  }
  return v;
}

void Staging::check_fits(StagingRegion region, std::size_t n) const {
  if (n > bytes(region))
    detail::value_error("copy of ", n, " bytes does not fit staging region '", staging_region_name(region), "' of ",
                        bytes(region), " bytes");
}

void Staging::copy_in(Lane& lane, StagingRegion region, const void* src, std::size_t n, int phase) {
  check_fits(region, n);
  if (n > 0 && src == nullptr) detail::value_error("staging copy_in of ", n, " bytes from a null source pointer");
  lane.copy_async(data(region, phase), src, n);
}

void Staging::copy_out(Lane& lane, StagingRegion region, void* dst, std::size_t n, int phase) {
  check_fits(region, n);
  if (n > 0 && dst == nullptr) detail::value_error("staging copy_out of ", n, " bytes to a null destination pointer");
  lane.copy_async(dst, data(region, phase), n);
}

}  // namespace dpara_rt
