"""quantization="int4": Int4Linear's two paths (the int4 kernel, the dense copy) compute the same
weights, the engine equals HF generate on the same int4 model, eagerly and compiled, and the default
model's Q4_1 tensors load from its GGUF file exactly as transformers dequantizes them."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.engine import hf_greedy, mixed_prompts, one_thread  # noqa: F401
from helpers.models import build

from paged_backend import LLM, SamplingParams
from paged_backend.kernels import cpu_int4_matmul, cpu_int8_matmul
from paged_backend.model.quantized import int4_linear, int8_linear
from paged_backend.model.quantized.int4_linear import (
    DENSE_ROWS,
    GROUP_SIZE,
    KERNEL_DENSE_ROWS,
    Int4Linear,
    has_int4_layers,
)
from paged_backend.model.quantized.int8_linear import Int8Linear
from paged_backend.model.quantized.quantization import quantize_weights, resolve_method

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def random_linear(out_features: int = 48, in_features: int = 64, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=bias)


def dense_rows(dtype: torch.dtype) -> int:
    """Where this machine's int4 layers of a `dtype` model switch to their dense copy."""
    return (KERNEL_DENSE_ROWS if cpu_int4_matmul.library() is not None else DENSE_ROWS)[dtype]


FP32_DENSE_ROWS = dense_rows(torch.float32)  # where an fp32 model's int4 layers switch to their dense copy


def threshold_rows(most: int) -> list[int]:
    return [1, 3, most, most + 1, 2 * most + 6]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("step", range(5))
def test_both_paths_multiply_by_the_dequantized_weight(dtype: torch.dtype, step: int) -> None:
    """The kernel takes rows rounded to bf16; the dense copy is in the model's dtype, so an fp32 model's
    large steps multiply its rows as they are, in fp32."""
    rows = threshold_rows(dense_rows(dtype))[step]
    linear = random_linear().to(dtype)
    layer = Int4Linear.from_float(linear)
    assert layer.dense.dtype == dtype and layer.dense_rows == dense_rows(dtype)
    x = torch.randn(1, rows, 64, dtype=dtype)
    kernel = rows <= dense_rows(dtype)
    assert layer.uses_dense(x.view(-1, 64)) != kernel
    exact_rows = x.bfloat16() if kernel or dtype == torch.bfloat16 else x
    expected = F.linear(exact_rows.double(), layer.weight_float().double(), linear.bias.double())
    out = layer(x)
    assert out.shape == (1, rows, 48) and out.dtype == x.dtype
    tolerance = 1e-5 if dtype == torch.float32 and not kernel else 2e-2
    assert torch.allclose(out.double(), expected, rtol=0, atol=tolerance * expected.abs().max().item())


def test_rounding_keeps_each_group_within_half_a_step() -> None:
    linear = random_linear(bias=False)
    weight = linear.weight.detach()
    layer = Int4Linear.from_float(linear)
    groups = weight.view(48, -1, GROUP_SIZE)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (layer.weight_float() - weight).abs().view_as(groups)
    # Half a step from rounding, plus the bf16 storage of scale, zero and the dense copy.
    assert (error <= step[..., None] * 0.5 + 2e-2 * weight.abs().max()).all()


