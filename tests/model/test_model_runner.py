"""ModelRunner alone: a scheduled batch packed into one forward's inputs (checked against values worked
out by hand), and that forward on a tiny model against the model's own dense forward."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from helpers.models import build
from helpers.tolerances import tolerance

from paged_backend.config import EngineConfig
from paged_backend.core.outputs import RequestMetrics
from paged_backend.core.request import Request
from paged_backend.core.scheduler_output import SchedulerOutput
from paged_backend.engine import Engine
from paged_backend.model.model_runner import ModelRunner
from paged_backend.model.step_inputs import StepInputs
from paged_backend.sampling.sampling_params import SamplingParams

BLOCK = 4


def make_request(name: str, prompt: list[int], computed: int, block_ids: list[int] | None = None,
                 output: list[int] | None = None) -> Request:
    request = Request(name, None, prompt, SamplingParams(max_tokens=8), 8, frozenset(), RequestMetrics(0.0))
    request.output_token_ids = list(output or [])
    request.num_computed_tokens = computed
    request.block_ids = list(block_ids or [])
    return request


def packing_runner() -> ModelRunner:
    """A runner whose packing needs only the block size and the device: no model, no cache tensors."""
    return ModelRunner(None, SimpleNamespace(block_size=BLOCK, kv=torch.zeros(1), kv_scales=None, grouped=False))


def test_a_mixed_batch_is_packed_into_hand_computed_inputs():
    # decode: 6 prompt tokens and 1 output computed up to position 6, which it computes now
    decode = make_request("decode", list(range(10, 16)), 6, [3, 5], output=[20])
    # a middle prefill chunk: positions 4..8 of a 10-token prompt (does not sample)
    chunk = make_request("chunk", list(range(40, 50)), 4, [7, 2, 9])
    # a whole 3-token prompt (samples)
    whole = make_request("whole", [60, 61, 62], 0, [1])
    inputs = packing_runner().prepare_inputs(SchedulerOutput([decode, chunk, whole], [1, 5, 3], []))
    meta = inputs.metadata
    assert inputs.input_ids.tolist() == [[20, 44, 45, 46, 47, 48, 60, 61, 62]]
    assert inputs.position_ids.tolist() == [[6, 4, 5, 6, 7, 8, 0, 1, 2]]
    # slot = block_table[position // 4] * 4 + position % 4
    assert meta.slot_mapping.tolist() == [5 * 4 + 2, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 0,
                                          1 * 4 + 0, 1 * 4 + 1, 1 * 4 + 2]
    assert meta.block_tables.tolist() == [[3, 5, 0], [7, 2, 9], [1, 0, 0]]
    assert meta.seq_lens.tolist() == meta.seq_lens_host == [7, 9, 3]
    assert meta.query_start_loc.tolist() == meta.query_start_loc_host == [0, 1, 6, 9]
    assert (meta.max_query_len, meta.max_seq_len) == (5, 9)
    assert inputs.logits_indices.tolist() == [0, 8]  # the last row of each request that reaches its end
    assert inputs.sampling_requests == [decode, whole]


def test_proposed_tokens_are_packed_after_the_last_token_and_each_keeps_a_logits_row():
    prefill = make_request("prefill", [1, 2, 3, 4, 5], 0, [0, 1])
    speculating = make_request("spec", [7, 8, 9], 3, [4, 6], output=[10])
    speculating.spec_token_ids = [11, 12]
    inputs = packing_runner().prepare_inputs(SchedulerOutput([prefill, speculating], [5, 3], []))
    assert inputs.input_ids.tolist() == [[1, 2, 3, 4, 5, 10, 11, 12]]
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5]]
    assert inputs.metadata.slot_mapping.tolist() == [0, 1, 2, 3, 4, 4 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1]
    assert inputs.logits_indices.tolist() == [4, 5, 6, 7]  # the prefill's last, then one per speculated position
    assert inputs.sampling_requests == [prefill, speculating]


def test_a_step_of_only_partial_chunks_keeps_one_logits_row_and_samples_nothing():
    chunk = make_request("chunk", list(range(12)), 0, [0, 1])
    inputs = packing_runner().prepare_inputs(SchedulerOutput([chunk], [6], []))
    assert inputs.sampling_requests == [] and inputs.logits_indices.tolist() == [5]


def test_the_packed_forward_gives_the_dense_forward_logits_at_the_kept_positions():
    """Two steps of a tiny Llama through the runner: a whole prompt with the first chunk of another,
    then a decode with that prompt's last chunk. Each kept row equals the dense forward of the same
    sequence at that position (prefill, chunked prefill and decode in one packed row)."""
    model = build("llama")
    short, long = [3, 14, 15, 92, 65, 35], [89, 79, 32, 38, 46, 26, 43, 38, 32]
    new_token = 17
    with torch.no_grad():
        dense_short = model(torch.tensor([short + [new_token]])).logits[0]
        dense_long = model(torch.tensor([long])).logits[0]
    engine = Engine(model, None, EngineConfig(block_size=BLOCK, num_kv_blocks=16, enable_prefix_caching=False))
    a, b = make_request("a", list(short), 0), make_request("b", list(long), 0)

    def run(requests: list[Request], counts: list[int]) -> tuple[torch.Tensor, StepInputs]:
        for request, n in zip(requests, counts):
            assert engine.kv.allocate_slots(request, n)
        with torch.inference_mode():
            logits, inputs = engine.runner.execute(SchedulerOutput(requests, counts, []))
        for request, n in zip(requests, counts):
            request.num_computed_tokens += n
        return logits, inputs

    logits, inputs = run([a, b], [6, 5])
    assert inputs.sampling_requests == [a] and logits.shape[0] == 1
    torch.testing.assert_close(logits[0], dense_short[5], **tolerance(torch.float32, "forward"))
    a.output_token_ids.append(new_token)
    logits, inputs = run([a, b], [1, 4])
    assert inputs.sampling_requests == [a, b]
    torch.testing.assert_close(logits[0], dense_short[6], **tolerance(torch.float32, "forward"))
    torch.testing.assert_close(logits[1], dense_long[8], **tolerance(torch.float32, "forward"))
