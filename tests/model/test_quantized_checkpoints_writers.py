"""The quantized-checkpoint writers of helpers/quantized_checkpoints.py are trustworthy on their own: each folder read
back and dequantized here by the format's documented formula (and, for GPTQ and AWQ, by a transcription of the
upstream unpack code; for compressed-tensors, by the compressed_tensors package when it is installed) gives exactly
the weights the writer returned, and those are within half a quantization step of the float weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from helpers.models import build, build_from_config
from helpers.quantized_checkpoints import corrupt, quantized_linears, write_quantized
from safetensors.torch import load_file

# Every variant the writers cover: (format, keyword arguments).
GPTQ = [("gptq", dict(bits=bits, sym=sym, group_size=size, desc_act=act))
        for bits in (4, 8) for sym in (True, False) for size in (32, 64, 128, -1) for act in (False, True)]
AWQ = [("awq", dict(group_size=size)) for size in (32, 64, 128)]
CT_INT = [(fmt, dict(sym=sym, strategy=strategy, group_size=size))
          for fmt in ("ct-w4a16", "ct-w8a16", "ct-w8a8") for sym in (True, False)
          for strategy, size in (("group", 32), ("group", 128), ("channel", 32))]
CT_FP8 = [("ct-fp8", dict(strategy=strategy)) for strategy in ("tensor", "channel", "block")]
VARIANTS = GPTQ + AWQ + CT_INT + CT_FP8
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def wide_llama_config() -> tf.LlamaConfig:
    """Every projection 128 or more wide, so group size 128 divides each input size."""
    return tf.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(autouse=True)
def transformers_own_quantizers():
    """transformers' compressed-tensors quantizer reads the folders here as the reference, not the engine's
    (which importing paged_backend installs for the same methods)."""
    from paged_backend.model.quantized import checkpoint_quantizer

    checkpoint_quantizer.uninstall()
    yield
    checkpoint_quantizer.install()


@pytest.fixture(scope="module")
def model() -> tf.PreTrainedModel:
    return build_from_config(wide_llama_config)


def variant_id(variant) -> str:
    fmt, kwargs = variant
    return "-".join([fmt, *(f"{key}={value}" for key, value in kwargs.items())])


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


# --- the documented formulas, read independently of the writer ----------------------------------------------------

def words(tensor: torch.Tensor) -> np.ndarray:
    """int32 words as unsigned 32-bit numbers."""
    return tensor.numpy().view(np.uint32).astype(np.int64)


def field(word: np.ndarray, bits: int, slot: int) -> np.ndarray:
    return (word >> (bits * slot)) & ((1 << bits) - 1)


def read_gptq(t: dict, prefix: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ v1: W[o, i] = scales[g, o] * (q[i, o] - (zeros[g, o] + 1)), g = g_idx[i]; q packed k = 32/bits per word
    down the input dimension, zeros across the output dimension, value j at bits [bits*j, bits*(j+1))."""
    per_word = 32 // bits
    qweight, qzeros = words(t[f"{prefix}.qweight"]), words(t[f"{prefix}.qzeros"])
    codes = np.zeros((qweight.shape[0] * per_word, qweight.shape[1]), dtype=np.int64)
    for row in range(qweight.shape[0]):
        for slot in range(per_word):
            codes[row * per_word + slot] = field(qweight[row], bits, slot)
    zeros = np.zeros((qzeros.shape[0], qzeros.shape[1] * per_word), dtype=np.int64)
    for column in range(qzeros.shape[1]):
        for slot in range(per_word):
            zeros[:, column * per_word + slot] = field(qzeros[:, column], bits, slot) + 1
    scales = t[f"{prefix}.scales"].float().numpy()
    g_idx = t[f"{prefix}.g_idx"].numpy()
    weight = scales[g_idx] * (codes - zeros[g_idx])
    return torch.from_numpy(weight.T.copy()).float(), torch.from_numpy(scales[g_idx].T.copy())


