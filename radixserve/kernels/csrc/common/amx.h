// What the AMX paths share (the quantized matmul's int8 tiles, attention's bfloat16 tiles):
// the tile configuration and the tile instructions as asm that declares the memory it touches.

#pragma once

#include <cstdint>

#include "common/vector.h"

#ifdef RS_X86
namespace radixserve::amx {

// ldtilecfg's 64 bytes: palette 1, then each tile's bytes per row and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 0, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// `Bytes` bytes of memory, the operand by which a tile load or store declares what it touches.
template <int Bytes>
struct Span {
  unsigned char bytes[Bytes];
};

}  // namespace radixserve::amx

// GCC's AMX intrinsics are asm statements that declare no memory access (ldtilecfg's one
// pointer-sized word), so the compiler may drop or move the stores a tile load reads and the
// loads after a tile store (a known crash of llama.cpp's AMX path). These declare it, and a
// configuration lives in static storage, never on the stack. Tiles are named by number, as
// asm needs; strides are in bytes.
#define RS_TILE_CONFIG(config) asm volatile("ldtilecfg %0" ::"m"(config) : "memory")
#define RS_TILE_RELEASE() asm volatile("tilerelease" ::: "memory")
#define RS_TILE_LOAD(T, p, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"(p), "r"(int64_t{stride}) : "memory")
#define RS_TILE_STORE(T, p, stride) \
  asm volatile("tilestored %%tmm" #T ", (%0,%1,1)" ::"r"(p), "r"(int64_t{stride}) : "memory")
// The same, declaring the `bytes` bytes from p that a tile load reads or a tile store writes
// in place of a clobber of all memory, so that the compiler may keep values in registers
// across them: a loop that holds 16 vectors of sums beside its tile multiplies (the Q8_0
// matmul) would otherwise store and reload them at every tile instruction.
#define RS_TILE_LOAD_SPAN(T, p, stride, bytes)                                           \
  asm volatile("tileloadd (%1,%2,1), %%tmm" #T ::"m"(                                    \
                   *reinterpret_cast<const radixserve::amx::Span<bytes>*>(p)),           \
               "r"(p), "r"(int64_t{stride}))
#define RS_TILE_STORE_SPAN(T, p, stride, bytes)                                          \
  asm volatile("tilestored %%tmm" #T ", (%1,%2,1)"                                      \
               : "=m"(*reinterpret_cast<radixserve::amx::Span<bytes>*>(p))               \
               : "r"(p), "r"(int64_t{stride}))
#define RS_TILE_ZERO(T) asm volatile("tilezero %%tmm" #T ::)
#define RS_TILE_DP(OP, C, A, B) asm volatile(OP " %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::)
#endif
