// The Hopper GEMM's order of work (gemm_sm90.cu). Persistent CTAs, one per multiprocessor, take units blockIdx.x, +
// gridDim.x, ...; a unit is one output tile over one slice of K's chunks (all of K, or slice u / tiles of tile u %
// tiles under split-K: launch_split_gemm_split_k). Tiles go in groups of kGroupW tiles of w, w's fastest, so a wave of
// CTAs reads few tiles of w and x from L2 even where x's split exceeds L2. Producer and consumers walk the same units
// and the stages run on across them, so the next unit's loads overlap the last one's stores.
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
