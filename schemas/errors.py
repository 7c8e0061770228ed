"""The one exception family `schemas` raises for bad input."""

from __future__ import annotations

__all__ = ["RoutedExpertsError", "SchemaError"]


class SchemaError(ValueError):
    """A payload does not match the wire contract.

    `path` names the offending field the way msgspec does (`$.sampling.n`), or is None when the
    bytes are not a JSON document at all.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(f"{message} - at `{path}`" if path else message)
        self.message = message
        self.path = path


class RoutedExpertsError(SchemaError):
    """A routed-experts array or record is malformed (dtype, shape or byte length)."""
