"""hf_alibi's per-architecture registry: the built-in rows, one file per strategy.

Installed as ``hf_alibi.patches`` (pyproject.toml maps this folder there); in a source checkout
``hf_alibi/patches/__init__.py`` points the same name here. Each module holds ``ROWS``, a list of
:class:`hf_alibi.Architecture` (plain data: where the position path and the self-attention modules
are). ``hf_alibi.convert.registry`` registers them at import; ``hf_alibi.core`` never reads this package,
since every converted checkpoint carries its own row in config.json.
"""
