// stream_capturing(t): whether the current stream of t's device is capturing a CUDA graph. A buffer one op hands to a
// later op outside the tensors they exchange (the GEMM's left row split) is neither left nor read then: a graph
// captured around the reader alone would keep reading a buffer the writer's side frees. Torch-side CUDA files only.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

namespace kernels::common {

inline bool stream_capturing(const at::Tensor& t) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(t.device().index()).stream(), &status) != cudaSuccess) {
    (void)cudaGetLastError();  // a failed query leaves no error for a later launch's check to report
    return true;               // unknown: taken as capturing (nothing handed over)
  }
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace kernels::common
