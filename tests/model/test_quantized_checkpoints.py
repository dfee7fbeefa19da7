"""GPTQ, AWQ and compressed-tensors checkpoints load into the engine's own layers: the layers hold the
checkpoint's weights, the engine answers as generate does on the loaded model (mixed batches, chunked
prefill, preemption), every entry point takes the folder with no flag, and bad checkpoints are refused by
name. The folders are tiny random models written in each format (tests/helpers/quantized_checkpoints.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.engine import assert_all_blocks_free, hf_greedy, mixed_prompts, one_thread  # noqa: F401
from helpers.models import build
from helpers.quantized_checkpoints import corrupt, write_quantized
from transformers import AutoModelForCausalLM

from paged_backend import LLM, SamplingParams
from paged_backend.kernels import cpu_int4_matmul, cpu_int8_matmul
from paged_backend.model.quantized import checkpoint_quantizer
from paged_backend.model.quantized.checkpoint_formats import CheckpointFormatError
from paged_backend.model.quantized.checkpoint_layers import CODES_KERNEL_ROWS, DequantizingLinear
from paged_backend.model.quantized.fused_projections import fuse_projections, groups_of
from paged_backend.model.quantized.int4_linear import Int4Linear
from paged_backend.model.quantized.quantized_linear import QuantizedLinear

MAX_NEW = 8
# End of sequence banned until the last token, as hf_greedy bans it (one of these models' answers picks it).
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)

# (id, format, writer options, the engine layer it becomes on CPU)
VARIANTS = [
    ("gptq-4bit-g32-sym", "gptq", dict(bits=4, group_size=32, sym=True), Int4Linear),
    ("gptq-4bit-g64-asym", "gptq", dict(bits=4, group_size=64, sym=False), Int4Linear),
    ("gptq-4bit-row", "gptq", dict(bits=4, group_size=-1, sym=True), Int4Linear),
    ("gptq-4bit-act-order", "gptq", dict(bits=4, group_size=32, sym=True, desc_act=True), Int4Linear),
    ("gptq-8bit-g32", "gptq", dict(bits=8, group_size=32, sym=True), DequantizingLinear),
    ("awq-g32", "awq", dict(bits=4, group_size=32), Int4Linear),
    ("awq-g64", "awq", dict(bits=4, group_size=64), Int4Linear),
    ("ct-w4a16-g32-sym", "ct-w4a16", dict(group_size=32, sym=True), Int4Linear),
    ("ct-w4a16-g32-asym", "ct-w4a16", dict(group_size=32, sym=False), Int4Linear),
    ("ct-w4a16-channel", "ct-w4a16", dict(strategy="channel", sym=True), Int4Linear),
    ("ct-w8a16-channel", "ct-w8a16", dict(strategy="channel"), DequantizingLinear),
    ("ct-w8a16-g32", "ct-w8a16", dict(strategy="group", group_size=32), DequantizingLinear),
    ("ct-fp8-channel", "ct-fp8", dict(strategy="channel"), DequantizingLinear),
    ("ct-fp8-tensor", "ct-fp8", dict(strategy="tensor"), DequantizingLinear),
    ("ct-fp8-block", "ct-fp8", dict(strategy="block"), DequantizingLinear),
]
IDS = [v[0] for v in VARIANTS]
ONE_PER_FORMAT = ["gptq-4bit-g32-sym", "awq-g32", "ct-w4a16-g32-sym", "ct-w8a16-channel", "ct-fp8-channel"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple]:
    """Each variant written once: (folder, reference weights by module name, the layer class it becomes)."""
    written = {}
    for name, fmt, options, layer in VARIANTS:
        folder = tmp_path_factory.mktemp(name)
        written[name] = (folder, write_quantized(build("llama"), folder, fmt, **options), layer)
    return written


def load(folder, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)


def dequantized_twin(folder, reference: dict[str, torch.Tensor]):
    """The checkpoint's model with plain fp32 linear layers holding the reference weights (its embeddings and
    norms as the file has them)."""
    model = load(folder)
    for name, weight in reference.items():
        layer = model.get_submodule(name)
        plain = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=layer.bias is not None)
        with torch.no_grad():
            plain.weight.copy_(weight)
            if layer.bias is not None:
                plain.bias.copy_(layer.bias)
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, plain)
    return model


def assert_answers_as_generate(reference, prompts: list[list[int]], make_llm) -> LLM:
    """`generate`'s greedy answers on `reference` first (an engine may fuse the model it is given), then the
    engine `make_llm()` builds: the same answers, request by request, and every KV block back."""
    refs = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    llm = make_llm()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == refs
    assert_all_blocks_free(llm.engine)
    return llm


@pytest.mark.parametrize("variant", IDS)
def test_layers_hold_the_checkpoint_weights(folders, variant) -> None:
    """Every quantized linear becomes the engine's layer and multiplies by the file's weights: exactly, but
    for the int4 kernels' bf16 zero `(8 - zero) * scale` of an asymmetric group (within bf16 rounding)."""
    folder, reference, layer_class = folders[variant]
    model = load(folder)
    for name, weight in reference.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, layer_class), name
        got = layer.weight_float()
        symmetric = "asym" not in variant and "awq" not in variant
        # Without the compiled kernel (a CPU without AVX512-BF16) an int4 layer is read back through torch's
        # kernel times the identity, which rounds each weight to bf16.
        read_exactly = layer_class is DequantizingLinear or getattr(layer, "tile_codes", None) is not None
        exact = layer_class is DequantizingLinear or (symmetric and read_exactly)
        tolerance = 0.0 if exact else 2.0**-8 * weight.abs().max().item()
        torch.testing.assert_close(got, weight, rtol=0, atol=tolerance, msg=name)
    assert not [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and n in reference]


