"""The engine reads along its seams: a small public surface, a step that fits in one screen, and a hook
that lets a benchmark watch each step's forward without patching the engine's parts."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

from helpers.engine import greedy, mixed_prompts, run_to_completion
from helpers.models import build

from paged_backend import Engine, EngineConfig
from paged_backend.core import layer_specs

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ENGINE_SOURCE = Path(inspect.getfile(Engine))
ENGINE_PARTS = {"runner", "scheduler", "kv", "cache", "speculator", "output_processor", "inputs", "grammar_queue"}


def public_members(cls: type) -> list[str]:
    """Methods and properties a caller may use (properties count: they are calls too)."""
    return sorted(name for name, value in vars(cls).items()
                  if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)))


def test_the_engine_has_at_most_15_public_members() -> None:
    names = public_members(Engine)
    assert len(names) <= 15, names


def test_the_engine_is_built_in_one_screen_from_its_start_up_plan() -> None:
    """Start-up choices and their refusals live in startup_plan.py; the engine builds its parts from the plan."""
    lines = inspect.getsource(Engine.__init__).splitlines()
    assert len(lines) <= 30, f"Engine.__init__ has {len(lines)} lines"
    source = ENGINE_SOURCE.read_text()
    assert "EngineConfig." not in source  # a refusal names the field it refuses (`EngineConfig.max_model_len=...`)
    assert "eager_reason" not in source  # whether this is tensor parallel is the plan's question


def test_the_engine_samples_nothing_itself() -> None:
    """Rows for proposals, acceptance, generator rewinds and prompt logprobs are the step sampler's."""
    imported = {node.module for node in ast.walk(ast.parse(ENGINE_SOURCE.read_text()))
                if isinstance(node, ast.ImportFrom)}
    assert not imported & {"paged_backend.sampling.sampler", "paged_backend.sampling.prompt_logprobs"}
    assert "paged_backend.step_sampler" in imported


def metadata_builders() -> set[str]:
    """The package modules that call `AttentionMetadata(...)` themselves."""
    package = ENGINE_SOURCE.parent
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "AttentionMetadata":
                found.add(str(path.relative_to(package)))
    return found


def test_a_packed_step_is_described_one_way() -> None:
    """The runner, the start-up self-check, the compile warm-up and the draft model pack steps through
    `pack_sequences`; only the decode padding (its persistent buffers) and a tensor-parallel worker (the tensors it
    received) build metadata of their own."""
    assert metadata_builders() == {"kernels/metadata.py", "model/compiled/decode_padding.py", "parallel/step_protocol.py"}


def module_globals_set_per_step() -> set[str]:
    """Package modules holding a module-level `_current` (what a context manager sets around a forward)."""
    package = ENGINE_SOURCE.parent
    return {str(path.relative_to(package)) for path in package.rglob("*.py")
            for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            and "_current" in {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                               if isinstance(t, ast.Name)}}


def test_one_step_context_holds_what_a_steps_layers_read() -> None:
    """Attention metadata and cache, LoRA, recurrent state and the fused flag reach the layers through one
    context, set once per forward."""
    assert module_globals_set_per_step() == {"model/paged/step_context.py"}


def kind_names() -> tuple[set[str], set[str]]:
    """The layer spec classes of each kind, and the fields only a kind has (a window, a chunk, a latent's value
    width, a state's tensors), with the per-kind fields the model's K/V shape once had."""
    kinds = {cls for cls in vars(layer_specs).values()
             if isinstance(cls, type) and issubclass(cls, layer_specs.LayerSpec) and cls is not layer_specs.LayerSpec}
    fields = {field.name for cls in kinds for field in dataclasses.fields(cls)}
    return {cls.__name__ for cls in kinds}, fields | {"layer_windows", "latent_value_dim", "no_kv_layers"}


