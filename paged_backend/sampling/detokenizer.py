"""Streaming (incremental) detokenization of one request's output tokens.

The engine calls :meth:`IncrementalDetokenizer.update` with the tokens sampled in
each step and :meth:`IncrementalDetokenizer.take_delta` to get the text that is
safe to stream to the client.

Cost per step is independent of the output length:

* Decoding uses the prefix-offset / read-offset technique (as in vLLM/TGI): only
  ``tokens[prefix_offset:]`` and ``tokens[prefix_offset:read_offset]`` are decoded
  and the difference is the new text. Decoding a few tokens *before* the new ones
  matters because decoders are not context free (SentencePiece/Metaspace drops
  the leading space of the first token it sees; byte-level BPE needs all bytes of
  a multi-byte character).
* Stop strings are searched only in the new text plus the last
  ``max(len(stop)) - 1`` characters of the old text, which is enough to catch a
  stop string split across tokens.
* Holding back a possible stop-string prefix looks only at the unsent text (at
  most ``max(len(stop)) - 1`` characters plus one step's text).

Known deviation from ``tokenizer.decode(output_ids)``: decoding always passes
``clean_up_tokenization_spaces=False``. That clean-up (e.g. ``" ," -> ","``) is a
rewrite across token boundaries that is not prefix-stable, so it cannot be
streamed; it is off for byte-level BPE tokenizers such as SmolLM2's anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["IncrementalDetokenizer"]

# What byte-level BPE / byte-fallback decoders emit for an incomplete UTF-8 sequence.
REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context in front of the first output token, so that the
# first output token decodes as it would in the middle of the text (keeps its
# leading space with SentencePiece tokenizers).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, step by step.

    Invariants:
    * ``output_text`` = confirmed text + pending text. Confirmed text is final (a
      stop string can still cut it, but only the part not yet handed out).
      Pending text is the decoded text after ``read_offset``; it ends in U+FFFD
      because a multi-byte character is not complete yet, so it may still change.
    * Text handed out by :meth:`take_delta` is always a prefix of the final
      ``output_text``: pending text and a suffix that could start a stop string
      are held back until they are settled.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        # A bare str is a Sequence[str] of characters; treat it as one stop string.
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        # An empty stop string would match before any output; it cannot mean that.
        self._stops: tuple[str, ...] = tuple(s for s in stops if s)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # Every proper prefix of every stop string: the suffixes that must be held back.
        self._stop_prefixes = frozenset(s[:n] for s in self._stops for n in range(1, len(s)))

        self._token_ids: list[int] = self._select_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

        self._chunks: list[str] = []  # confirmed text, joined lazily (no O(n) copy per step)
        self._tail = ""  # last max_stop_len - 1 characters of the confirmed text
        self._pending = ""
        self._unsent = ""  # confirmed text not yet returned by take_delta
        self._done = False  # a stop string was found or the request was finished

    # ------------------------------------------------------------------ public API

    @property
    def output_text(self) -> str:
        """The full decoded output so far (truncated at a stop string)."""
        if len(self._chunks) > 1:
            # Cache the join so repeated reads stay cheap.
            self._chunks = ["".join(self._chunks)]
        confirmed = self._chunks[0] if self._chunks else ""
        return confirmed + self._pending

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append new tokens; return the stop string if one now ends the text."""
        if self._done or len(new_token_ids) == 0:
            # After a stop (or finish) the text is final: later tokens are ignored.
            return None
        self._token_ids.extend(int(t) for t in new_token_ids)
        old_tail = self._tail
        piece = self._decode_new_text()
        if not self._stops:
            self._confirm(piece)
            return None
        return self._apply_stop(old_tail, piece)

    def take_delta(self, finished: bool) -> str:
        """Return the not yet handed out text that can no longer change.

        With ``finished=True`` everything is released, including a U+FFFD whose
        character never completed, and the detokenizer accepts no more tokens.
        """
        if finished and not self._done:
            # The pending bytes will never complete: their U+FFFD is now final.
            self._confirm(self._pending)
            self._pending = ""
            self._done = True
        if self._done:
            delta, self._unsent = self._unsent, ""
            return delta
        cut = len(self._unsent) - self._held_stop_prefix_len(self._unsent)
        delta, self._unsent = self._unsent[:cut], self._unsent[cut:]
        return delta

    # ------------------------------------------------------------------ decoding

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,  # not prefix-stable; see module docstring
        )

    def _select_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """Pick the prompt tokens decoded in front of the output (maybe none)."""
        start = max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0)
        context = [int(t) for t in prompt_token_ids[start:]]
        # If the prompt ends inside a multi-byte character, the first output bytes
        # would complete a *prompt* character and the length difference would be
        # meaningless; decoding the output alone then matches decode(output_ids).
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _decode_new_text(self) -> str:
        """Decode the window; return newly confirmed text and set the pending text."""
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            # E.g. a skipped special token: nothing new, keep the window.
            self._pending = ""
            return ""
        if new_text.endswith(REPLACEMENT_CHAR):
            # A multi-byte character is still incomplete: do not advance, so the
            # next step decodes its bytes together with the rest of the character.
            self._pending = new_text[len(prefix_text) :]
            return ""
        self._pending = ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return new_text[len(prefix_text) :]

    # ------------------------------------------------------------------ text bookkeeping

    def _confirm(self, piece: str) -> None:
        """Append final text."""
        if not piece:
            return
        self._chunks.append(piece)
        self._unsent += piece
        keep = self._max_stop_len - 1
        # [-0:] would keep everything, hence the explicit empty tail.
        self._tail = (self._tail + piece)[-keep:] if keep > 0 else ""

    def _drop_confirmed_suffix(self, n_chars: int) -> None:
        """Remove the last n_chars of confirmed text (only ever unsent text)."""
        text = "".join(self._chunks)
        self._chunks = [text[: len(text) - n_chars]]
        self._unsent = self._unsent[: max(len(self._unsent) - n_chars, 0)]

    # ------------------------------------------------------------------ stop strings

    def _apply_stop(self, old_tail: str, piece: str) -> str | None:
        """Search the changed text for a stop string; truncate and finish if found."""
        # Trailing U+FFFD may still turn into another character, so only the text
        # before it is searched; the rest is searched once it is settled.
        window = old_tail + piece + self._pending.rstrip(REPLACEMENT_CHAR)
        match = self._find_stop(window)
        if match is None:
            self._confirm(piece)
            return None
        start, stop_str = match
        end = start + len(stop_str) if self._include_stop else start
        self._pending = ""
        if end >= len(old_tail):
            self._confirm(window[len(old_tail) : end])
        else:
            # The cut lies in text confirmed in an earlier step; it was held back
            # by take_delta because it is a prefix of this stop string.
            self._drop_confirmed_suffix(len(old_tail) - end)
        self._done = True
        return stop_str

    def _find_stop(self, window: str) -> tuple[int, str] | None:
        """Return (start, stop) of the match that ends first (ties: the longest).

        Ending first is what a character-by-character stream would see, so the
        result does not depend on how the text was split into tokens or steps.
        """
        best: tuple[int, int, str] | None = None
        for stop_str in self._stops:
            start = window.find(stop_str)
            if start < 0:
                continue
            candidate = (start + len(stop_str), start, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _held_stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        # Loops over stop-string lengths only, never over the whole text.
        for n in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            if text[-n:] in self._stop_prefixes:
                return n
        return 0
