// The CPU kernel of the op `paged_backend::codes_matmul` in C++ (cpu_int8_matmul.py defines the op and says when
// this is built): a checkpoint's 8-bit or fp8 codes times a step's rows. A compiled one-stream step of an 8-bit
// model calls it about 210 times; as a Python custom op each call cost 35-60 us more than the kernel itself
// (2 threads of an AMD EPYC), some 10 ms a step. Up to `kernel_rows` rows the C kernel multiplies the codes
// (cpu_int8_matmul.c's codes_matmul, whose address Python hands over: set_kernel); larger steps rebuild the
// fp32 weight and multiply by it, as the Python kernel does.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

using Kernel = int (*)(const void *x, int x_dtype, int rows, int64_t k, const uint8_t *codes, int kind,
                       const float *scales, const float *zeros, int64_t group, int64_t n, float *out, int threads);
Kernel kernel = nullptr;

// The C kernel's CODES_* kind of a codes dtype, or -1 where it takes no such codes.
int kind_of(at::ScalarType dtype) {
    switch (dtype) {
    case at::kChar: return 0;
    case at::kByte: return 1;
    case at::kFloat8_e4m3fn: return 2;
    default: return -1;
    }
}

at::Tensor rebuilt_matmul(const at::Tensor &rows, const at::Tensor &codes, const at::Tensor &scales,
                          const std::optional<at::Tensor> &zeros, int64_t group_size) {
    const int64_t k = codes.size(1);
    at::Tensor weight = codes.to(at::kFloat);
    if (zeros.has_value())
        weight = weight.sub(zeros->to(at::kFloat).repeat_interleave(group_size, 1).narrow(1, 0, k));
    weight = weight.mul(scales.to(at::kFloat).repeat_interleave(group_size, 1).narrow(1, 0, k));
    return at::linear(rows, weight.to(rows.scalar_type()));
}

at::Tensor codes_matmul(const at::Tensor &rows, const at::Tensor &codes, const at::Tensor &scales,
                        const std::optional<at::Tensor> &zeros, int64_t group_size, int64_t kernel_rows) {
    const int kind = kind_of(codes.scalar_type());
    const bool takes_rows = rows.dim() == 2 && rows.size(0) >= 1 && rows.size(0) <= kernel_rows &&
                            (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16);
    if (kernel == nullptr || kind < 0 || !takes_rows || !codes.is_contiguous())
        return rebuilt_matmul(rows, codes, scales, zeros, group_size);
    at::Tensor x = rows.contiguous();
    at::Tensor s = scales.to(at::kFloat).contiguous();
    std::optional<at::Tensor> z;
    if (zeros.has_value()) z = zeros->to(at::kFloat).contiguous();
    at::Tensor out = at::empty({x.size(0), codes.size(0)}, x.options().dtype(at::kFloat));
    int failed = kernel(x.data_ptr(), x.scalar_type() == at::kBFloat16, static_cast<int>(x.size(0)), x.size(1),
                        static_cast<const uint8_t *>(codes.data_ptr()), kind, s.data_ptr<float>(),
                        z.has_value() ? z->data_ptr<float>() : nullptr, group_size, codes.size(0),
                        out.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK(!failed, "the 8-bit codes kernel could not allocate its rows");
    return out.scalar_type() == rows.scalar_type() ? out : out.to(rows.scalar_type());
}

}  // namespace

extern "C" void set_kernel(void *address) { kernel = reinterpret_cast<Kernel>(address); }

TORCH_LIBRARY_IMPL(paged_backend, CPU, m) { m.impl("codes_matmul", codes_matmul); }
