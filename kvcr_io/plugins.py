"""Plug-in classes named ``module:Class`` in a configuration (an eviction policy, a vLLM
block observer): imported and checked to be a subclass of the base they must extend before
anything of them runs, so ``os:getcwd`` is refused unrun."""

from __future__ import annotations

import importlib
from typing import TypeVar

T = TypeVar("T")


def load_class(name: str, base: type[T], what: str) -> type[T]:
    """The class ``name`` (``module:Class``) names, a subclass of ``base``; ``ValueError``
    starting with ``what`` when it cannot be imported or is not such a class."""
    module_name, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} cannot be loaded: {exc}") from exc
    if not isinstance(cls, type) or not issubclass(cls, base):
        article = "an" if base.__name__[:1] in "AEIOU" else "a"
        raise ValueError(f"{what} is not {article} {base.__name__} subclass (got {type(cls).__name__})")
    return cls
