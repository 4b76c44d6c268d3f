// The Hopper GEMM's order of work (gemm_sm90.cu). Persistent CTAs, one per multiprocessor, take units of work in turn
// (the CTA takes units blockIdx.x, + gridDim.x, ...). A unit is one output tile's product over one slice of K's
// chunks: all of K (one slice, every product but split-K's), or, where K is split (gemm.h,
// launch_split_gemm_split_k), slice s's chunks s * slice_chunks .. (s + 1) * slice_chunks - 1, unit u being slice
// u / tiles of tile u % tiles. Tiles go in groups of kGroupW tiles of w: within a group, w's tiles fastest, then x's,
// so that the CTAs running together (a wave, 132 on an H100) read a few tiles of w and about 132 / kGroupW tiles of
// x, each from L2 once it is there: where x's split is larger than L2 (8192 rows of 8192: 256 MB), a wave reads 16 of
// x's tiles instead of all of them.
// The producer and the consumers walk the same units, and the stages and their phases run on across units
// (gemm_sm90_mainloop.cuh), so the producer loads a unit's first chunks while the consumers write the last one's
// outputs.
#pragma once

#include "gemm_sm90_layout.cuh"

#include <cstdint>

namespace kernels::gemm {
namespace {

// The tiles of an (m x n) output; the grid is one CTA per multiprocessor, or one per unit where there are fewer.
std::int64_t tile_count(std::int64_t m, std::int64_t n) {
  return ((m + kBlockX - 1) / kBlockX) * ((n + kBlockW - 1) / kBlockW);
}

constexpr int kGroupW = 8;

struct TileScheduler {
  int x_tiles, w_tiles, tiles;
  int chunks;        // K's chunks
  int slice_chunks;  // a slice's chunks (the last slice's may be fewer): chunks where K is not split
  int units;         // tiles times the slices

  __device__ __forceinline__ TileScheduler(int m, int n, int chunks, int slices, int slice_chunks)
      : x_tiles((m + kBlockX - 1) / kBlockX),
        w_tiles((n + kBlockW - 1) / kBlockW),
        tiles(x_tiles * w_tiles),
        chunks(chunks),
        slice_chunks(slice_chunks),
        units(tiles * slices) {}
  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int next(int unit) const { return unit + gridDim.x; }
  __device__ __forceinline__ bool is_last(int unit) const { return unit + static_cast<int>(gridDim.x) >= units; }
  __device__ __forceinline__ int slice(int unit) const { return unit / tiles; }
  __device__ __forceinline__ int tile(int unit) const { return unit - slice(unit) * tiles; }
  // The unit's first chunk along K, and how many it takes.
  __device__ __forceinline__ int first_chunk(int unit) const { return slice(unit) * slice_chunks; }
  __device__ __forceinline__ int unit_chunks(int unit) const { return min(slice_chunks, chunks - first_chunk(unit)); }
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
