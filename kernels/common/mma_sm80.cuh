// The sm_80 instructions the mma.sync kernels share (the GEMM family's gemm_sm80.cu, the attention family's
// attention.cu): shared-memory addresses, cp.async copies, ldmatrix and the m16n8k16 fp16 product with an fp32
// accumulator. Each compiles to nothing below sm_80, where the kernels that call them are never launched. No torch
// headers.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KERNELS_SM80_DEVICE 1
#else
#define KERNELS_SM80_DEVICE 0
#endif

namespace kernels::common::sm80 {

__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from global to shared memory, asynchronously; valid = false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void copy_16_async(std::uint32_t to, const void* from, bool valid) {
#if KERNELS_SM80_DEVICE
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(from), "r"(valid ? 16 : 0)
               : "memory");
#endif
}

__device__ __forceinline__ void copy_4_async(std::uint32_t to, const void* from, bool valid) {
#if KERNELS_SM80_DEVICE
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(to), "l"(from), "r"(valid ? 4 : 0) : "memory");
#endif
}

// Closes this thread's group of cp.async copies issued so far.
__device__ __forceinline__ void commit_copies() {
#if KERNELS_SM80_DEVICE
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
#if KERNELS_SM80_DEVICE
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

__device__ __forceinline__ void load_matrix_x4(std::uint32_t address, std::uint32_t (&r)[4]) {
#if KERNELS_SM80_DEVICE
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
#endif
}

// d = a b + c, m16n8k16, fp16 operands, fp32 accumulator; kZero: c = 0 (a fresh accumulator's first product).
template <bool kZero>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                             std::uint32_t b1) {
#if KERNELS_SM80_DEVICE
  if constexpr (kZero) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

}  // namespace kernels::common::sm80
