// pack_weights: the model's weights in one buffer on huge pages.
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>

#include "kernels.h"

// A decode step streams every weight once; on 4 KB pages that is a TLB miss (a page walk) every 4 KB of each
// thread's stream, and torch's allocator does not ask for huge pages. pack_weights copies a model's weights, in
// the order a forward pass reads them, into one buffer on 2 MB pages where the kernel allows it (transparent huge
// pages in "madvise" mode, the usual default); the batch-1 step gets shorter (BENCHMARKS.md, "The kernels'
// design measurements").
std::vector<Tensor> pack_weights(const std::vector<Tensor>& tensors) {
  constexpr size_t kLine = 64, kHugePage = 2 << 20;
  std::vector<size_t> offsets;
  size_t total = 0;
  for (const Tensor& t : tensors) {
    TORCH_CHECK(t.is_cpu(), "pack_weights: CPU tensors only");
    offsets.push_back(total);
    total += (t.nbytes() + kLine - 1) / kLine * kLine;
  }
  const size_t allocated = std::max(kHugePage, (total + kHugePage - 1) / kHugePage * kHugePage);
  void* memory = nullptr;
  TORCH_CHECK(posix_memalign(&memory, kHugePage, allocated) == 0, "pack_weights: cannot allocate ", allocated,
              " bytes");
  madvise(memory, allocated, MADV_HUGEPAGE);  // a hint: where the kernel declines it, 4 KB pages serve
  const Tensor buffer = at::from_blob(
      memory, {static_cast<int64_t>(allocated)},
      [](void* data) { free(data); },
      at::TensorOptions().dtype(at::kByte));
  std::vector<Tensor> views;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    Tensor view = buffer.narrow(0, static_cast<int64_t>(offsets[i]), static_cast<int64_t>(t.nbytes()))
                      .view(t.scalar_type())
                      .view(t.sizes());
    view.copy_(t);
    views.push_back(view);
  }
  return views;
}
