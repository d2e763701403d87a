"""Incremental detokenization (for streaming and stop strings) in O(window) per token, as vLLM does it: decode the
new tokens together with the previously read ones (so leading spaces and merges render as in the full text) and
emit what they add, holding back text that ends in an incomplete character."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._stop_scan_from = 0  # where an unseen stop string could begin
        self._emitted = 0  # characters of `text` already handed out by pop_new_text()
        # While running, hold back text that could be the start of a stop string, so nothing streamed is retracted.
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the new text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = decode(self.token_ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # a multi-byte character is still incomplete
        delta = full[len(prefix) :]
        # The tokens just read become the next call's context window.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def truncate_at_stop(self) -> bool:
        """If a stop string has appeared, cut the text before it and return True."""
        if not self.stop:
            return False
        hits = [i for s in self.stop if (i := self.text.find(s, self._stop_scan_from)) >= 0]
        self._stop_scan_from = max(0, len(self.text) - self._holdback)
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def pop_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while running, the tail that could still become a stop string stays back."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        new = self.text[self._emitted : end]
        self._emitted = end
        return new
