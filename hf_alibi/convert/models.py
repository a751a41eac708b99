"""Namespace of the classes hf_alibi makes at registration (``AlibiGPT2LMHeadModel``,
``AlibiGPT2Config``, ...), so that they have an importable home."""

from .registry import class_named


def __getattr__(name: str) -> type:
    cls = class_named(name)
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return cls
