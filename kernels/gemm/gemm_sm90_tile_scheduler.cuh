// The Hopper GEMM's order of work (gemm_sm90.cu). Persistent CTAs, one per multiprocessor. Where K is whole or split
// into equal slices, the CTAs take units blockIdx.x, + gridDim.x, ...; a unit is one output tile over one slice of K's
// chunks (all of K, or slice u / tiles of tile u % tiles: launch_split_gemm_split_k). Stream-K (kStreamK): the tiles'
// chunks, tile after tile, are cut into gridDim.x equal shares, one a CTA, so that no multiprocessor waits out a
// partial last round; a unit is then the part of one tile within the CTA's share, named by its first chunk in that
// order, and its slice is its place among the tile's parts (the CTAs sharing the tile, in order). Tiles go in groups of
// kGroupW tiles of w, w's fastest, so a wave of CTAs reads few tiles of w and x from L2 even where x's split exceeds
// L2. Producer and consumers walk the same units and the stages run on across them, so the next unit's loads overlap
// the last one's stores.
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

// Tile t: in group t / (kGroupW x_tiles), of w's tiles first_w .. first_w + width - 1 (the last group may be narrower),
// w's tile first_w + local % width and x's tile local / width, local being t's place in the group; tile_of inverts it.
__host__ __device__ __forceinline__ int tile_x_of(int tile, int x_tiles, int w_tiles) {
  const int group = tile / (kGroupW * x_tiles), first_w = group * kGroupW;
  const int width = w_tiles - first_w < kGroupW ? w_tiles - first_w : kGroupW;
  return (tile - group * kGroupW * x_tiles) / width;
}
__host__ __device__ __forceinline__ int tile_w_of(int tile, int x_tiles, int w_tiles) {
  const int group = tile / (kGroupW * x_tiles), first_w = group * kGroupW;
  const int width = w_tiles - first_w < kGroupW ? w_tiles - first_w : kGroupW;
  return first_w + (tile - group * kGroupW * x_tiles) % width;
}
__host__ __device__ __forceinline__ int tile_of(int tile_x, int tile_w, int x_tiles, int w_tiles) {
  const int group = tile_w / kGroupW, first_w = group * kGroupW;
  const int width = w_tiles - first_w < kGroupW ? w_tiles - first_w : kGroupW;
  return group * kGroupW * x_tiles + tile_x * width + (tile_w - first_w);
}

// Stream-K (launch_split_gemm_split_k with kStreamK) for an output of `tiles` tiles over `chunks` chunks of K on
// `ctas` CTAs: the first whole rounds' tiles (dp_tiles) whole, round robin, as where K is whole; then the other
// tail_tiles tiles, split along K in two blocks so that CTAs running at once read the same chunks (their operand
// tiles then come from L2): chunks [0, head) of tail tile j as CTA j's one part, and their chunks [head, chunks), tile
// after tile, in equal shares by the other ctas - tail_tiles CTAs. head is the equal share of the tail tiles' work.
// The order of the tail tiles' work: block 0 (tail_tiles x head chunks), then block 1; share_begin(c) is where CTA c's
// share of it starts. fits(): every CTA holds at least a chunk of it, and every index is an int.
struct StreamK {
  int tiles, chunks, ctas, dp_tiles, tail_tiles, head;

  __host__ __device__ __forceinline__ StreamK(int tiles, int chunks, int ctas)
      : tiles(tiles),
        chunks(chunks),
        ctas(ctas),
        dp_tiles(tiles / ctas * ctas),
        tail_tiles(tiles % ctas),
        head(static_cast<int>(static_cast<std::int64_t>(tiles % ctas) * chunks / ctas)) {}
  __host__ __device__ __forceinline__ int rest_chunks() const { return chunks - head; }  // a tail tile's block 1
  __host__ __device__ __forceinline__ std::int64_t rest() const {
    return static_cast<std::int64_t>(tail_tiles) * rest_chunks();
  }
  __host__ __device__ __forceinline__ int rest_ctas() const { return ctas - tail_tiles; }
  __host__ __device__ __forceinline__ bool fits() const {
    return tail_tiles > 0 && head >= 1 && rest_chunks() >= 1 && rest() >= rest_ctas() &&
           static_cast<std::int64_t>(tiles) * chunks < (std::int64_t{1} << 31) - chunks;
  }
  __host__ __device__ __forceinline__ std::int64_t share_begin(int c) const {
    return c <= tail_tiles ? static_cast<std::int64_t>(c) * head
                           : static_cast<std::int64_t>(tail_tiles) * head + (c - tail_tiles) * rest() / rest_ctas();
  }
  // The CTA among block 1's whose share holds block 1's chunk i (counted from block 1's start).
  __host__ __device__ __forceinline__ int rest_share_of(std::int64_t i) const {
    return static_cast<int>(((i + 1) * rest_ctas() - 1) / rest());
  }
  // Tile t's parts, each a partial in the workspace: 1 for a whole tile; a tail tile's block-0 part and the block-1
  // shares its chunks [head, chunks) span.
  __host__ __device__ __forceinline__ int parts(int tile) const {
    if (tile < dp_tiles) return 1;
    const std::int64_t first = static_cast<std::int64_t>(tile - dp_tiles) * rest_chunks();
    return 2 + rest_share_of(first + rest_chunks() - 1) - rest_share_of(first);
  }
};

