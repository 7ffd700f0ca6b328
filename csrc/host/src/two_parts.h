// Two halves of a host computation at once, on the caller's thread and the host library's helper thread (the
// one host_linear_two_threads hands its second half to). Private to the host library's sources.
#pragma once

#include <functional>

namespace dpara_rt {

// part(0) here and part(1) on the helper, returning when both are done; both here, in order, when the helper is
// busy (another caller), disabled (DPARA_RT_HOST_THREADS=1) or absent (one core). The parts must write disjoint
// memory.
void host_two_parts(const std::function<void(int)>& part);

}  // namespace dpara_rt
