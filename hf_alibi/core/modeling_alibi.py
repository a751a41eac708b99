"""ALiBi models for transformers: the entry module that a converted checkpoint's ``auto_map`` names.

hf_alibi writes this file and the modules it imports (its ``core`` package, unchanged) into every
checkpoint it saves, so ``from_pretrained(..., trust_remote_code=True)`` runs the library's own code
without hf_alibi installed. It needs only torch and transformers, and registers nothing but new names
(``alibi_remote_<backend>`` attention functions). ``AlibiGPT2LMHeadModel``, ``AlibiGPT2Config``, ... are
made on first use from transformers' class of the same name (``conversion.class_by_name``); the
conversion they apply is the architecture row saved in config.json (``alibi.architecture``).
"""

from .conversion import class_by_name
from .dispatch import register_backends

register_backends()


def __getattr__(name: str) -> type:
    return class_by_name(name, __name__)
