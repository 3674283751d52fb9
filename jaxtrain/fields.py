"""Checks of single config fields, shared by every component that owns a config group.

Each failure is a ConfigError naming the field as '<group>.<key>', with the same wording everywhere.
"""

from __future__ import annotations

import math

from jaxtrain.errors import ConfigError


class Group:
    """One config group's values (a ConfigDict or dict), checked field by field."""

    def __init__(self, values, name: str):
        self.values, self.name = values, name

    def field(self, key: str) -> str:
        return f"{self.name}.{key}"

    def positive_int(self, key: str, allow_zero: bool = False) -> int:
        value = self.values[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
            raise ConfigError(self.field(key), f"must be a {'non-negative' if allow_zero else 'positive'} integer, "
                                               f"got {value!r}")
        return value

    def number(self, key: str, lo=None, hi=None, lo_open: bool = False) -> float:
        value = self.values[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(self.field(key), f"must be a finite number, got {value!r}")
        if lo is not None and (value < lo or (lo_open and value == lo)):
            raise ConfigError(self.field(key), f"must be {'>' if lo_open else '>='} {lo}, got {value!r}")
        if hi is not None and value > hi:
            raise ConfigError(self.field(key), f"must be <= {hi}, got {value!r}")
        return value

    def choice(self, key: str, choices, what: str = "value"):
        value = self.values[key]
        if value not in choices:
            raise ConfigError(self.field(key), f"unknown {what} {value!r}; choose one of {list(choices)}")
        return value

    def string(self, key: str) -> str:
        value = self.values[key]
        if not isinstance(value, str):
            raise ConfigError(self.field(key), f"must be a string, got {value!r}")
        return value
