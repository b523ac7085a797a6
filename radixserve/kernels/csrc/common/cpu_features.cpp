// The one CPU probe (cpu_features.h) and each family's paths, with the ops that tell Python
// their names.

#include "common/cpu_features.h"

#include <torch/library.h>

#include <stdexcept>
#include <utility>

#if defined(__x86_64__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace radixserve {
namespace {

// The AMX tile multiplies enabled for this process, as CPUID.7.0:EDX (bit 24 AMX-TILE, 25
// AMX-INT8, 22 AMX-BF16), or 0: the OS must enable their register state (XCR0 bits 17 and 18)
// and Linux hands the tile data's 8 KB of state to a process only once asked (arch_prctl
// ARCH_REQ_XCOMP_PERM), here on the probe.
unsigned amx_features() {
#if defined(__x86_64__) && defined(__linux__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx >> 27 & 1)) return 0u;  // OSXSAVE
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx >> 24 & 1)) return 0u;
  unsigned xcr0_low, xcr0_high;
  asm volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if ((xcr0_low >> 17 & 3) != 3) return 0u;  // XTILECFG, XTILEDATA
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0 ? edx : 0u;
#else
  return 0u;
#endif
}

CpuFeatures probe() {
  CpuFeatures f;
#if defined(__x86_64__)
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512vnni = __builtin_cpu_supports("avx512vnni");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
  const unsigned amx = amx_features();
  f.amx_int8 = amx >> 25 & 1;
  f.amx_bf16 = amx >> 22 & 1;
#endif
  return f;
}

struct Path {
  std::string name;
  bool (*runs_here)(const CpuFeatures&);
};

const std::vector<Path>& paths(Family family) {
  using F = const CpuFeatures&;
  static const std::vector<Path> attention{
      {"portable", [](F) { return true; }},
      {"avx2", [](F f) { return f.avx2 && f.fma; }},
      {"avx512", [](F f) { return f.avx512(); }},
      {"avx512-bf16", [](F f) { return f.avx512_bf16(); }},
      // Tiles of bfloat16 products (attention_amx.h).
      {"avx512-amx", [](F f) { return f.avx512_bf16() && f.amx_bf16; }}};
  static const std::vector<Path> gguf{
      {"portable", [](F) { return true; }},
      {"avx2", [](F f) { return f.avx2_fma_f16c(); }},
      // AVX-512 without VNNI runs the AVX2 path.
      {"avx512-vnni", [](F f) { return f.avx512_vnni(); }},
      // Tiles of int8 products for groups of 16 activation rows (gguf_matmul_amx.cpp).
      {"avx512-amx", [](F f) { return f.avx512_vnni() && f.amx_int8; }}};
  static const std::vector<Path> float_panels{
      {"portable", [](F) { return true; }},
      {"avx2", [](F f) { return f.avx2_fma_f16c(); }},
      {"avx512", [](F f) { return f.avx512f; }}};
  switch (family) {
    case Family::attention: return attention;
    case Family::gguf: return gguf;
    case Family::float_panels: return float_panels;
  }
  throw std::invalid_argument("unknown kernel family");
}

Family family_named(const std::string& name) {
  if (name == "attention") return Family::attention;
  if (name == "gguf") return Family::gguf;
  if (name == "float_panels") return Family::float_panels;
  TORCH_CHECK_VALUE(false, "no kernel family ", name, " (attention, gguf, float_panels)");
}

// A family's paths in max_path order (index 0 is portable C++ everywhere).
std::vector<std::string> kernel_path_names(const std::string& family) {
  std::vector<std::string> names;
  for (const Path& p : paths(family_named(family))) names.push_back(p.name);
  return names;
}

int64_t kernel_best_path(const std::string& family) { return best_path(family_named(family)); }

bool bf16_matmul_runs() { return cpu_features().avx512_bf16(); }

// The features the probe found, by their /proc/cpuinfo names (AMX only where usable).
std::vector<std::string> cpu_feature_names() {
  const CpuFeatures& f = cpu_features();
  const std::pair<const char*, bool> all[] = {
      {"avx2", f.avx2}, {"fma", f.fma}, {"f16c", f.f16c}, {"avx512f", f.avx512f},
      {"avx512dq", f.avx512dq}, {"avx512bw", f.avx512bw}, {"avx512vl", f.avx512vl},
      {"avx512_vnni", f.avx512vnni}, {"avx512_bf16", f.avx512bf16},
      {"amx_int8", f.amx_int8}, {"amx_bf16", f.amx_bf16}};
  std::vector<std::string> names;
  for (const auto& [name, here] : all)
    if (here) names.emplace_back(name);
  return names;
}

}  // namespace

const CpuFeatures& cpu_features() {
  // Probed once: in a virtual machine each CPUID is a trip to the hypervisor.
  static const CpuFeatures features = probe();
  return features;
}

int64_t best_path(Family family) {
  const std::vector<Path>& all = paths(family);
  for (int64_t i = static_cast<int64_t>(all.size()) - 1; i > 0; --i)
    if (all[i].runs_here(cpu_features())) return i;
  return 0;
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("kernel_path_names(str family) -> str[]", &radixserve::kernel_path_names);
  m.def("kernel_best_path(str family) -> int", &radixserve::kernel_best_path);
  m.def("cpu_feature_names() -> str[]", &radixserve::cpu_feature_names);
  m.def("bf16_matmul_runs() -> bool", &radixserve::bf16_matmul_runs);
}
