"""One module per architecture; importing this package registers them all."""

from . import gpt2  # noqa: F401
