// unless_out_of_memory(call): call's result, or std::nullopt where an allocation it makes fails for want of GPU memory
// (c10::OutOfMemoryError). For fast paths whose temporaries eager's call does not take: their callers then run
// eager's computation, so that the library raises no out-of-memory error that eager would not. The call must write no
// output before those allocations. Torch-side files only.
#pragma once

#include <c10/util/Exception.h>

#include <optional>

namespace kernels::common {

template <class Call>
auto unless_out_of_memory(Call&& call) -> std::optional<decltype(call())> {
  try {
    return call();
  } catch (const c10::OutOfMemoryError&) {
    return std::nullopt;
  }
}

}  // namespace kernels::common
