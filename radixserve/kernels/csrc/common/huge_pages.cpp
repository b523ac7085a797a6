// Weight buffers on 2 MB pages (huge_pages.h says why).

#include "common/huge_pages.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <cstdint>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace radixserve {

at::Tensor empty_on_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  int64_t count = 1;
  for (const int64_t size : sizes) {
    TORCH_CHECK_VALUE(size >= 0, "sizes must not be negative");
    count *= size;
  }
  const size_t bytes = static_cast<size_t>(count) * c10::elementSize(dtype);
  constexpr size_t kHuge = size_t{2} << 20, kPage = 4096;
#ifdef __linux__
  if (bytes >= 2 * kHuge) {
    // Map 2 MB more than needed, keep the 2 MB-aligned stretch and give back the rest.
    const size_t length = (bytes + kPage - 1) / kPage * kPage;
    void* mapped = mmap(nullptr, length + kHuge, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped != MAP_FAILED) {
      const auto base = reinterpret_cast<uintptr_t>(mapped);
      const uintptr_t start = (base + kHuge - 1) / kHuge * kHuge;
      if (start > base) munmap(mapped, start - base);
      const uintptr_t end = start + length, mapped_end = base + length + kHuge;
      if (mapped_end > end) munmap(reinterpret_cast<void*>(end), mapped_end - end);
      void* data = reinterpret_cast<void*>(start);
      madvise(data, bytes / kHuge * kHuge, MADV_HUGEPAGE);  // fails harmlessly without THP
      return at::from_blob(data, sizes, [length](void* p) { munmap(p, length); }, options);
    }
  }
#endif
  return at::empty(sizes, options);
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("empty_on_huge_pages(int[] sizes, ScalarType dtype) -> Tensor",
        &radixserve::empty_on_huge_pages);
}
