"""StateSlots: which row of the recurrent-state tensors each running request of a hybrid model owns.

A hybrid model (attention layers beside recurrent ones: short convolutions, Mamba-2 mixers) keeps, besides
its paged K/V, a fixed-size state per sequence and recurrent layer: the last few inputs of a convolution,
a state-space matrix. Its size does not grow with the sequence, so it is not paged: the state tensors have
one row per request that can run at once (`max_num_seqs`), and a request holds one row, its slot, from the
step it first gets blocks until its blocks are freed (finish, abort, a failed step, preemption). A
preempted request recomputes its state from its tokens when it runs again, as it recomputes its K/V.

A new slot holds whatever its last owner left: the mixers read it only for a sequence that has computed
tokens already (a chunk continuing a prefill, a decode step), and start from zeros otherwise, so nothing
needs clearing here.
"""

from __future__ import annotations


class StateSlots:
    """A free list of `num_slots` slot numbers, lowest first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: a hybrid model needs at least one state slot")
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int:
        """A free slot; RuntimeError if none is (the scheduler runs at most `num_slots` requests at once)."""
        if not self.free_slots:
            raise RuntimeError(f"all {self.num_slots} recurrent state slots are in use: more requests run than "
                               "max_num_seqs")
        return self.free_slots.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self.free_slots:
            raise ValueError(f"state slot {slot} is not in use")
        self.free_slots.append(slot)
