// Weight buffers on 2 MB pages.
//
// A decode step streams every weight once, and on 4 KB pages that stream walks the page tables
// every 4 KB, so the same loop reads faster from 2 MB pages (tests/test_gguf_kernels.py checks
// the pages; benchmarks/bench_quant_matmul.py measures the stream). Linux gives 2 MB pages to memory
// marked MADV_HUGEPAGE before its first touch where transparent huge pages are "madvise" (the
// common default); where they are "always" it would anyway, and where "never" or off Linux the
// buffer is ordinary memory.

#pragma once

#include <ATen/core/Tensor.h>

namespace radixserve {

// An uninitialised CPU tensor whose whole 2 MB-aligned stretches are marked for huge pages
// (its tail, past the last whole 2 MB, stays on 4 KB pages, so no page is wasted); below
// 4 MB, or off Linux, at::empty's.
at::Tensor empty_on_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype);

}  // namespace radixserve
