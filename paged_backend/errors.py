"""Errors a caller can catch by type, defined apart so any module can raise them without import cycles."""


class UnsupportedArchitectureError(ValueError):
    """The model's architecture cannot run on the paged engine."""
