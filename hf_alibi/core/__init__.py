"""The code an ALiBi checkpoint runs: hf_alibi's core, copied unchanged into every saved folder.

Every module here imports only torch, transformers, the standard library and its siblings, with
flat relative imports (``from .slopes import get_slopes``). transformers' dynamic-module loader
follows such imports, so ``save_pretrained`` writes ``modeling_alibi.py`` (the entry module that
``auto_map`` names) and the files it imports, byte for byte, and ``trust_remote_code=True`` runs the
same code as the library. This ``__init__`` is the one file of the folder that is not copied.
"""
