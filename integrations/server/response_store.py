"""ResponseStore: the responses `/v1/responses` keeps so that a later request can continue from one
(`previous_response_id`) or read it back (`GET /v1/responses/{id}`).

It lives in the server's memory, bounded by a number of responses: past `max_responses` the least
recently used one (created or continued from) is forgotten, and a request naming it gets a 400 as for
an id that never existed. Each entry holds the response object and the conversation up to and including
it, as chat messages (the instructions excluded: OpenAI does not carry them over either), so a chain of
any length is one lookup. A restart forgets everything.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was returned
    conversation: list[dict[str, Any]]  # chat messages: the inputs so far and this response's output


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_responses < 0:
            raise ValueError(f"max_responses must be >= 0, got {max_responses}")
        self.max_responses = max_responses
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.lock = threading.Lock()  # routes run on one loop, but GET and tests may come from elsewhere

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.max_responses == 0:
            return
        entry = StoredResponse(copy.deepcopy(response), copy.deepcopy(conversation))
        with self.lock:
            self.entries[response["id"]] = entry
            self.entries.move_to_end(response["id"])
            while len(self.entries) > self.max_responses:
                self.entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (a copy the caller may change), marked as recently used; None when unknown or evicted."""
        with self.lock:
            entry = self.entries.get(response_id)
            if entry is None:
                return None
            self.entries.move_to_end(response_id)
        return StoredResponse(copy.deepcopy(entry.response), copy.deepcopy(entry.conversation))

    def delete(self, response_id: str) -> bool:
        with self.lock:
            return self.entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self.entries)
