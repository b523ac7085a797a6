// The C library functions that GCC may call from the kernels in the emulated image (copies and
// fills), in a file of their own: compiled beside the kernels, GCC would see these byte loops
// and call them where the shipped library has one load, so the tested code would differ.

#include <cstddef>

extern "C" {

// The attribute keeps GCC from compiling the loops back into calls to themselves.
#define RS_PLAIN_LOOP __attribute__((optimize("no-tree-loop-distribute-patterns")))

RS_PLAIN_LOOP void* memcpy(void* to, const void* from, size_t n) {
  auto* d = static_cast<unsigned char*>(to);
  const auto* s = static_cast<const unsigned char*>(from);
  for (size_t i = 0; i < n; ++i) d[i] = s[i];
  return to;
}

RS_PLAIN_LOOP void* memmove(void* to, const void* from, size_t n) {
  auto* d = static_cast<unsigned char*>(to);
  const auto* s = static_cast<const unsigned char*>(from);
  if (d < s)
    for (size_t i = 0; i < n; ++i) d[i] = s[i];
  else
    for (size_t i = n; i > 0; --i) d[i - 1] = s[i - 1];
  return to;
}

RS_PLAIN_LOOP void* memset(void* to, int value, size_t n) {
  auto* d = static_cast<unsigned char*>(to);
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<unsigned char>(value);
  return to;
}

}  // extern "C"