@pytest.mark.parametrize("variant", IDS)
def test_the_engine_answers_as_generate_does_on_the_loaded_model(folders, variant) -> None:
    """A mixed batch with chunked prefill and preemption (few KV blocks) equals generate, request by request."""
    folder, _, _ = folders[variant]
    assert_answers_as_generate(load(folder), mixed_prompts(8), lambda: LLM(
        str(folder), dtype="float32", compile=False, num_kv_blocks=24, block_size=4, max_num_batched_tokens=16))


@pytest.mark.parametrize("variant", ["gptq-4bit-g32-sym", "gptq-8bit-g32", "ct-fp8-channel", "ct-w8a16-channel"])
def test_the_loaded_model_computes_what_the_dequantized_weights_compute(folders, variant) -> None:
    """Against a float model whose linear weights are the reference values (fp32): the dequantizing layers'
    arithmetic is that model's, so greedy tokens are equal; the int4 kernel rounds its rows to bf16, so its
    logits stay within that rounding."""
    folder, reference, layer_class = folders[variant]
    model, plain = load(folder), dequantized_twin(folder, reference)
    prompts = mixed_prompts(4)
    if layer_class is DequantizingLinear:
        assert [hf_greedy(model, p, MAX_NEW) for p in prompts] == [hf_greedy(plain, p, MAX_NEW) for p in prompts]
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        got, want = model(ids).logits, plain(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0.02 * want.abs().max().item())


def test_from_pretrained_and_generate_paged_take_the_folder_with_no_flag(folders) -> None:
    folder, _, _ = folders["gptq-4bit-g32-sym"]
    model = load(folder)
    ids = torch.tensor([[5, 17, 3, 99, 42]])
    want = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    got = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, cache_implementation="paged")
    assert got.tolist() == want.tolist()


def test_naming_the_method_asks_for_that_format(folders, tmp_path) -> None:
    folder, _, _ = folders["awq-g32"]
    LLM(str(folder), quantization="awq", compile=False, num_kv_blocks=16)
    with pytest.raises(ValueError, match="quantization='gptq' reads a gptq checkpoint, but this model is a awq"):
        LLM(str(folder), quantization="gptq", compile=False, num_kv_blocks=16)
    build("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a quantized checkpoint"):
        LLM(str(tmp_path), quantization="compressed-tensors", compile=False, num_kv_blocks=16)
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(folder), quantization="int4", compile=False, num_kv_blocks=16)


def test_the_start_up_log_says_the_format_and_the_kernel(folders, caplog) -> None:
    folder, _, _ = folders["gptq-4bit-g32-sym"]
    with caplog.at_level(logging.INFO, logger=checkpoint_quantizer.__name__):
        load(folder)
    kernel = "the compiled int4 kernel" if cpu_int4_matmul.library() is not None else "torch's CPU int4 kernel"
    assert f"gptq (gptq, int4, groups of 32, symmetric); 14 linear layers through {kernel}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=checkpoint_quantizer.__name__):
        load(folders["gptq-8bit-g32"][0])
    kernel = (f"the compiled 8-bit codes kernel (steps of up to {CODES_KERNEL_ROWS} rows; larger ones rebuild the "
              "weight)" if cpu_int8_matmul.library() is not None else "a dequantizing matmul (the weight rebuilt per call)")
    assert f"14 linear layers through {kernel}" in caplog.text


