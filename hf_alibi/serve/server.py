"""``hf-alibi serve MODEL [transformers serve options]``: a converted checkpoint, or a model trained with ALiBi
(BLOOM, MPT, Falcon-RW) on hf_alibi's attention, behind transformers' own OpenAI-compatible server (``transformers
serve``), with or without ``--continuous-batching``.

``transformers serve`` loads a model's class as ``getattr(transformers, config.architectures[0])`` and reads no
``auto_map`` (``--trust-remote-code`` reaches only the config and the tokenizer), so a converted checkpoint's
``AlibiLlamaForCausalLM`` is not found there. This entry point reads MODEL's config, adds that one class under its
own name to the ``transformers`` namespace of this server process (no transformers class is replaced), preloads
MODEL and hands every other argument to transformers' server unchanged. A model trained with ALiBi keeps its own
class name there: in this server process that name loads it and runs it on hf_alibi's paths (:func:`native_loader`;
transformers' own code of these three cannot run continuous batching). Every request is checked before transformers'
handlers read it, new tokens are capped (``--max-new-tokens-cap``), and a dead continuous-batching worker ends the
process in one line (:mod:`hf_alibi.serve.guard`, docs/engines.md)::

    hf-alibi serve ./my-alibi-llama --port 8000 --continuous-batching
    python -m hf_alibi serve ./my-alibi-llama --port 8000
"""

from __future__ import annotations

import sys

from ..hub.checkpoints import CheckpointError, is_alibi, read_config
from .request_checks import Limits

DEFAULTS = Limits()
EXTRAS_INSTALL = "pip install 'hf_alibi[serve]' (or transformers' own: pip install 'transformers[serving]')"


class MissingServingExtras(ImportError):
    """transformers' server needs packages (fastapi, uvicorn, openai, ...) that are not installed: one line."""


def serving_class(model: str) -> type:
    """The ``Alibi<Class>`` that loads the converted checkpoint ``model`` (folder or Hub id), resolvable as
    ``getattr(transformers, name)`` from now on in this process (what ``transformers serve``'s loader asks for).

    >>> hf_alibi.serve.serving_class("./my-alibi-llama").__name__  # doctest: +SKIP
    'AlibiLlamaForCausalLM'
    """
    from ..convert import models
    from ..convert.registry import get_native_architecture

    config = read_config(model, "MODEL")
    native = get_native_architecture(config.get("model_type", ""))
    if native is not None and native.uses_alibi(config):
        return _register(native_loader(config, model))
    if not is_alibi(config):
        raise CheckpointError(
            f"MODEL {model!r} is not an ALiBi checkpoint: serve the original with `transformers serve`, or convert "
            "it first with `hf-alibi convert`."
        )
    name = (config.get("architectures") or [None])[0]
    if not isinstance(name, str) or not name.startswith("Alibi"):
        raise CheckpointError(f"MODEL {model!r} names no Alibi class in config.json's architectures: re-save it.")
    return _register(getattr(models, name))


def _register(cls: type) -> type:
    name = cls.__name__
    # Looked up now, after the class was made: importing transformers' processing_utils (which modeling code does)
    # runs transformers/__init__.py again and puts a new module object in sys.modules, where the loader finds it.
    transformers = sys.modules["transformers"]
    if getattr(transformers, name, None) is not cls:
        # a new name, or (a model trained with ALiBi) its own name in this server process only: the classes stay
        setattr(transformers, name, cls)
    return cls


def native_loader(config: dict, model: str) -> type:
    """For a model trained with ALiBi (BLOOM, MPT, Falcon-RW: a folder in its original format), a subclass of its
    transformers class, under the same name, whose ``from_pretrained`` loads it with that class and runs it on
    hf_alibi's attention (``hf_alibi.patch_model``); the backend asked for (``--attn-implementation``) is set after
    that, since transformers' own class takes only eager."""
    import transformers

    from ..convert.patch import patch_model

    name = (config.get("architectures") or [None])[0]
    original = getattr(transformers, name, None) if isinstance(name, str) else None
    if original is None or not hasattr(original, "from_pretrained"):
        raise CheckpointError(
            f"MODEL {model!r} names no transformers class in config.json's architectures: re-save it."
        )
    original = getattr(original, "_served_original", original)  # registered by an earlier call in this process
    served = _NATIVE_SERVING.get(original)
    if served is not None:  # one class per original (serve() asks twice)
        return served

    class NativeServing(original):
        _served_original = original

        @classmethod
        def from_pretrained(cls, *args, attn_implementation=None, **kwargs):
            loaded = patch_model(original.from_pretrained(*args, **kwargs))
            if attn_implementation is not None:
                loaded.set_attn_implementation(attn_implementation)
            return loaded

    NativeServing.__name__ = NativeServing.__qualname__ = original.__name__
    _NATIVE_SERVING[original] = NativeServing
    return NativeServing


_NATIVE_SERVING: dict[type, type] = {}  # transformers' class of a model trained with ALiBi -> its serving subclass


# transformers' server whose requests guard.py checks and bounds (tests/serve/test_serve_guard.py): on 5.19 (vLLM's CPU
# pin) a completion's max_tokens was seen not honoured behind the guard, so the cap would not hold there
SERVER_CHECKED = "5.24"


def check_server_version() -> None:
    """One-line refusal where transformers' server is older than the one :mod:`hf_alibi.serve.guard` was checked on."""
    from packaging.version import Version
    from transformers import __version__

    if Version(__version__) < Version(SERVER_CHECKED):
        raise MissingServingExtras(
            f"hf-alibi serve checks and bounds requests for transformers {SERVER_CHECKED}'s server or newer, and "
            f"this is transformers {__version__}: pip install 'transformers>={SERVER_CHECKED}', or serve with "
            "--engine vllm."
        )


def serve(model: str, arguments: list[str], limits: Limits = DEFAULTS) -> None:
    """Run ``transformers serve MODEL *arguments`` with the converted ``model``'s class resolvable, every request
    checked and bounded first (``limits``: new and prompt tokens, body bytes, read and idle timeouts, which the
    command line reads from ``hf-alibi serve``'s flags), and the process ended if the continuous-batching worker dies
    (:mod:`hf_alibi.serve.guard`, :mod:`hf_alibi.serve.connections`)."""
    from .compat import serving_available, transformers_cli_app, wrap_server_builder
    from .connections import bound_connections
    from .guard import guarded_build_server, say, start_lines

    if not serving_available():  # before MODEL loads: transformers' server would raise this after it
        raise MissingServingExtras(f"hf-alibi serve needs transformers' serving extras: {EXTRAS_INSTALL}.")
    check_server_version()
    serving_class(model)  # first: making the class may replace sys.modules["transformers"] (see serving_class)
    app = transformers_cli_app()  # its modules bind the transformers module that now holds the name
    serving_class(model)
    try:  # the requests' checks read prompts with it (transformers' server loads its own after this)
        tokenizer = sys.modules["transformers"].AutoTokenizer.from_pretrained(
            model, trust_remote_code="--trust-remote-code" in arguments
        )
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"MODEL {model!r} has no tokenizer that loads ({reason}): a server needs one; save it in the folder."
        ) from None
    for line in start_lines(tokenizer, limits):
        say(line)
    wrap_server_builder(lambda build_server: guarded_build_server(build_server, tokenizer, limits, model))
    bound_connections(limits)
    app(args=["serve", model, *arguments], prog_name="hf-alibi")
