"""``hf-alibi serve MODEL [transformers serve options]``: a converted checkpoint behind transformers' own
OpenAI-compatible server (``transformers serve``), with or without ``--continuous-batching``.

``transformers serve`` loads a model's class as ``getattr(transformers, config.architectures[0])`` and reads no
``auto_map`` (``--trust-remote-code`` reaches only the config and the tokenizer), so a converted checkpoint's
``AlibiLlamaForCausalLM`` is not found there. This entry point reads MODEL's config, adds that one class under its
own name to the ``transformers`` namespace of this server process (no transformers class is replaced), preloads
MODEL and hands every other argument to transformers' server unchanged::

    hf-alibi serve ./my-alibi-llama --port 8000 --continuous-batching
    python -m hf_alibi serve ./my-alibi-llama --port 8000
"""

from __future__ import annotations

import sys

from .checkpoints import CheckpointError, is_alibi, read_config

EXTRAS_INSTALL = "pip install 'hf_alibi[serve]' (or transformers' own: pip install 'transformers[serving]')"


class MissingServingExtras(ImportError):
    """transformers' server needs packages (fastapi, uvicorn, openai, ...) that are not installed: one line."""


def serving_class(model: str) -> type:
    """The ``Alibi<Class>`` that loads the converted checkpoint ``model`` (folder or Hub id), resolvable as
    ``getattr(transformers, name)`` from now on in this process (what ``transformers serve``'s loader asks for).

    >>> hf_alibi.serve.serving_class("./my-alibi-llama").__name__  # doctest: +SKIP
    'AlibiLlamaForCausalLM'
    """
    from . import models

    config = read_config(model, "MODEL")
    if not is_alibi(config):
        raise CheckpointError(
            f"MODEL {model!r} is not an ALiBi checkpoint: serve the original with `transformers serve`, or convert "
            "it first with `hf-alibi convert`."
        )
    name = (config.get("architectures") or [None])[0]
    if not isinstance(name, str) or not name.startswith("Alibi"):
        raise CheckpointError(f"MODEL {model!r} names no Alibi class in config.json's architectures: re-save it.")
    cls = getattr(models, name)
    # Looked up now, after the class was made: importing transformers' processing_utils (which modeling code does)
    # runs transformers/__init__.py again and puts a new module object in sys.modules, where the loader finds it.
    transformers = sys.modules["transformers"]
    if getattr(transformers, name, None) is not cls:
        setattr(transformers, name, cls)  # a new name only: transformers' own classes stay as they are
    return cls


def serve(model: str, arguments: list[str]) -> None:
    """Run ``transformers serve MODEL *arguments`` with the converted ``model``'s class resolvable."""
    from .core.compat import serving_available, transformers_cli_app

    if not serving_available():  # before MODEL loads: transformers' server would raise this after it
        raise MissingServingExtras(f"hf-alibi serve needs transformers' serving extras: {EXTRAS_INSTALL}.")
    serving_class(model)  # first: making the class may replace sys.modules["transformers"] (see serving_class)
    app = transformers_cli_app()  # its modules bind the transformers module that now holds the name
    serving_class(model)
    app(args=["serve", model, *arguments], prog_name="hf-alibi")
