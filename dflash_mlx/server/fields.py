"""The field checks every dialect's parser shares: typed access naming the field, lists, reasoning levels.

`Fields` reads a body's fields with types and bounds (a `RequestError` naming
the field, nested names included); `listed` a list field; `reasoning_args`
maps a request's reasoning level (``--reasoning``'s levels; `EFFORTS` maps
OpenAI's efforts onto them) onto the chat template's switch.
"""

from __future__ import annotations

import math

from .errors import RequestError

# OpenAI's reasoning efforts (reasoning_effort, reasoning.effort) -> the levels of ``--reasoning``
EFFORTS = {
    "none": "off",
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "xhigh",
    "max": "xhigh",
}


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite number a float holds (an integer beyond a float's range is not one)."""
    if not (is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class Fields:
    """Typed access to a body's fields; each getter validates and names the field on error (its
    name after `prefix`, for a nested object: "thinking." names "thinking.budget_tokens")."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body, self.prefix = body, prefix

    def get(self, name, default=None):
        value = self.body.get(name)
        return default if value is None else value

    def number(self, name, default, low=None, high=None, *, low_open=False):
        value, where = self.get(name, default), self.prefix + name
        if not is_number(value):
            raise RequestError(where, f"expected a number, got {value!r}")
        if low is not None and (value < low or (low_open and value == low)):
            raise RequestError(where, f"must be {'>' if low_open else '>='} {low}, got {value!r}")
        if high is not None and value > high:
            raise RequestError(where, f"must be <= {high}, got {value!r}")
        return float(value)  # (MLX cannot take a Python integer beyond 64 bits)

    def integer(self, name, default, low=None, high=None):
        value, where = self.get(name, default), self.prefix + name
        if value is not None and not is_int(value):
            raise RequestError(where, f"expected an integer, got {value!r}")
        if value is not None and low is not None and value < low:
            raise RequestError(where, f"must be >= {low}, got {value!r}")
        if value is not None and high is not None and value > high:
            raise RequestError(where, f"must be <= {high}, got {value!r}")
        return value

    def boolean(self, name, default=False):
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise RequestError(self.prefix + name, f"expected true or false, got {value!r}")
        return value

    def mapping(self, name):
        value = self.get(name, {})
        if not isinstance(value, dict):
            raise RequestError(self.prefix + name, f"expected an object, got {value!r}")
        return value

    def string(self, name, default=None, choices=None):
        """A string field (None when absent and no default), one of `choices` when given."""
        value = self.get(name, default)
        if value is not None and not isinstance(value, str):
            raise RequestError(self.prefix + name, f"expected a string, got {value!r}")
        if value is not None and choices is not None and value not in choices:
            raise RequestError(self.prefix + name, f"expected one of {', '.join(map(repr, choices))}, got {value!r}")
        return value

    def unknown(self, known) -> None:
        """Refuse the first field not in `known`."""
        extra = sorted(set(self.body) - set(known))
        if extra:
            raise RequestError(self.prefix + extra[0], "unknown field (not supported by this server)")


def listed(value, name: str, what: str) -> list:
    """`value` as a list ([] for None, a `RequestError` naming `name` for anything else)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(name, f"expected a list of {what}, got {value!r}")
    return value


def reasoning_args(info, level: str, name: str) -> dict:
    """The chat template arguments that switch reasoning to `level` (``--reasoning``'s levels) for a
    request's field `name`; {} when the template has no switch (the field then changes nothing). A template
    switched on or off takes any effort as "on"."""
    switch = info.reasoning.get(level, {})
    if isinstance(switch, str) and level != "off" and "enable_thinking" in info.reasoning.get("on", ()):
        switch = info.reasoning["on"]
    if isinstance(switch, str):
        raise RequestError(name, switch)
    return switch
