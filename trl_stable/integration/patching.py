"""Replacing a method on one instance for the duration of a call, and nothing else."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def wrapped_method(obj: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Replace ``obj.<name>`` by ``wrap(original)`` on this instance only, and restore it on exit (also on error): an
    attribute the instance had is put back, one it only inherited is deleted again, so the class is never touched."""
    had_instance_attr = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, wrap(original))
    try:
        yield
    finally:
        if had_instance_attr:
            setattr(obj, name, original)
        else:
            delattr(obj, name)
