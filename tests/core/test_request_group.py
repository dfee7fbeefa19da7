"""RequestGroup alone: the samples of one user request, the leader rule, when it is finished, best_of."""

from __future__ import annotations

from paged_backend.core.outputs import RequestMetrics
from paged_backend.core.request import Request, RequestStatus
from paged_backend.core.request_group import RequestGroup
from paged_backend.sampling.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10]


def make_sample(group: RequestGroup | None, name: str = "r", logprobs: bool = False) -> Request:
    params = SamplingParams(temperature=1.0, max_tokens=4, logprobs=0 if logprobs else None)
    return Request(name, None, list(PROMPT), params, 4, frozenset(), RequestMetrics(0.0), group=group,
                   logprobs=[] if logprobs else None)


def make_group(size: int, keep_best: int | None = None) -> RequestGroup:
    group = RequestGroup("user-id", keep_best)
    for index in range(size):
        make_sample(group, f"user-id#{index}")
    return group


def test_samples_join_their_group_in_construction_order():
    group = make_group(3)
    assert [s.request_id for s in group.samples] == ["user-id#0", "user-id#1", "user-id#2"]
    assert [s.index for s in group.samples] == [0, 1, 2]
    assert all(s.group is group for s in group.samples)
    assert group.leader is group.samples[0]


def test_a_request_made_without_a_group_is_a_group_of_one_under_its_own_id():
    request = make_sample(None, "solo")
    assert request.group.request_id == "solo"
    assert request.group.samples == [request] and request.index == 0
    assert not request.group.ranked


def test_later_samples_wait_until_the_leader_has_computed_the_prompt():
    group = make_group(3)
    leader, second, third = group.samples
    assert not group.waits_for_leader(leader)
    assert group.waits_for_leader(second) and group.waits_for_leader(third)
    leader.num_computed_tokens = len(PROMPT) - 1  # one prompt token short
    assert group.waits_for_leader(second)
    leader.num_computed_tokens = len(PROMPT)
    assert not group.waits_for_leader(second) and not group.waits_for_leader(third)


def test_later_samples_stop_waiting_for_a_leader_that_ended_early():
    group = make_group(2)
    group.leader.status = RequestStatus.FINISHED  # e.g. aborted before computing its prompt
    assert not group.waits_for_leader(group.samples[1])


def test_the_group_is_finished_only_when_every_sample_is():
    group = make_group(3)
    for sample in group.samples[:-1]:
        sample.status = RequestStatus.FINISHED
        assert not group.finished
    group.samples[-1].status = RequestStatus.FINISHED
    assert group.finished


def test_without_best_of_every_sample_is_selected_in_index_order():
    group = make_group(3)
    group.samples[2].cumulative_logprob = 10.0  # scores play no part
    assert group.selected() == group.samples
    assert not group.ranked and not group.samples[0].wants_logprob


def test_best_of_selects_the_best_mean_token_logprob_first_and_keeps_the_lower_index_on_ties():
    group = make_group(4, keep_best=2)
    # Ranked by mean logprob per generated token: by the sum, sample 0 (-0.9 over one token) would win.
    for sample, total, length in zip(group.samples, [-0.9, -2.0, -1.0, -1.0], [1, 2, 2, 2]):
        sample.cumulative_logprob = total
        sample.output_token_ids = [1] * length
    assert [s.index for s in group.selected()] == [2, 3]  # both -0.5: the lower index first
    group.samples[3].cumulative_logprob = -0.2
    assert [s.index for s in group.selected()] == [3, 2]


def test_a_ranked_group_makes_its_samples_want_their_logprob():
    """best_of ranks samples by their tokens' logprobs, so the sampler must report them even unasked."""
    group = make_group(2, keep_best=1)
    assert group.ranked and all(s.wants_logprob for s in group.samples)
    assert make_sample(None, logprobs=True).wants_logprob
