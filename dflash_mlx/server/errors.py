"""The error a request field raises: HTTP 400 (or `status`) naming the field."""

from __future__ import annotations


class RequestError(ValueError):
    """A request field that cannot be served; `field` names it."""

    def __init__(self, field: str | None, message: str, status: int = 400):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.status = status
