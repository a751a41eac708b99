"""Namespace of the classes hf_alibi makes at registration (``AlibiGPT2LMHeadModel``,
``AlibiGPT2Config``, ...), so that they have an importable home."""


def __getattr__(name: str) -> type:
    from .registry import class_named

    cls = class_named(name)
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return cls
