// Hopper (sm_90a) building blocks of the GEMM family's kernels (and the attention family's Hopper kernel), as thin
// wrappers over their PTX: mbarriers, TMA tile loads into shared memory and stores from it, named barriers, wgmma
// descriptors, the m64n128k16 and m64n64k16 fp16 -> fp32 wgmma with A from registers, shared-memory loads and stores at
// shared-window addresses, and the warpgroup register reallocation. Device code only; every body is compiled only for
// sm_90a (__CUDA_ARCH_FEAT_SM90_ALL), so a unit that includes this builds for any target.
#pragma once

#include <cstdint>
#include <cuda.h>

namespace kernels::gemm::sm90 {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KERNELS_SM90A_DEVICE 1
#else
#define KERNELS_SM90A_DEVICE 0
#endif

__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers --------------------------------------------------------------------------------------------------

__device__ __forceinline__ void barrier_init(std::uint64_t* barrier, int arrivals) {
#if KERNELS_SM90A_DEVICE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(barrier)), "r"(arrivals));
#endif
}

// Makes the barriers' initialisation visible to the async proxy (TMA) before any use.
__device__ __forceinline__ void barrier_init_fence() {
#if KERNELS_SM90A_DEVICE
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One arrival that also announces `bytes` to come from TMA before the phase completes.
__device__ __forceinline__ void barrier_arrive_expect_bytes(std::uint64_t* barrier, std::uint32_t bytes) {
#if KERNELS_SM90A_DEVICE
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(barrier)), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void barrier_arrive(std::uint64_t* barrier) {
#if KERNELS_SM90A_DEVICE
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(barrier)) : "memory");
#endif
}

// Waits until the barrier's phase with the given parity has completed.
__device__ __forceinline__ void barrier_wait(std::uint64_t* barrier, std::uint32_t parity) {
#if KERNELS_SM90A_DEVICE
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(smem_address(barrier)),
      "r"(parity)
      : "memory");
#endif
}

// ---- named barriers (bar.sync / bar.arrive), for ordering warpgroups -------------------------------------------

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
#if KERNELS_SM90A_DEVICE
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
#endif
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
#if KERNELS_SM90A_DEVICE
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
#endif
}

// ---- TMA --------------------------------------------------------------------------------------------------------

// Loads the 2-D box at (column, row) of the tensor map into shared memory; completion (its bytes) on `barrier`.
// Elements outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_2d(void* destination, const CUtensorMap* map, std::uint64_t* barrier,
                                            int column, int row) {
#if KERNELS_SM90A_DEVICE
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_address(destination)), "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_address(barrier)),
      "r"(column), "r"(row)
      : "memory");
#endif
}

// Stores the 2-D box at (column, row) of the tensor map from shared memory (at shared address `source`), in the
// thread's current bulk group; elements outside the tensor are not written. The shared memory must have been
// written before a fence_async_shared() (by every thread that wrote it) and a barrier.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, std::uint32_t source, int column, int row) {
#if KERNELS_SM90A_DEVICE
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
               ::"l"(reinterpret_cast<std::uint64_t>(map)), "r"(source), "r"(column), "r"(row)
               : "memory");
#endif
}

__device__ __forceinline__ void tma_store_commit() {
#if KERNELS_SM90A_DEVICE
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// Waits until at most kPending of the thread's bulk groups still read their shared memory (it may then be
// overwritten).
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
#if KERNELS_SM90A_DEVICE
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
#endif
}

// Waits until at most kPending of the thread's bulk groups are incomplete (their writes done).
template <int kPending>
__device__ __forceinline__ void tma_store_wait() {
#if KERNELS_SM90A_DEVICE
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

// Shared-memory accesses at shared-window addresses (smem_address's): one LDS or STS each, where an access through
// a generic pointer would take a generic LD or ST and its 64-bit address arithmetic.
__device__ __forceinline__ float4 load_shared_float4(std::uint32_t address) {
  float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#if KERNELS_SM90A_DEVICE
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(address));
#endif
  return v;
}

__device__ __forceinline__ float load_shared_float(std::uint32_t address) {
  float v = 0.0f;
#if KERNELS_SM90A_DEVICE
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(address));
#endif
  return v;
}

__device__ __forceinline__ float2 load_shared_float2(std::uint32_t address) {
  float2 v = make_float2(0.0f, 0.0f);
#if KERNELS_SM90A_DEVICE
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(address));
#endif
  return v;
}

__device__ __forceinline__ void store_shared_float(std::uint32_t address, float value) {
#if KERNELS_SM90A_DEVICE
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(address), "f"(value) : "memory");
#endif
}

