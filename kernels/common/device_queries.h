// What a launch asks of a device, or of the library's code for it; a query that fails is cleared (so that a later
// launch's check does not report it) and answered std::nullopt. Callers keep the answers with once_per_device. Host
// code where CUDA is compiled in; no torch headers.
#pragma once

#include <cuda_runtime.h>

#include <optional>

namespace kernels {

// The compute capability of `device` as 10 * major + minor.
inline std::optional<int> compute_capability(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nullopt;
  }
  return 10 * major + minor;
}

// The architecture (10 * major + minor) of the library's code of `kernel` that the current device runs: 90 for
// sm_90a's, 80 for sm_80's run on a later GPU. std::nullopt where the library holds none it can run.
template <typename Kernel>
std::optional<int> kernel_code_version(Kernel kernel) {
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nullopt;
  }
  return attributes.binaryVersion;
}

}  // namespace kernels
