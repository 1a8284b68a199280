"""The error a request field raises: HTTP 400 (or `status`) naming the field."""

from __future__ import annotations

MAX_MESSAGE = 1000  # characters: a message quoting a client's value never echoes a huge body back


class RequestError(ValueError):
    """A request field that cannot be served; `field` names it."""

    def __init__(self, field: str | None, message: str, status: int = 400):
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.status = status
