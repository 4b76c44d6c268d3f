// The Hopper GEMM's order of tiles (gemm_sm90.cu). Persistent CTAs, one per multiprocessor, take tiles in turn (the
// CTA takes tiles blockIdx.x, + gridDim.x, ...). Tiles go in groups of kGroupW tiles of w: within a group, w's tiles
// fastest, then x's, so that the CTAs running together (a wave, 132 on an H100) read a few tiles of w and about
// 132 / kGroupW tiles of x, each from L2 once it is there: where x's split is larger than L2 (8192 rows of 8192:
// 256 MB), a wave reads 16 of x's tiles instead of all of them.
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

constexpr int kGroupW = 8;

struct TileScheduler {
  int x_tiles, w_tiles, tiles;

  __device__ __forceinline__ TileScheduler(int m, int n)
      : x_tiles((m + kBlockX - 1) / kBlockX), w_tiles((n + kBlockW - 1) / kBlockW), tiles(x_tiles * w_tiles) {}
  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int next(int tile) const { return tile + gridDim.x; }
  __device__ __forceinline__ bool is_last(int tile) const { return tile + static_cast<int>(gridDim.x) >= tiles; }
  // Tile t: in group t / (kGroupW x_tiles), of w's tiles first_w .. first_w + width - 1 (the last group may be
  // narrower), w's tile first_w + local % width and x's tile local / width, local being t's place in the group.
  __device__ __forceinline__ int x_tile(int tile) const {
    const int group = tile / (kGroupW * x_tiles), first_w = group * kGroupW;
    const int width = min(kGroupW, w_tiles - first_w);
    return (tile - group * kGroupW * x_tiles) / width;
  }
  __device__ __forceinline__ int w_tile(int tile) const {
    const int group = tile / (kGroupW * x_tiles), first_w = group * kGroupW;
    const int width = min(kGroupW, w_tiles - first_w);
    return first_w + (tile - group * kGroupW * x_tiles) % width;
  }
};

}  // namespace
}  // namespace kernels::gemm
