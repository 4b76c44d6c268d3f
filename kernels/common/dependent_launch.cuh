// Programmatic dependent launch (sm_90 and later): a kernel launched by launch_dependent may start while the kernel
// before it in the stream drains, so its launch and set-up overlap that kernel's tail instead of following its end.
// Every kernel so launched calls wait_for_previous_grid() before it touches global memory (the previous grid's
// results and its inputs both: a buffer the caching allocator hands out again may still be read by it), then
// allow_next_grid(), which lets the next such kernel launch. On older GPUs the launch is a plain one and both calls
// do nothing. Beside it, what launches share: raise_shared_memory_limit, a kernel's shared-memory limit set once per
// device. No torch headers.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <optional>

#include <cuda_runtime.h>

#include "common/device_queries.h"
#include "common/once_per_device.h"

namespace kernels {

// Waits until the grid this one depends on has finished and its writes are visible (at once without a dependency).
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel of the stream launched by launch_dependent start (it still waits for this grid's end).
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether the current device takes programmatic dependent launches (compute capability 9.0 or later), asked once
// per device. KERNELS_DEPENDENT_LAUNCH=0 (read once per process, at the first launch) turns them off: plain launches,
// so that a profiler's kernel times hold no wait for the kernel before.
inline bool dependent_launch_supported() {
  static const bool turned_off = [] {
    const char* value = std::getenv("KERNELS_DEPENDENT_LAUNCH");
    return value != nullptr && value[0] == '0';
  }();
  if (turned_off) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return once_per_device(device, [](int d) -> std::optional<bool> {
    const std::optional<int> capability = compute_capability(d);
    if (!capability) return std::nullopt;
    return *capability >= 90;
  }).value_or(false);
}

// Raises the dynamic shared memory limit of each kernel of kKernels to `bytes` on `device`, which must be the current
// one (kernel attributes are the current device's): once per device and set of kernels, so that a launch pays no
// attribute call; `bytes` must be the same on every call for a set. cudaSuccess, or the failed call's error (the set
// is tried again at the next launch).
template <auto... kKernels>
cudaError_t raise_shared_memory_limit(int device, std::size_t bytes) {
  cudaError_t err = cudaSuccess;
  const bool raised = once_per_device(device, [&err, bytes](int) -> std::optional<bool> {
    const int limit = static_cast<int>(bytes);
    const auto set = [&err, limit](auto kernel) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
      return err == cudaSuccess;
    };
    if ((set(kKernels) && ...)) return true;
    (void)cudaGetLastError();  // reported here, not again by a later launch's check
    return std::nullopt;
  }).value_or(false);
  return raised ? cudaSuccess : err;
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...) on the current device, as a programmatic dependent launch
// where the device takes one; `cooperative`: all of the grid's blocks resident at once, or no launch
// (cudaErrorCooperativeLaunchTooLarge), for a kernel whose blocks wait for each other. Returns the launch's error.
template <typename... Params, typename... Args>
cudaError_t launch_dependent_as(bool cooperative, void (*kernel)(Params...), dim3 grid, dim3 block,
                                std::size_t shared_bytes, cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attributes[2];
  unsigned count = 0;
  if (dependent_launch_supported()) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cooperative) {
    attributes[count].id = cudaLaunchAttributeCooperative;
    attributes[count++].val.cooperative = 1;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = count;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
  if (err != cudaSuccess) (void)cudaGetLastError();  // reported here, not again by a later launch's check
  return err;
}

template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes,
                             cudaStream_t stream, Args... args) {
  return launch_dependent_as(false, kernel, grid, block, shared_bytes, stream, args...);
}

}  // namespace kernels