def test_int4_layers_keep_one_copy_of_the_codes(folders) -> None:
    """A checkpoint is chosen to fit memory: no dense copy, and the codes in one layout (the compiled kernel's
    tiles where it runs, else torch's), about 0.625 bytes a weight with the bf16 scales and zeros."""
    folder, reference, _ = folders["gptq-4bit-g32-sym"]
    model = load(folder)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.dense is None
    assert (layer.packed is None) == (layer.tile_codes is not None)
    held = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert held <= 0.625 * layer.in_features * layer.out_features


def test_int4_layers_past_the_kernels_switch_multiply_the_same_weights(folders) -> None:
    """Without a dense copy a layer made where the compiled kernel runs still answers with it switched off."""
    folder, _, _ = folders["gptq-4bit-g32-sym"]
    layer = load(folder).model.layers[0].self_attn.q_proj
    rows = torch.randn(3, layer.in_features)
    on = layer(rows)
    with cpu_int4_matmul.switched_off():
        off = layer(rows)
    torch.testing.assert_close(on, off, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("variant", ["gptq-4bit-g32-sym", "awq-g32", "ct-w4a16-g32-asym"])
def test_int4_projections_fuse(folders, variant) -> None:
    """q, k and v (64, 32 and 32 rows) stack: without torch's layout, the tiles stack by 16 rows."""
    folder, _, _ = folders[variant]
    model = load(folder)
    report = fuse_projections(model)
    assert report.groups == 4, report.describe()
    assert_answers_as_generate(load(folder), mixed_prompts(4), lambda: LLM(model, compile=False, num_kv_blocks=64))
    assert groups_of(model)


def test_act_order_projections_fuse_only_in_the_same_order(folders) -> None:
    """Each projection of the written folder has its own input order; made equal, they fuse."""
    folder, _, _ = folders["gptq-4bit-act-order"]
    model = load(folder)
    assert "different orders" in fuse_projections(model).describe()
    model = load(folder)
    for layer in model.model.layers:
        projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
        for projection in projections[1:]:
            projection.input_order = projections[0].input_order.clone()
        layer.mlp.up_proj.input_order = layer.mlp.gate_proj.input_order.clone()
    assert fuse_projections(model).groups == 4


@pytest.mark.parametrize("variant", ["gptq-4bit-act-order"])
def test_act_order_weights_come_back_in_the_inputs_order(folders, variant) -> None:
    folder, reference, _ = folders[variant]
    layer = load(folder).model.layers[1].mlp.down_proj
    assert layer.input_order is not None
    x = torch.randn(2, layer.in_features)
    torch.testing.assert_close(layer(x), x @ reference["model.layers.1.mlp.down_proj"].T, rtol=0.02, atol=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ONE_PER_FORMAT)
def test_compiled_steps_answer_as_eager_ones(folders, variant) -> None:
    folder, _, _ = folders[variant]
    assert_answers_as_generate(load(folder), mixed_prompts(6), lambda: LLM(
        str(folder), dtype="float32", compile=True, num_kv_blocks=64, max_num_batched_tokens=16))


def test_quantized_layers_are_quantized_linear_layers_lora_can_hook(folders) -> None:
    for variant in ONE_PER_FORMAT:
        model = load(folders[variant][0])
        assert all(isinstance(model.get_submodule(n), QuantizedLinear) for n in folders[variant][1])


# Bad checkpoints: refused at load time, by field or tensor.
def test_an_unknown_method_is_refused_rather_than_loaded_with_random_weights(folders, tmp_path) -> None:
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(folders["gptq-4bit-g32-sym"][0], folder)
    corrupt(folder, set_config={"quant_method": "nope"})
    with pytest.raises(CheckpointFormatError, match="quant_method='nope': no quantizer reads it"):
        LLM(str(folder), compile=False, num_kv_blocks=16)


@pytest.mark.parametrize("change, message", [
    (dict(set_config={"bits": 3}), "bits=3"),
    (dict(set_config={"checkpoint_format": "marlin"}), "checkpoint_format='marlin'"),
    (dict(drop="qzeros"), r"model\.layers\.\d+\.\w+\.\w+_proj\.qzeros is missing"),
    (dict(drop="scales"), r"\.scales is missing"),
    (dict(reshape="model.layers.0.self_attn.q_proj.scales"), r"q_proj\.scales has shape"),
])
def test_bad_gptq_checkpoints_are_refused_by_name(folders, tmp_path, change, message) -> None:
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(folders["gptq-4bit-g32-sym"][0], folder)
    corrupt(folder, **change)
    with pytest.raises((CheckpointFormatError, ValueError), match=message):
        load(folder)


@pytest.mark.parametrize("variant, change, message", [
    ("awq-g32", dict(set_config={"version": "gemv"}), "version='gemv'"),
    ("ct-w4a16-g32-sym", dict(set_config={"format": "marlin-24"}), "format='marlin-24'"),
    ("ct-w4a16-g32-asym", dict(drop="weight_zero_point"), "weight_zero_point is missing"),
    ("ct-fp8-channel", dict(reshape="model.layers.1.mlp.up_proj.weight_scale"), r"up_proj\.weight_scale has shape"),
])
def test_bad_awq_and_compressed_tensors_checkpoints_are_refused_by_name(folders, tmp_path, variant, change,
                                                                         message) -> None:
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(folders[variant][0], folder)
    corrupt(folder, **change)
    with pytest.raises((CheckpointFormatError, ValueError), match=message):
        load(folder)


def test_activation_quantized_integer_checkpoints_are_refused(tmp_path) -> None:
    """W8A8 int8 (int-quantized with per-token int8 inputs) would need its activations quantized to answer as
    it was calibrated; FP8 with fp8 activations runs weight-only (the ct-fp8 variants above), as weight-only
    fp8 kernels run it."""
    write_quantized(build("llama"), tmp_path, "ct-w8a8")
    with pytest.raises(CheckpointFormatError, match="input_activations on integer weights"):
        load(tmp_path)


def test_uninstall_gives_the_methods_back_to_transformers() -> None:
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    assert checkpoint_quantizer.is_installed()
    checkpoint_quantizer.uninstall()
    try:
        assert AUTO_QUANTIZER_MAPPING["gptq"].__name__ == "GptqHfQuantizer"
    finally:
        checkpoint_quantizer.install()
    assert checkpoint_quantizer.is_installed()


def test_the_command_line_takes_the_folder_and_the_method(folders) -> None:
    """`paged-backend generate`/`serve --model folder [--quantization gptq]` build the same LLM."""
    import argparse

    from paged_backend.integrations import cli
    from paged_backend.integrations.server.cli import add_serve_arguments

    folder, _, _ = folders["gptq-4bit-g32-sym"]
    parser = argparse.ArgumentParser()
    cli.add_model_arguments(parser)
    llm = cli.make_llm(parser.parse_args(["--model", str(folder), "--quantization", "gptq", "--no-compile",
                                          "--num-kv-blocks", "16"]))
    assert isinstance(llm.model.model.layers[0].self_attn.q_proj, Int4Linear)
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    assert serve.parse_args(["--model", str(folder), "--quantization", "compressed-tensors"]).quantization == \
        "compressed-tensors"


def test_where_the_compiled_int4_kernel_does_not_run_torchs_layout_is_kept(folders) -> None:
    """An AVX2 CPU (or the compiled kernel switched off at load): the codes in torch's layout alone, and the
    engine still answers as generate does, fused projections included."""
    folder, reference, _ = folders["gptq-4bit-g64-asym"]
    with cpu_int4_matmul.switched_off():
        model = load(folder)
        layer = model.model.layers[0].self_attn.k_proj
        assert layer.tile_codes is None and layer.packed is not None and layer.dense is None
        assert_answers_as_generate(model, mixed_prompts(4), lambda: LLM(
            model, compile=False, num_kv_blocks=64, max_num_batched_tokens=16))
    torch.testing.assert_close(layer.weight_float(), reference["model.layers.0.self_attn.k_proj"], rtol=0,
                               atol=2.0**-7 * reference["model.layers.0.self_attn.k_proj"].abs().max().item())


def test_an_fp16_model_runs_every_format_through_the_dequantizing_layer(folders) -> None:
    """fp16 activations (CUDA's dtype, here on CPU): the int4 kernels take bf16 or fp32, so even 4-bit codes
    are rebuilt per call, in fp16."""
    folder, reference, _ = folders["gptq-4bit-g32-sym"]
    layer = load(folder, dtype=torch.float16).model.layers[0].mlp.up_proj
    assert isinstance(layer, DequantizingLinear) and layer.dense_dtype == torch.float16
    x = torch.randn(2, layer.in_features, dtype=torch.float16)
    out = layer(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), x.float() @ reference["model.layers.0.mlp.up_proj"].T, rtol=0.01,
                               atol=0.01)
