// once_per_device(device, compute): compute(device) run once per device for each call site (each lambda type), its
// value kept for the process: for what a launch reads of a device or a kernel (attributes, support) that does not
// change while the process runs, so that a launch does not pay runtime queries. Devices past kMaxCachedDevices are
// computed on every call. Host code only; no torch headers.
#pragma once

#include <mutex>

namespace kernels {

constexpr int kMaxCachedDevices = 64;

template <typename Compute>
auto once_per_device(int device, Compute compute) -> decltype(compute(device)) {
  using Value = decltype(compute(device));
  static std::once_flag computed[kMaxCachedDevices];
  static Value values[kMaxCachedDevices];
  if (device < 0 || device >= kMaxCachedDevices) return compute(device);
  std::call_once(computed[device], [&] { values[device] = compute(device); });
  return values[device];
}

}  // namespace kernels
