// The CPU kernel of the op `paged_backend::int4_matmul` in C++ (cpu_int4_matmul.py defines the op and says
// when this is built). A compiled step calls the op once per int4 projection, about 120 times a one-row step
// of the default model; with a Python kernel each call went from the dispatcher back into Python (the output's
// allocation, the pointers, a ctypes call), about 13 us against 7 here, most of a millisecond a step. The
// multiplication itself is the C kernel's (cpu_int4_matmul.c): this library gets its address from Python
// (set_kernel) rather than linking it, so the one library the C kernel builds to serves both.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

namespace {

using Kernel = int (*)(const uint16_t *rows, int64_t count, int64_t k, const uint8_t *codes, const uint16_t *scales,
                       const uint16_t *zeros, int64_t n, uint16_t *out, int threads);
Kernel kernel = nullptr;

at::Tensor int4_matmul(const at::Tensor &rows, const at::Tensor &codes, const at::Tensor &scales,
                       const at::Tensor &zeros) {
    TORCH_CHECK(kernel != nullptr, "paged_backend::int4_matmul: the C kernel's address was not set");
    TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kBFloat16, "int4_matmul takes bf16 rows [n, in]");
    at::Tensor x = rows.contiguous();
    // codes [tiles, in / 2, rows per tile]
    at::Tensor out = at::empty({x.size(0), codes.size(0) * codes.size(2)}, x.options());
    int failed = kernel(static_cast<const uint16_t *>(x.data_ptr()), x.size(0), x.size(1),
                        static_cast<const uint8_t *>(codes.data_ptr()), static_cast<const uint16_t *>(scales.data_ptr()),
                        static_cast<const uint16_t *>(zeros.data_ptr()), out.size(1),
                        static_cast<uint16_t *>(out.data_ptr()), at::get_num_threads());
    TORCH_CHECK(!failed, "the int4 matmul kernel could not allocate its panel");
    return out;
}

}  // namespace

extern "C" void set_kernel(void *address) { kernel = reinterpret_cast<Kernel>(address); }

TORCH_LIBRARY_IMPL(paged_backend, CPU, m) { m.impl("int4_matmul", int4_matmul); }