__device__ __forceinline__ void store_shared_float4(std::uint32_t address, float4 v) {
#if KERNELS_SM90A_DEVICE
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(address), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
#endif
}

// Orders this thread's earlier shared-memory writes before later async-proxy (TMA) accesses.
__device__ __forceinline__ void fence_async_shared() {
#if KERNELS_SM90A_DEVICE
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// ---- wgmma ------------------------------------------------------------------------------------------------------

// Shared-memory matrix descriptor of a K-major tile whose rows are 128 bytes (64 fp16) in the 128-byte swizzle,
// rows grouped by 8 (1024 bytes apart). The tile must start 1024-byte aligned; a K offset within the row is added
// to the start address.
__device__ __forceinline__ std::uint64_t k_major_swizzle128_descriptor(std::uint32_t tile_address) {
  const std::uint64_t address = tile_address;
  return ((address & 0x3ffff) >> 4) | (std::uint64_t{1} << 16) | (std::uint64_t{1024 >> 4} << 32) |
         (std::uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#if KERNELS_SM90A_DEVICE
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if KERNELS_SM90A_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if KERNELS_SM90A_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
#endif
}

// The 64 accumulator registers of an m64n128 wgmma with fp32 accumulation: their place in the instruction (operands
// %0 .. %63) and their read-write operand constraints.
#define KERNELS_WGMMA_ACCUMULATOR_LIST                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                       \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                              \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                              \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define KERNELS_WGMMA_ACCUMULATORS(d)                                                                              \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),    \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),     \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),     \
      "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),     \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),     \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (64 x 128 per warpgroup, 64 floats per thread) = a (64 x 16, from registers) * b^T (b: 128 x 16, K-major in
// shared memory) + d, or without the "+ d" where accumulate is false. a holds this thread's fp16 pairs in wgmma's
// register layout: with g = lane / 4 and t = lane % 4 of warp w, a[0] = row 16 w + g, k = 2 t, 2 t + 1; a[1] = row
// + 8; a[2] = k + 8; a[3] = row + 8, k + 8. The registers must not change until the wgmma has completed.
__device__ __forceinline__ void wgmma_m64n128k16_f16_rs(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t b,
                                                        bool accumulate) {
#if KERNELS_SM90A_DEVICE
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      KERNELS_WGMMA_ACCUMULATOR_LIST ", "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
      "}\n"
      : KERNELS_WGMMA_ACCUMULATORS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
#endif
}

// d (+)= a b^T with both operands in shared memory (descriptors: k_major_swizzle128_descriptor), a 64 x 16, b 128 x 16.
__device__ __forceinline__ void wgmma_m64n128k16_f16_ss(float (&d)[64], std::uint64_t a, std::uint64_t b,
                                                        bool accumulate) {
#if KERNELS_SM90A_DEVICE
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      KERNELS_WGMMA_ACCUMULATOR_LIST ", "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : KERNELS_WGMMA_ACCUMULATORS(d)
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));
#endif
}

// d (64 x 64 per warpgroup: d[j][c] at row 16 w + g + 8 (c / 2), column 8 j + 2 t + c % 2) = a (64 x 16, from
// registers, wgmma_m64n128k16_f16_rs's layout) * b^T (b: 64 x 16, K-major in shared memory) + d, or without the
// "+ d" where accumulate is false; the m16n8 accumulator layout of mma.sync, n-fragment by n-fragment.
__device__ __forceinline__ void wgmma_m64n64k16_f16_rs(float (&d)[8][4], const std::uint32_t (&a)[4], std::uint64_t b,
                                                       bool accumulate) {
#if KERNELS_SM90A_DEVICE
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
#endif
}

// wgmma_m64n64k16_f16_rs's product over 16 columns of b (b: 16 x 16): d (64 x 16 per warpgroup, the same layout,
// n-fragments 0 and 1).
__device__ __forceinline__ void wgmma_m64n16k16_f16_rs(float (&d)[2][4], const std::uint32_t (&a)[4], std::uint64_t b,
                                                       bool accumulate) {
#if KERNELS_SM90A_DEVICE
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, "
      "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)));
#endif
}

// Warpgroup register reallocation: the producer gives registers back, the consumers take them.
template <int kRegisters>
__device__ __forceinline__ void registers_decrease() {
#if KERNELS_SM90A_DEVICE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
#endif
}

template <int kRegisters>
__device__ __forceinline__ void registers_increase() {
#if KERNELS_SM90A_DEVICE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
#endif
}

}  // namespace kernels::gemm::sm90
