"""Errors a caller can catch by type, defined apart so any module can raise them without import cycles."""


class UnsupportedArchitectureError(ValueError):
    """The model's architecture cannot run on the paged engine."""


class ContextLengthError(ValueError):
    """A prompt that, with the tokens it asks to generate, does not fit the engine's context: one wording
    (OpenAI's, which clients parse) for the engine, the server and every front end."""

    def __init__(self, limit: int, prompt_tokens: int, completion_tokens: int = 0, *, note: str = "",
                 what: str = "prompt") -> None:
        self.limit, self.prompt_tokens, self.completion_tokens = limit, prompt_tokens, completion_tokens
        self.note, self.what = note, what
        parts = f"{prompt_tokens} in the {what}"
        reduce = f"the {what}"
        if completion_tokens:
            parts += f", {completion_tokens} in the completion"
            reduce += " or of the completion"
        super().__init__(f"This model's maximum context length is {limit} tokens{note}. However, you requested "
                         f"{prompt_tokens + completion_tokens} tokens ({parts}). Please reduce the length of {reduce}.")

    def naming(self, what: str) -> "ContextLengthError":
        """The same refusal, naming the prompt as the caller's API calls it ("messages", "input")."""
        return ContextLengthError(self.limit, self.prompt_tokens, self.completion_tokens, note=self.note, what=what)


def check_context(limit: int, prompt_tokens: int, completion_tokens: int, *, note: str = "",
                  what: str = "prompt") -> None:
    """The context rule, written once: a prompt and the tokens it reserves for its completion fit `limit`.
    The engine reserves one token (it clips max_tokens to the room left); the server reserves max_tokens, as
    OpenAI's API does; pooling reserves none."""
    if prompt_tokens + completion_tokens > limit:
        raise ContextLengthError(limit, prompt_tokens, completion_tokens, note=note, what=what)
