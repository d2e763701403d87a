"""What a client asks the engine to continue: text, token ids or a chat conversation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """Exactly one of: text, token ids, chat messages (formatted with the model's chat template)."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None

    @classmethod
    def of(cls, prompt: str | list[int]) -> Prompt:
        return cls(text=prompt) if isinstance(prompt, str) else cls(token_ids=list(prompt))