struct TileScheduler {
  int x_tiles, w_tiles, tiles;
  int chunks;        // K's chunks
  int slice_chunks;  // a slice's chunks (the last may hold fewer): chunks where K is not split; unused by stream-K
  bool stream;       // stream-K (launch_split_gemm_split_k with kStreamK)
  StreamK streamk;   // its work, where stream
  // The units' end: tiles times the slices; with stream-K, the end of this CTA's share, where a unit is a whole tile
  // (< dp_tiles) or dp_tiles plus its first chunk in the tail tiles' order.
  int units;

  __device__ __forceinline__ TileScheduler(int m, int n, int chunks, int slices, int slice_chunks, bool stream)
      : x_tiles((m + kBlockX - 1) / kBlockX),
        w_tiles((n + kBlockW - 1) / kBlockW),
        tiles(x_tiles * w_tiles),
        chunks(chunks),
        slice_chunks(slice_chunks),
        stream(stream),
        streamk(tiles, chunks, static_cast<int>(gridDim.x)),
        units(stream ? streamk.dp_tiles + static_cast<int>(streamk.share_begin(blockIdx.x + 1)) : tiles * slices) {}
  __device__ __forceinline__ int first() const {
    return !stream || streamk.dp_tiles > 0 ? static_cast<int>(blockIdx.x)
                                           : static_cast<int>(streamk.share_begin(blockIdx.x));
  }
  __device__ __forceinline__ int next(int unit) const {
    if (!stream) return unit + static_cast<int>(gridDim.x);
    if (unit < streamk.dp_tiles)
      return unit + static_cast<int>(gridDim.x) < streamk.dp_tiles
                 ? unit + static_cast<int>(gridDim.x)
                 : streamk.dp_tiles + static_cast<int>(streamk.share_begin(blockIdx.x));
    const int g = unit - streamk.dp_tiles, block0 = streamk.tail_tiles * streamk.head, rest = streamk.rest_chunks();
    return streamk.dp_tiles +
           (g < block0 ? (g / streamk.head + 1) * streamk.head : block0 + ((g - block0) / rest + 1) * rest);
  }
  __device__ __forceinline__ bool is_last(int unit) const { return next(unit) >= units; }
  __device__ __forceinline__ int tile(int unit) const {
    if (!stream) return unit - slice(unit) * tiles;
    if (unit < streamk.dp_tiles) return unit;
    const int g = unit - streamk.dp_tiles, block0 = streamk.tail_tiles * streamk.head;
    return streamk.dp_tiles + (g < block0 ? g / streamk.head : (g - block0) / streamk.rest_chunks());
  }
  // The unit's slice: where its partial goes among the tile's (stream-K: 0 for a whole tile and a block-0 part; a
  // block-1 part's place after it).
  __device__ __forceinline__ int slice(int unit) const {
    if (!stream) return unit / tiles;
    const int g = unit - streamk.dp_tiles, block0 = streamk.tail_tiles * streamk.head;
    if (unit < streamk.dp_tiles || g < block0) return 0;
    const std::int64_t tile_first = static_cast<std::int64_t>((g - block0) / streamk.rest_chunks()) *
                                    streamk.rest_chunks();
    return 1 + static_cast<int>(blockIdx.x) - streamk.tail_tiles - streamk.rest_share_of(tile_first);
  }
  // The unit's first chunk along K, and how many it takes.
  __device__ __forceinline__ int first_chunk(int unit) const {
    if (!stream) return slice(unit) * slice_chunks;
    if (unit < streamk.dp_tiles) return 0;
    const int g = unit - streamk.dp_tiles, block0 = streamk.tail_tiles * streamk.head;
    return g < block0 ? g % streamk.head : streamk.head + (g - block0) % streamk.rest_chunks();
  }
  __device__ __forceinline__ int unit_chunks(int unit) const {
    if (!stream) return min(slice_chunks, chunks - first_chunk(unit));
    return unit < streamk.dp_tiles ? chunks : min(units, next(unit)) - unit;
  }
  __device__ __forceinline__ int x_tile(int tile) const { return tile_x_of(tile, x_tiles, w_tiles); }
  __device__ __forceinline__ int w_tile(int tile) const { return tile_w_of(tile, x_tiles, w_tiles); }
};

}  // namespace
}  // namespace kernels::gemm
