"""N-gram prompt lookup: propose the tokens that followed the last n tokens where they occurred before.

Text that rewrites, summarises or corrects a given passage copies runs of it; when the request's last
n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) already occurred earlier in its prompt
or output, the tokens that followed the earliest such occurrence are a cheap guess at what comes next.
The search is one vectorised comparison over the request's tokens (numpy), no model involved.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, max_n: int, min_n: int, k: int) -> list[int]:
    """Up to `k` tokens following the earliest earlier occurrence of the longest matching suffix
    (of `max_n` down to `min_n` tokens) of `tokens`; [] when there is none."""
    length = len(tokens)
    if k < 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows start at 0 .. length - n - 1: each has at least one token after it, and the suffix
        # itself (starting at length - n) is excluded.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start : start + k].tolist()
    return []
