"""One module per architecture; importing this package registers them all."""

from . import bert, gpt2, gpt_neox, t5  # noqa: F401
