"""The attention implementation names hf_alibi registers: ``alibi_<backend>``, or ``alibi_remote_<backend>``
for a checkpoint's copy of this code. Kept apart from the kernels so that the config code can name
backends without importing them."""

from __future__ import annotations

LIBRARY_PREFIX, REMOTE_PREFIX = "alibi_", "alibi_remote_"
# this copy's prefix: the library's own core, or the remote code a checkpoint carries
PREFIX = LIBRARY_PREFIX if __name__.startswith("hf_alibi.") else REMOTE_PREFIX


def alibi_name(backend: str | None) -> str | None:
    """``"sdpa"`` -> ``"alibi_sdpa"`` (this copy's prefix); already prefixed names and ``None`` pass through.

    >>> alibi_name("sdpa") in ("alibi_sdpa", "alibi_remote_sdpa")
    True
    """
    if backend is None or backend.startswith(LIBRARY_PREFIX):
        return backend
    return PREFIX + backend


def base_name(name: str | None) -> str | None:
    """``"alibi_sdpa"`` or ``"alibi_remote_sdpa"`` -> ``"sdpa"``.

    >>> base_name("alibi_remote_sdpa")
    'sdpa'
    """
    if name is None:
        return None
    return name.removeprefix(REMOTE_PREFIX).removeprefix(LIBRARY_PREFIX)
