"""Namespace of the classes hf_alibi makes at registration (``AlibiGPT2LMHeadModel``,
``AlibiGPT2Config``, ...), so that they have an importable home. Filled by ``registry.py``."""