def names_in_file(path: Path) -> set[str]:
    """Every name, attribute, imported name and string constant a module's code uses, and `isinstance` if called."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return found


def test_the_kv_manager_and_the_plan_ask_layer_specs_not_kinds() -> None:
    """A new kind of layer is a spec class (core/layer_specs.py), its kernel and its tests: the KV manager, the
    layer groups, the start-up plan, the engine and the runner ask a group's spec, and never test which kind it is
    or read a field only one kind has. (The groups name full attention once: the default of a group keeping
    every block.)"""
    classes, fields = kind_names()
    assert classes >= {"SlidingWindowSpec", "ChunkedAttentionSpec", "LatentAttentionSpec", "RecurrentStateSpec"}
    assert fields >= {"window", "chunk", "value_dim", "states"}
    package = ENGINE_SOURCE.parent
    allowed = {"core/kv_cache_groups.py": {"FullAttentionSpec"}}
    for name in ("core/kv_cache_manager.py", "core/kv_cache_groups.py", "startup_plan.py", "engine.py",
                 "model/model_runner.py"):
        used = names_in_file(package / name)
        assert not used & (classes - allowed.get(name, set())), name
        assert not used & fields, name
        if name.startswith("core/"):
            assert "isinstance" not in used, name


def test_a_layer_s_kind_is_decided_in_the_spec_module() -> None:
    """The start-up probe reports what a layer did (rows or none, a latent, its record's window or chunk) and
    `layer_specs.spec_of` picks the kind: the probe names no kind but the full-attention default of a uniform shape."""
    classes, _ = kind_names()
    used = names_in_file(ENGINE_SOURCE.parent / "model" / "paged" / "paged_cache.py")
    assert not used & (classes - {"FullAttentionSpec"}) and "spec_of" in used


# A layer's attention options, which its attention record (kernels/layer_attention.py) carries from start-up on.
LAYER_OPTIONS = {"chunk_size", "sliding_window", "softcap"}


def functions_taking(names: set[str]) -> list[str]:
    """`path:function(parameter)` for every function or lambda of the package and the integrations, outside the
    kernels package (where the record is unpacked), with a parameter of one of `names`."""
    package = ENGINE_SOURCE.parent
    files = {path.resolve() for path in [*package.rglob("*.py"), *(package.parent / "integrations").rglob("*.py")]}
    found = []
    for path in sorted(files):
        if package / "kernels" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                arguments = node.args
                every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                         *filter(None, (arguments.vararg, arguments.kwarg))]
                found += [f"{path.name}:{getattr(node, 'name', 'lambda')}({a.arg})" for a in every if a.arg in names]
    return found


def test_layer_options_travel_as_one_record() -> None:
    """A layer's chunk, window and soft-cap are read once, into its attention record, and reach the kernels in it:
    no function outside the kernels package takes one of them as a parameter."""
    assert functions_taking(LAYER_OPTIONS) == []


def test_the_option_finder_finds_a_parameter(tmp_path: Path, monkeypatch) -> None:
    """Guards the test above: the walk sees a parameter of that name outside the kernels, and none inside."""
    package = tmp_path / "paged_backend"
    (package / "kernels").mkdir(parents=True)
    (package / "engine.py").write_text("def attend(query, *, sliding_window=None):\n    return query\n")
    (package / "kernels" / "inside.py").write_text("def attend(query, chunk_size):\n    return query\n")
    monkeypatch.setattr(sys.modules[__name__], "ENGINE_SOURCE", package / "engine.py")
    assert functions_taking(LAYER_OPTIONS) == ["engine.py:attend(sliding_window)"]


def test_formats_have_one_module_each() -> None:
    """Reasoning parsers, tool-call parsers and harmony are sibling packages with one file per format: no two
    modules of the package share the name of a format."""
    package = ENGINE_SOURCE.parent
    files = [*package.rglob("*.py"), *(package.parent / "integrations").rglob("*.py")]
    for name in ("hermes.py", "harmony.py", "structured.py"):
        found = [str(path.relative_to(package.parent)) for path in files if path.name == name]
        assert len(found) <= 1, found


def front_end_modules() -> dict[str, ast.AST]:
    """Every module of the package and of the integrations, by its path from the repository root."""
    root = ENGINE_SOURCE.parent.parent
    paths = [path for path in ENGINE_SOURCE.parent.rglob("*.py")
             if path.relative_to(root).parts[1] != "integrations"]  # the package's link to the integrations
    paths += list((root / "integrations").rglob("*.py"))
    return {str(path.relative_to(root)): ast.parse(path.read_text()) for path in paths}


def names_used(tree: ast.AST) -> set[str]:
    """The names a module imports, reads or calls (`f(...)`, `module.f(...)`, `from m import f`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
    return names


def users_of(*names: str) -> set[str]:
    return {path for path, tree in front_end_modules().items() if names_used(tree) & set(names)}


def test_the_chat_turn_helpers_are_used_in_the_entrypoints_only() -> None:
    """Holding a grammar after the thinking and the thinking budget are the chat turn's: no integration
    calls or imports them."""
    users = users_of("hold_after_thinking", "after_thinking", "budget_processor")
    assert users and all(path.startswith("paged_backend/entrypoints/") for path in users), users


def test_one_module_builds_a_chat_turn_and_the_five_front_ends_call_it() -> None:
    """The turn is built in chat_turn.py; the server's three chat routes (through `route_turn`, which gives
    the turn the server's parsers and names their fields), ChatPaged and LLM.chat call it, and none of
    them reads the prompt's thinking itself."""
    modules = front_end_modules()
    builders = {path for path, tree in modules.items() for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef) and node.name == "build_chat_turn"}
    assert builders == {"paged_backend/entrypoints/chat_turn.py"}
    assert users_of("build_chat_turn") - builders == {"integrations/server/chat_turn.py",
                                                      "integrations/langchain/chat.py",
                                                      "paged_backend/entrypoints/llm.py"}
    assert users_of("route_turn") == {"integrations/server/chat.py", "integrations/server/responses_api.py",
                                      "integrations/server/messages.py"}
    readers = users_of("opens_thinking", "prompt_tail") - {"paged_backend/entrypoints/chat_turn.py"}
    formats = ("paged_backend/entrypoints/reasoning/", "paged_backend/entrypoints/harmony/")  # where it is defined
    assert all(path.startswith(formats) for path in readers), readers


def test_the_step_reads_in_one_screen() -> None:
    lines = inspect.getsource(Engine.step).splitlines()
    assert len(lines) <= 25, f"Engine.step has {len(lines)} lines"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (hook, scheduled tokens, logits rows or -1)

    def before_forward(self, batch) -> None:
        self.calls.append(("before", sum(batch.num_new_tokens), -1))

    def after_forward(self, batch, logits) -> None:
        self.calls.append(("after", sum(batch.num_new_tokens), logits.shape[0]))


def test_a_step_observer_sees_every_forward() -> None:
    engine = Engine(build("llama"), config=EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16))
    recorder = Recorder()
    engine.observers.append(recorder)
    prompts = mixed_prompts(3)
    for prompt in prompts:
        engine.add_request(prompt, greedy(4))
    outputs = run_to_completion(engine)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs.values())
    hooks = [call[0] for call in recorder.calls]
    assert hooks == ["before", "after"] * (len(hooks) // 2) and hooks
    tokens = [call[1] for call in recorder.calls if call[0] == "after"]
    assert sum(tokens) == engine.stats()["num_computed_tokens"]  # every forward, each seen once
    assert all(rows >= 1 for hook, _, rows in recorder.calls if hook == "after")


def patched_engine_parts(path: Path) -> list[str]:
    """Assignments in a script to an attribute of one of an engine's parts (`engine.runner.execute = ...`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute) \
                    and target.value.attr in ENGINE_PARTS:
                found.append(f"{path.name}:{node.lineno} {ast.unparse(target)}")
    return found


def test_no_benchmark_patches_the_engine_parts() -> None:
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert scripts
    assert [hit for path in scripts for hit in patched_engine_parts(path)] == []


def test_the_patch_finder_finds_a_patch(tmp_path: Path) -> None:
    script = tmp_path / "bench.py"
    script.write_text("engine.runner.execute = wrapped\nengine.observers.append(recorder)\n")
    assert patched_engine_parts(script) == ["bench.py:1 engine.runner.execute"]
