// once_per_device(device, compute): for what a launch reads of a device or a kernel (attributes, support), which does
// not change while the process runs, so that a launch does not pay runtime queries. compute(device) returns a
// std::optional: a value is kept for the device (per call site: each lambda has its own type), std::nullopt (a query
// that failed) is returned as it is and asked again next time. Devices past kMaxCachedDevices are asked every time.
// Host code only; no torch headers.
#pragma once

#include <mutex>
#include <optional>

namespace kernels {

constexpr int kMaxCachedDevices = 64;

template <typename Compute>
auto once_per_device(int device, Compute compute) -> decltype(compute(device)) {
  using Result = decltype(compute(device));
  static std::mutex mutex;
  static Result kept[kMaxCachedDevices];
  if (device < 0 || device >= kMaxCachedDevices) return compute(device);
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (kept[device].has_value()) return kept[device];
  }
  const Result result = compute(device);
  if (result.has_value()) {
    const std::lock_guard<std::mutex> lock(mutex);
    kept[device] = result;
  }
  return result;
}

}  // namespace kernels