def test_codes_come_back_exactly_where_bf16_holds_them() -> None:
    codes = torch.randint(0, 16, (32, 64))
    scales = torch.full((32, 2), 0.125)
    offsets = torch.full((32, 2), -1.0)
    layer = Int4Linear(codes, scales, offsets)
    assert torch.equal(layer.weight_float(), codes.float() * 0.125 - 1.0)
    x = torch.randn(1, 64).bfloat16()
    small = layer(x.float())  # the int4 kernel
    if layer.tiles is not None and cpu_int4_matmul.row_levels():
        # The AVX2 build rounds the row to integers: its own arithmetic, not the bf16 row's.
        scale_and_zero = (scales.bfloat16(), (offsets + 8 * scales).bfloat16())
        dense = cpu_int4_matmul.reference(x, codes, *scale_and_zero, cpu_int4_matmul.row_levels()).float()
    else:
        dense = F.linear(x.float(), codes.float() * 0.125 - 1.0)
    assert torch.allclose(small, dense, atol=1e-2 * dense.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("step", range(5))
def test_int8_head_paths_multiply_by_the_dequantized_weight(dtype: torch.dtype, step: int) -> None:
    rows = threshold_rows(int8_linear.DENSE_ROWS[dtype])[step]
    linear = random_linear(out_features=80, in_features=48).to(dtype)
    head = Int8Linear.from_float(linear)
    assert head.dense.dtype == dtype
    weight = linear.weight.detach().float()
    assert (head.weight_float() - weight).abs().max() <= weight.abs().amax() / 127  # half a step + bf16 scale
    x = torch.randn(rows, 48, dtype=dtype)
    kernel = rows <= int8_linear.DENSE_ROWS[dtype]
    exact_rows = x.bfloat16() if kernel or dtype == torch.bfloat16 else x
    expected = F.linear(exact_rows.double(), head.weight_float().double(), linear.bias.double())
    out = head(x)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 and not kernel else 1e-2
    assert torch.allclose(out.double(), expected, rtol=0, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("through", ["compiled kernel", "torch's kernel"])
def test_an_fp32_int8_head_picks_the_dense_paths_largest_logit_at_near_ties(through: str) -> None:
    """torch's kernel rounds rows and logits to bf16 (steps of 0.125 near 25), which flips greedy choices between
    logits closer than that; the outputs that may be a row's largest are recomputed in fp32, so the row's
    argmax is the fp32 dense path's. The compiled kernel sums the fp32 rows as given and needs no such pass."""
    torch.manual_seed(0)
    linear = random_linear(out_features=64, in_features=64, bias=False)
    with torch.no_grad():
        linear.weight[1::2] = linear.weight[::2] + 1e-3 * torch.randn(32, 64)  # pairs of near-equal rows
    head = Int8Linear.from_float(linear)
    x = 8 * torch.randn(400, 64)  # logits of tens, where bf16 steps are 0.125-0.25
    exact = F.linear(x, head.dense)
    kernel = torch._weight_int8pack_mm(x.bfloat16(), head.codes, head.scales).float()
    assert (kernel.argmax(-1) != exact.argmax(-1)).sum() > 10  # the coin tosses this guards against
    assert (kernel - exact).abs().le(int8_linear.error_bound(x, kernel, head.row_norms) / 2).all()
    path = cpu_int8_matmul.switched_off if through == "torch's kernel" else contextlib.nullcontext
    for rows in torch.split(x, int8_linear.DENSE_ROWS[torch.float32]):  # steps the kernel takes
        with path():
            out = head(rows)
        assert torch.equal(out.argmax(-1), F.linear(rows, head.dense).argmax(-1))
        largest = out.argmax(-1, keepdim=True)
        assert torch.allclose(out.gather(-1, largest), F.linear(rows, head.dense).gather(-1, largest), atol=1e-4)


@pytest.mark.slow  # compiles: the slow tier
def test_a_compiled_int8_head_picks_its_kernel_at_run_time() -> None:
    """Compiled, the head calls one op that takes the int8 kernel for a few rows and the copy past them,
    in one graph: the same numbers as eager on both sides of the crossover, and no recompile."""
    torch._dynamo.reset()
    head = Int8Linear.from_float(random_linear(out_features=80, in_features=48))
    most = head.dense_rows
    for rows in (1, most + 1):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, 48, dtype=dtype)
            torch.library.opcheck(int8_linear.int8_matmul_op, (x, head.codes, head.scales, head.dense, head.row_norms))
    compiled = torch.compile(head, dynamic=True)
    compiled(torch.randn(1, 48)), compiled(torch.randn(2, 48))  # one row is a shape class of its own
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (1, 3, most, most + 1, most + 8):
            x = torch.randn(rows, 48)
            assert torch.equal(compiled(x), head(x))


def test_tied_embedding_keeps_its_weight_when_the_head_becomes_int8() -> None:
    model = build("llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as the default model's are
    before = model.model.embed_tokens.weight.detach().clone()
    quantize_weights(model, "int4")
    assert isinstance(model.lm_head, Int8Linear)
    assert torch.equal(model.model.embed_tokens.weight, before)


def test_shapes_the_kernel_cannot_take_are_refused_or_left_alone() -> None:
    with pytest.raises(ValueError, match="out_features % 16"):
        Int4Linear(torch.zeros(8, 32, dtype=torch.long), torch.ones(8, 1), torch.zeros(8, 1))
    model = build("llama")
    quantize_weights(model, "int4")
    assert isinstance(model.model.layers[0].mlp.up_proj, Int4Linear)
    assert isinstance(model.lm_head, Int8Linear)  # the output projection: int8 per row
    with pytest.raises(ValueError, match="already quantized"):
        quantize_weights(model, "int4")


def test_the_engine_runs_an_int4_model_as_generate_does() -> None:
    model = build("llama")
    quantize_weights(model, "int4")
    prompts = mixed_prompts(6) + [list(range(3, 3 + FP32_DENSE_ROWS + 9))]  # one prompt past the dense threshold
    refs = [hf_greedy(model, p, 10) for p in prompts]
    llm = LLM(model, compile=False, num_kv_blocks=64, max_num_batched_tokens=24)  # chunked prefill
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_llm_int4_quantizes_in_place_close_to_the_float_weights() -> None:
    model = build("llama")
    ids = torch.tensor([mixed_prompts(1, seed=3)[0]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits.flatten()
    llm = LLM(model, quantization="int4", compile=False, num_kv_blocks=64)
    assert llm.model is model and isinstance(model.model.layers[1].self_attn.o_proj, Int4Linear)
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        after = model(input_ids=ids).logits.flatten()
    # A random model amplifies 4-bit rounding (measured cosine 0.91); unrelated logits would be near 0.
    assert F.cosine_similarity(before, after, dim=0) > 0.8


def test_int4_compiles_once_for_small_and_large_steps() -> None:
    """Prompts the kernel takes and one past the dense threshold run without a recompile, and the compiled
    model gives the prompts' log-probabilities eager HF gives. Not greedy text: the kernel's rows are rounded
    (to bf16, or per group on AVX2), so an fp32 ulp of difference in a fused norm can move a row by a rounding
    step, and a random model's greedy answers part at its near-ties. Nor to the last few hundredths: a step
    past the kernel's rows (the engine's batched prefill) multiplies the rows unrounded, where HF's own
    per-prompt forward takes the kernel; this random model amplifies that rounding to up to 0.06 (measured,
    with either rounding)."""
    torch._dynamo.reset()
    model = build("llama")
    quantize_weights(model, "int4")
    prompts = mixed_prompts(4) + [list(range(5, 5 + FP32_DENSE_ROWS + 12))]
    with torch.no_grad():
        expected = [model(input_ids=torch.tensor([p])).logits[0, :-1].log_softmax(-1).gather(
            -1, torch.tensor(p[1:])[:, None])[:, 0].tolist() for p in prompts]
    llm = LLM(model, compile=True, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.runner.forward_model.eager_steps == 0, "a step fitted no compiled graph and ran eagerly"
    for prompt, out, reference in zip(prompts, outs, expected):
        got = [entry[token].logprob for token, entry in zip(prompt[1:], out.prompt_logprobs[1:])]
        assert got == pytest.approx(reference, rel=1e-2, abs=5e-2)  # unrelated logits would be far off
        assert len(out.outputs[0].token_ids) == 8


def test_auto_means_int4_for_the_default_model_on_cpu_unless_fp32_is_named() -> None:
    cpu, bf16, fp32 = torch.device("cpu"), torch.bfloat16, torch.float32
    assert resolve_method("auto", True, cpu, bf16, single_process=True) == "int4"
    assert resolve_method("auto", True, cpu, bf16, single_process=True, dtype_named=True) == "int4"
    assert resolve_method("auto", True, cpu, fp32, single_process=True) == "int4"  # picked: no native bf16
    assert resolve_method("auto", True, cpu, fp32, single_process=True, dtype_named=True) is None  # exact fp32 asked
    assert resolve_method("auto", True, cpu, torch.float16, single_process=True) is None
    assert resolve_method("auto", False, cpu, bf16, single_process=True) is None  # a model the caller chose
    assert resolve_method("auto", True, torch.device("cuda"), bf16, single_process=True) is None
    assert resolve_method("auto", True, cpu, bf16, single_process=False) is None  # tensor parallelism
    assert resolve_method(None, True, cpu, bf16, single_process=True) is None
    assert resolve_method("int8", False, cpu, torch.float32, single_process=True) == "int8"


def test_a_given_model_is_not_quantized_by_default() -> None:
    model = build("llama").to(torch.bfloat16)
    LLM(model, compile=False, num_kv_blocks=16)
    assert not has_int4_layers(model)


def test_int4_is_refused_off_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build("llama")
    meta = torch.nn.Parameter(torch.empty(1, device="meta"))
    monkeypatch.setattr(type(model), "parameters", lambda self, recurse=True: iter([meta]))
    with pytest.raises(ValueError, match="runs on CPU"):
        quantize_weights(model, "int4")


@pytest.mark.slow
def test_default_model_q4_1_tensors_load_as_transformers_dequantizes_them() -> None:
    from transformers import AutoModelForCausalLM

    from paged_backend.model.loading.default_model import default_model_path, gguf_file_path
    from paged_backend.model.quantized.gguf_int4 import read_q4_1_linears

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    captured = {}
    original = Int4Linear.__init__

    def capture(self, codes, scales, offsets, bias=None, dense_dtype=torch.bfloat16):
        original(self, codes, scales, offsets, bias, dense_dtype)
        captured[id(self)] = (codes, scales, offsets)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Int4Linear, "__init__", capture)
        layers = read_q4_1_linears(gguf_file_path(), model)
    assert len(layers) == 7 * model.config.num_hidden_layers
    for name, layer in layers.items():
        codes, scales, offsets = captured[id(layer)]
        rows = codes.shape[0]
        weight = (codes.float().view(rows, -1, GROUP_SIZE) * scales[..., None] + offsets[..., None]).view(rows, -1)
        assert torch.equal(weight, model.get_submodule(name).weight), name  # the file's own values, rows in HF order
        assert np.abs(layer.weight_float().numpy() - weight.numpy()).max() <= 1e-2 * weight.abs().max().item()
        assert layer.dense.dtype == torch.float32  # the model's dtype


@pytest.mark.slow
def test_default_model_in_bf16_runs_int4_by_default_and_answers_like_its_bf16_self() -> None:
    prompts = ["The capital of France is", "List three colours:"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    int4 = LLM(None, dtype="bfloat16", compile=False, num_kv_blocks=64)  # quantization="auto"
    layer = int4.engine.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, Int4Linear) and layer.dense.dtype == int4_linear.COMPUTE_DTYPE
    bf16 = LLM(None, dtype="bfloat16", quantization=None, compile=False, num_kv_blocks=64)
    assert not has_int4_layers(bf16.engine.model)
    a = [o.outputs[0].token_ids for o in int4.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in bf16.generate(prompts, params, use_tqdm=False)]
    # The same Q4_1 weights, rounded to bf16 in two ways: the answers start alike.
    assert all(x[:4] == y[:4] for x, y in zip(a, b))


@pytest.mark.slow
def test_default_model_on_a_cpu_without_native_bf16_runs_int4_over_fp32_by_default() -> None:
    """Where the engine picks fp32 (the suite pins that choice, conftest.py), the default model still runs its
    file's int4 codes for small steps, with fp32 activations and fp32 dense copies for large ones; a named
    fp32 keeps the exact weights. One prompt through the engine equals the same model's own generate."""
    prompt = "The capital of France is"
    int4 = LLM(None, compile=False, num_kv_blocks=64)  # dtype and quantization "auto"
    model = int4.engine.model
    layer = model.model.layers[0].mlp.down_proj
    assert model.dtype == torch.float32 and isinstance(layer, Int4Linear)
    assert layer.dense.dtype == torch.float32 and layer.dense_rows == FP32_DENSE_ROWS
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.dense.dtype == torch.float32
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = int4.tokenizer(prompt).input_ids
    answer = int4.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        reference = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert answer == reference[0, len(ids):].tolist()
    exact = LLM(None, dtype=torch.float32, compile=False, num_kv_blocks=64)
    assert not has_int4_layers(exact.engine.model)
    fp32_answer = exact.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert answer[:4] == fp32_answer[:4]  # the same Q4_1 weights, the kernel's rows rounded to bf16


@pytest.mark.slow
def test_the_tensor_index_reads_what_gguf_reader_reads() -> None:
    from gguf import GGUFReader

    from paged_backend.model.loading.default_model import gguf_file_path
    from paged_backend.model.quantized.gguf_int4 import tensor_index

    expected = {t.name: (tuple(int(x) for x in t.shape), int(t.tensor_type), int(t.data_offset))
                for t in GGUFReader(str(gguf_file_path())).tensors}
    assert {name: (shape, kind, offset) for name, shape, kind, offset in tensor_index(gguf_file_path())} == expected


@pytest.mark.slow
def test_the_gguf_a_model_argument_loads_from(tmp_path) -> None:
    from paged_backend.model.loading.default_model import DEFAULT_MODEL, gguf_file_path
    from paged_backend.model.loading.model_loader import gguf_file_of, is_default_model

    assert is_default_model(None) and is_default_model(DEFAULT_MODEL) and not is_default_model("gpt2")
    assert gguf_file_of(None) == gguf_file_of(DEFAULT_MODEL) == gguf_file_path()
    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF")
    assert gguf_file_of(str(file)) == file and gguf_file_of(tmp_path) is None and gguf_file_of(build("llama")) is None