def read_awq(t: dict, prefix: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM: q [in, out] and zeros [groups, out] packed eight per word across the output dimension, slot j
    holding column AWQ_ORDER[j] of the eight; W[o, i] = (q[i, o] - zeros[i // g, o]) * scales[i // g, o]."""
    def unpack(packed: np.ndarray) -> np.ndarray:
        values = np.zeros((packed.shape[0], packed.shape[1] * 8), dtype=np.int64)
        for column in range(packed.shape[1]):
            for slot in range(8):
                values[:, column * 8 + AWQ_ORDER[slot]] = field(packed[:, column], 4, slot)
        return values

    codes, zeros = unpack(words(t[f"{prefix}.qweight"])), unpack(words(t[f"{prefix}.qzeros"]))
    group = np.arange(codes.shape[0]) // group_size
    scales = t[f"{prefix}.scales"].float().numpy()
    weight = (codes - zeros[group]) * scales[group]
    return torch.from_numpy(weight.T.copy()).float(), torch.from_numpy(scales[group].T.copy())


def unpack_ct(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """compressed-tensors pack_to_int32 read back: element i of a row at bit i*bits of the row's little-endian
    bitstream, stored with +2^(bits-1)."""
    values = np.zeros((packed.shape[0], count), dtype=np.int64)
    for i in range(count):
        values[:, i] = (packed[:, i * bits // 32] >> (i * bits % 32)) & ((1 << bits) - 1)
    return values - (1 << (bits - 1))


def read_ct_int(t: dict, prefix: str, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """W[o, i] = (q[o, i] - zero_point[o, g]) * scale[o, g], g = i // (in / groups)."""
    scale = t[f"{prefix}.weight_scale"].float().numpy()
    if f"{prefix}.weight_packed" in t:
        out_features, in_features = t[f"{prefix}.weight_shape"].tolist()
        codes = unpack_ct(words(t[f"{prefix}.weight_packed"]), bits, in_features)
        zero = (unpack_ct(words(t[f"{prefix}.weight_zero_point"]).T, bits, out_features).T if not sym
                else np.zeros_like(scale, dtype=np.int64))
    else:
        codes = t[f"{prefix}.weight"].numpy().astype(np.int64)
        zero = (t[f"{prefix}.weight_zero_point"].numpy().astype(np.int64) if not sym
                else np.zeros_like(scale, dtype=np.int64))
    group = np.arange(codes.shape[1]) // (codes.shape[1] // scale.shape[1])
    weight = (codes - zero[:, group]) * scale[:, group]
    return torch.from_numpy(weight).float(), torch.from_numpy(scale[:, group].copy())


def read_ct_fp8(t: dict, prefix: str) -> torch.Tensor:
    """W[o, i] = fp8 q[o, i] * scale, the scale of the tensor, of row o, or of block (o // 128, i // 128)."""
    codes = t[f"{prefix}.weight"].float()
    scale = t[f"{prefix}.weight_scale"].float()
    rows, cols = torch.arange(codes.shape[0]), torch.arange(codes.shape[1])
    if scale.dim() == 1:
        return codes * scale[0]
    if scale.shape[1] == 1 and scale.shape[0] == codes.shape[0]:
        return codes * scale
    return codes * scale[rows[:, None] // 128, cols[None, :] // 128]


def read_back(folder: Path, fmt: str, kwargs: dict, prefix: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dequantized weight, each weight's quantization step; None for fp8) of module `prefix`."""
    t = load_file(str(folder / "model.safetensors"))
    if fmt == "gptq":
        return read_gptq(t, prefix, kwargs["bits"])
    if fmt == "awq":
        return read_awq(t, prefix, kwargs["group_size"])
    if fmt == "ct-fp8":
        return read_ct_fp8(t, prefix), None
    return read_ct_int(t, prefix, 4 if fmt == "ct-w4a16" else 8, kwargs["sym"])


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_the_files_mean_the_returned_weights_within_half_a_step_of_the_float_ones(model, tmp_path, variant) -> None:
    fmt, kwargs = variant
    reference = write_quantized(model, tmp_path, fmt, **kwargs)
    linears = quantized_linears(model)
    assert sorted(reference) == sorted(linears) and len(reference) == 14
    for name, linear in linears.items():
        weight, step = read_back(tmp_path, fmt, kwargs, name)
        assert torch.equal(weight, reference[name]), name
        original = linear.weight.detach().float()
        error = (reference[name] - original).abs()
        if step is None:  # fp8 e4m3: three mantissa bits, so half a step is at most 2^-4 of the value
            scale = reference[name].abs().max() / 448
            assert bool((error <= original.abs() / 16 + scale * 2.0 ** -9).all()), name
        else:
            assert bool((error <= step * (0.5 + 1e-6)).all()), name


# --- the upstream unpack code, transcribed ----------------------------------------------------------------------------

def autogptq_dequantize(qweight, qzeros, scales, g_idx, bits):
    """`QuantLinear.forward`'s torch path for bits 2/4/8, AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda.py
    (v1 zeros: + 1), returning the weight [in, out] it multiplies by."""
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits),
                                      wf.unsqueeze(0)).to(torch.int16 if bits == 8 else torch.int8)
    zeros = torch.bitwise_and(zeros, (2 ** bits) - 1)
    zeros = zeros + 1
    zeros = zeros.reshape(scales.shape)
    weight = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1),
                                       wf.unsqueeze(-1)).to(torch.int16 if bits == 8 else torch.int8)
    weight = torch.bitwise_and(weight, (2 ** bits) - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    return scales[g_idx.long()] * (weight - zeros[g_idx.long()])


def autoawq_dequantize(qweight, qzeros, scales, bits, group_size):
    """`dequantize_gemm` with `unpack_awq` and `reverse_awq_order`, AutoAWQ awq/utils/packing_utils.py."""
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    reverse_order_tensor = torch.arange(iweights.shape[-1], dtype=torch.int32)
    reverse_order_tensor = reverse_order_tensor.view(-1, 32 // bits)
    reverse_order_tensor = reverse_order_tensor[:, [0, 4, 1, 5, 2, 6, 3, 7]]
    reverse_order_tensor = reverse_order_tensor.view(-1)
    izeros = izeros[:, reverse_order_tensor]
    iweights = iweights[:, reverse_order_tensor]
    iweights = torch.bitwise_and(iweights, (2 ** bits) - 1)
    izeros = torch.bitwise_and(izeros, (2 ** bits) - 1)
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return (iweights - izeros) * scales


@pytest.mark.parametrize("variant", [v for v in GPTQ if v[1]["group_size"] == 32
                                     or (v[1]["group_size"] == -1 and v[1]["bits"] == 4)], ids=variant_id)
def test_autogptq_unpack_code_reads_the_gptq_folder(model, tmp_path, variant) -> None:
    """Upstream computes in fp16: its weight is the reference rounded to fp16."""
    reference = write_quantized(model, tmp_path, "gptq", **variant[1])
    t = load_file(str(tmp_path / "model.safetensors"))
    for name in reference:
        weight = autogptq_dequantize(*(t[f"{name}.{key}"] for key in ("qweight", "qzeros", "scales", "g_idx")),
                                     variant[1]["bits"])
        assert weight.dtype == torch.float16
        assert torch.equal(weight.t(), reference[name].half()), name


@pytest.mark.parametrize("variant", AWQ, ids=variant_id)
def test_autoawq_unpack_code_reads_the_awq_folder(model, tmp_path, variant) -> None:
    reference = write_quantized(model, tmp_path, "awq", **variant[1])
    t = load_file(str(tmp_path / "model.safetensors"))
    for name in reference:
        weight = autoawq_dequantize(t[f"{name}.qweight"], t[f"{name}.qzeros"], t[f"{name}.scales"], 4,
                                    variant[1]["group_size"])
        assert torch.equal(weight.t(), reference[name].half()), name


# --- compressed-tensors' own decompressor ---------------------------------------------------------------------------

CT_VARIANTS = [v for v in CT_INT if v[1]["group_size"] == 32] + CT_FP8


@pytest.mark.parametrize("variant", CT_VARIANTS, ids=variant_id)
def test_compressed_tensors_decompresses_the_folder_to_the_returned_weights(model, tmp_path, variant) -> None:
    """The package's compressor for the folder's format, fed each module's tensors and the scheme parsed from
    config.json, gives the reference (in bf16: it dequantizes in the scales' dtype)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    reference = write_quantized(model, tmp_path, variant[0], **variant[1])
    config = QuantizationConfig.model_validate(config_of(tmp_path)["quantization_config"])
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config.format)
    t = load_file(str(tmp_path / "model.safetensors"))
    for name in reference:
        state = {key.removeprefix(f"{name}."): value for key, value in t.items() if key.startswith(f"{name}.")}
        weight = compressor.decompress(state, scheme)["weight"]
        assert torch.equal(weight, reference[name].bfloat16()), name


@pytest.mark.parametrize("variant", CT_VARIANTS, ids=variant_id)
def test_transformers_loads_the_compressed_tensors_folder_to_the_returned_weights(model, tmp_path, variant) -> None:
    pytest.importorskip("compressed_tensors")
    reference = write_quantized(model, tmp_path, variant[0], **variant[1])
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=tf.CompressedTensorsConfig(
        dequantize=True))
    modules = dict(loaded.named_modules())
    for name, weight in reference.items():
        assert torch.equal(modules[name].weight.detach(), weight.bfloat16()), name


def test_transformers_reads_a_skipped_module_of_a_compressed_tensors_folder_as_float(model, tmp_path) -> None:
    pytest.importorskip("compressed_tensors")
    skipped = "model.layers.1.mlp.down_proj"
    reference = write_quantized(model, tmp_path, "ct-w4a16", skip=[skipped])
    modules = dict(tf.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=tf.CompressedTensorsConfig(
        dequantize=True)).named_modules())
    assert torch.equal(modules[skipped].weight.detach(), dict(model.named_modules())[skipped].weight.detach().bfloat16())
    name = "model.layers.0.mlp.down_proj"
    assert torch.equal(modules[name].weight.detach(), reference[name].bfloat16())


# --- what the folders hold ------------------------------------------------------------------------------------------

def test_gptq_folder_holds_gptqmodels_tensors_and_config(model, tmp_path) -> None:
    write_quantized(model, tmp_path, "gptq", bits=4, group_size=32, sym=True, desc_act=True)
    t = load_file(str(tmp_path / "model.safetensors"))
    prefix = "model.layers.0.mlp.down_proj"  # in 256, out 128
    assert {key: (tuple(t[f"{prefix}.{key}"].shape), t[f"{prefix}.{key}"].dtype)
            for key in ("qweight", "qzeros", "scales", "g_idx")} == {
        "qweight": ((32, 128), torch.int32), "qzeros": ((8, 16), torch.int32), "scales": ((8, 128), torch.float16),
        "g_idx": ((256,), torch.int32)}
    assert f"{prefix}.weight" not in t
    # Symmetric v1 zeros: 2^(bits-1) stored minus one, in every nibble.
    assert bool((t[f"{prefix}.qzeros"] == 0x77777777).all())
    g_idx = t[f"{prefix}.g_idx"]
    assert not bool((g_idx[1:] >= g_idx[:-1]).all())  # act-order: unsorted
    assert torch.bincount(g_idx).tolist() == [32] * 8
    assert t["model.embed_tokens.weight"].dtype == t["lm_head.weight"].dtype == torch.float16
    config = config_of(tmp_path)
    assert config["dtype"] == "float16" and config["architectures"] == ["LlamaForCausalLM"]
    quant = config["quantization_config"]
    assert {key: quant[key] for key in ("quant_method", "checkpoint_format", "bits", "group_size", "sym",
                                        "desc_act", "pack_dtype", "lm_head")} == {
        "quant_method": "gptq", "checkpoint_format": "gptq", "bits": 4, "group_size": 32, "sym": True,
        "desc_act": True, "pack_dtype": "int32", "lm_head": False}
    assert "dynamic" not in quant


def test_gptq_without_act_order_numbers_groups_in_column_order(model, tmp_path) -> None:
    write_quantized(model, tmp_path, "gptq", group_size=64)
    g_idx = load_file(str(tmp_path / "model.safetensors"))["model.layers.1.mlp.down_proj.g_idx"]
    assert torch.equal(g_idx, (torch.arange(256) // 64).int())


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_groups_wider_than_a_projection_leave_one_short_group(tmp_path, desc_act) -> None:
    """As GPTQ does when group_size does not divide in_features: ceil(in / group_size) groups."""
    llama = build("llama")  # q, k, v, o, gate and up take 64 inputs, down 128
    reference = write_quantized(llama, tmp_path, "gptq", group_size=96, desc_act=desc_act)
    t = load_file(str(tmp_path / "model.safetensors"))
    assert t["model.layers.0.self_attn.q_proj.scales"].shape == (1, 64)
    assert torch.bincount(t["model.layers.0.mlp.down_proj.g_idx"]).tolist() == [96, 32]
    for name in reference:
        assert torch.equal(read_gptq(t, name, 4)[0], reference[name]), name


def test_gptq_keeps_biases_in_fp16(tmp_path) -> None:
    qwen2 = build("qwen2")  # q, k and v carry biases
    write_quantized(qwen2, tmp_path, "gptq")
    t = load_file(str(tmp_path / "model.safetensors"))
    bias = t["model.layers.0.self_attn.q_proj.bias"]
    assert bias.dtype == torch.float16
    assert torch.equal(bias, qwen2.model.layers[0].self_attn.q_proj.bias.detach().half())


def test_awq_folder_holds_autoawqs_tensors_and_config(model, tmp_path) -> None:
    write_quantized(model, tmp_path, "awq", group_size=64)
    t = load_file(str(tmp_path / "model.safetensors"))
    prefix = "model.layers.0.self_attn.k_proj"  # in 128, out 64
    assert {key: (tuple(t[f"{prefix}.{key}"].shape), t[f"{prefix}.{key}"].dtype)
            for key in ("qweight", "qzeros", "scales")} == {
        "qweight": ((128, 8), torch.int32), "qzeros": ((2, 8), torch.int32), "scales": ((2, 64), torch.float16)}
    assert config_of(tmp_path)["quantization_config"] == {
        "quant_method": "awq", "zero_point": True, "group_size": 64, "bits": 4, "version": "gemm",
        "modules_to_not_convert": None}


@pytest.mark.parametrize("fmt, bits", [("ct-w4a16", 4), ("ct-w8a16", 8)])
def test_pack_quantized_folder_holds_llm_compressors_tensors_and_config(model, tmp_path, fmt, bits) -> None:
    write_quantized(model, tmp_path, fmt, group_size=32, sym=False)
    t = load_file(str(tmp_path / "model.safetensors"))
    prefix = "model.layers.0.mlp.down_proj"  # in 256, out 128
    assert {key: (tuple(value.shape), value.dtype) for key, value in t.items() if key.startswith(prefix)} == {
        f"{prefix}.weight_packed": ((128, 256 * bits // 32), torch.int32),
        f"{prefix}.weight_scale": ((128, 8), torch.bfloat16),
        f"{prefix}.weight_shape": ((2,), torch.int64),
        f"{prefix}.weight_zero_point": ((128 * bits // 32, 8), torch.int32)}
    assert t[f"{prefix}.weight_shape"].tolist() == [128, 256]
    assert t["model.norm.weight"].dtype == torch.bfloat16
    config = config_of(tmp_path)
    assert config["dtype"] == "bfloat16"
    quant = config["quantization_config"]
    assert (quant["quant_method"], quant["format"], quant["ignore"], quant["quantization_status"]) == (
        "compressed-tensors", "pack-quantized", ["lm_head"], "compressed")
    assert quant["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert quant["config_groups"]["group_0"]["input_activations"] is None
    assert quant["config_groups"]["group_0"]["weights"] == {
        "dynamic": False, "group_size": 32, "num_bits": bits, "strategy": "group", "symmetric": False,
        "type": "int"}


def test_symmetric_pack_quantized_has_no_zero_point_and_int_quantized_stores_int8(model, tmp_path) -> None:
    write_quantized(model, tmp_path / "w4", "ct-w4a16", strategy="channel")
    write_quantized(model, tmp_path / "w8a8", "ct-w8a8", strategy="channel", sym=False)
    packed = load_file(str(tmp_path / "w4" / "model.safetensors"))
    naive = load_file(str(tmp_path / "w8a8" / "model.safetensors"))
    prefix = "model.layers.0.self_attn.q_proj"  # in 128, out 128
    assert f"{prefix}.weight_zero_point" not in packed
    assert packed[f"{prefix}.weight_scale"].shape == (128, 1)
    assert (naive[f"{prefix}.weight"].dtype, naive[f"{prefix}.weight_zero_point"].dtype) == (torch.int8, torch.int8)
    assert naive[f"{prefix}.weight_zero_point"].shape == naive[f"{prefix}.weight_scale"].shape == (128, 1)
    quant = config_of(tmp_path / "w8a8")["quantization_config"]
    assert quant["format"] == "int-quantized"
    assert quant["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"


@pytest.mark.parametrize("strategy, shape", [("tensor", (1,)), ("channel", (128, 1)), ("block", (1, 2))])
def test_fp8_folder_scales_by_strategy(model, tmp_path, strategy, shape) -> None:
    write_quantized(model, tmp_path, "ct-fp8", strategy=strategy)
    t = load_file(str(tmp_path / "model.safetensors"))
    prefix = "model.layers.0.mlp.down_proj"  # in 256, out 128: two 128-wide column blocks
    assert t[f"{prefix}.weight"].dtype == torch.float8_e4m3fn and t[f"{prefix}.weight"].shape == (128, 256)
    assert t[f"{prefix}.weight_scale"].shape == shape and t[f"{prefix}.weight_scale"].dtype == torch.bfloat16
    assert (f"{prefix}.input_scale" in t) == (strategy == "tensor")
    weights = config_of(tmp_path)["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (weights["type"], weights["strategy"], weights.get("block_structure")) == (
        "float", strategy, [128, 128] if strategy == "block" else None)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct-w4a16", "ct-fp8"])
def test_scales_are_bf16_values_stored_exactly(model, tmp_path, fmt) -> None:
    write_quantized(model, tmp_path, fmt, strategy="channel" if fmt == "ct-fp8" else "group")
    for name, tensor in load_file(str(tmp_path / "model.safetensors")).items():
        if name.endswith(("scales", "weight_scale")):
            assert torch.equal(tensor.float().bfloat16().float(), tensor.float()), name


@pytest.mark.parametrize("fmt, listed", [
    ("gptq", lambda q: q["dynamic"] == {r"-:model\.layers\.1\.mlp\.down_proj$": {}}),
    ("awq", lambda q: q["modules_to_not_convert"] == ["model.layers.1.mlp.down_proj"]),
    ("ct-w4a16", lambda q: q["ignore"] == ["model.layers.1.mlp.down_proj", "lm_head"])])
def test_a_skipped_module_stays_a_float_weight_and_the_config_names_it(model, tmp_path, fmt, listed) -> None:
    skipped = "model.layers.1.mlp.down_proj"
    reference = write_quantized(model, tmp_path, fmt, skip=[skipped])
    assert skipped not in reference and len(reference) == 13
    t = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(key for key in t if key.startswith(skipped)) == [f"{skipped}.weight"]
    assert listed(config_of(tmp_path)["quantization_config"])


def test_refuses_what_the_tools_cannot_write(tmp_path) -> None:
    llama = build("llama")  # projections 64 wide
    with pytest.raises(ValueError, match="group size"):
        write_quantized(llama, tmp_path, "awq", group_size=128)
    with pytest.raises(ValueError, match="4-bit only"):
        write_quantized(llama, tmp_path, "awq", bits=8)
    with pytest.raises(ValueError, match="unknown format"):
        write_quantized(llama, tmp_path, "exl2")
    with pytest.raises(ValueError, match="strategy"):
        write_quantized(llama, tmp_path, "ct-fp8")


def test_corrupt_drops_reconfigures_and_reshapes(tmp_path) -> None:
    llama = build("llama")
    write_quantized(llama, tmp_path, "gptq")
    corrupt(tmp_path, drop="qzeros")
    assert not any(key.endswith("qzeros") for key in load_file(str(tmp_path / "model.safetensors")))
    corrupt(tmp_path, set_config={"bits": 3, "quant_method": "nope"})
    quant = config_of(tmp_path)["quantization_config"]
    assert (quant["bits"], quant["quant_method"], quant["checkpoint_format"]) == (3, "nope", "gptq")
    name = "model.layers.0.self_attn.q_proj.scales"
    before = load_file(str(tmp_path / "model.safetensors"))[name].shape
    corrupt(tmp_path, reshape=name)
    assert load_file(str(tmp_path / "model.safetensors"))[name].shape == (before[0] + 1, before[1])
    with pytest.raises(KeyError):
        corrupt(tmp_path, drop="qzeros")
