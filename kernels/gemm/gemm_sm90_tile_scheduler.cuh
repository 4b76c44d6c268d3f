// The Hopper GEMM's order of tiles (gemm_sm90.cu). Persistent CTAs, one per multiprocessor, take tiles in turn (the
// CTA takes tiles blockIdx.x, + gridDim.x, ...), x's tiles fastest, so those running together share a w tile in L2.
// The producer and the consumers walk the same tiles, and the stages and their phases run on across tiles
// (gemm_sm90_mainloop.cuh), so the producer loads a tile's first chunks while the consumers write the last one's
// outputs.
#pragma once

#include "gemm_sm90_layout.cuh"

#include <cstdint>

namespace kernels::gemm {
namespace {

// The tiles of an (m x n) output; the grid is one CTA per multiprocessor, or one per tile where there are fewer.
std::int64_t tile_count(std::int64_t m, std::int64_t n) {
  return ((m + kBlockX - 1) / kBlockX) * ((n + kBlockW - 1) / kBlockW);
}

struct TileScheduler {
  int x_tiles, tiles;  // tile t is x's tile t % x_tiles and w's tile t / x_tiles

  __device__ __forceinline__ TileScheduler(int m, int n)
      : x_tiles((m + kBlockX - 1) / kBlockX), tiles(x_tiles * ((n + kBlockW - 1) / kBlockW)) {}
  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int next(int tile) const { return tile + gridDim.x; }
  __device__ __forceinline__ bool is_last(int tile) const { return tile + static_cast<int>(gridDim.x) >= tiles; }
  __device__ __forceinline__ int x_tile(int tile) const { return tile % x_tiles; }
  __device__ __forceinline__ int w_tile(int tile) const { return tile / x_tiles; }
};

}  // namespace
}  // namespace kernels::gemm
