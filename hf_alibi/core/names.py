"""The names a user and the config code pass around: the bias forms, a converted model's type (``alibi_<type>``,
:func:`is_alibi`), and the attention implementation names hf_alibi registers (``alibi_<backend>``, or
``alibi_remote_<backend>`` for a checkpoint's copy of this code), with the backends' table (``kernels.py``) that
:func:`check_backend` reads. Kept apart from the kernels' code, importing only that torch-free table, so that the
config code, the settings and the command line's parser can name them without importing torch."""

from __future__ import annotations

from collections.abc import Mapping

# the kernel table (torch-free too): each backend's abilities, written once; re-exported for the config code
from .kernels import _ALL_FORMS, REFUSED_BACKENDS, RUNNING_BACKENDS, WHAT_RUNS, check_backend  # noqa: F401

# the bias forms (slopes.py builds each): causal self-attention, and the bidirectional (encoder) variants
CAUSAL = "causal"
SYMMETRIC = "symmetric"
NONSYMMETRIC = "nonsymmetric"
LEARNED = "learned"
ENCODER_VARIANTS = (SYMMETRIC, NONSYMMETRIC, LEARNED)
BIAS_KINDS = (CAUSAL, *ENCODER_VARIANTS)
if BIAS_KINDS != _ALL_FORMS:  # kernels.py spells them to import nothing
    raise ImportError("hf_alibi: kernels.py's forms must be names.BIAS_KINDS")

LIBRARY_PREFIX, REMOTE_PREFIX = "alibi_", "alibi_remote_"
MODEL_TYPE_PREFIX = "alibi_"  # a converted model's type: alibi_<type>
# transformers' names for the longest input a config states, in the order a config is read (the outer layer's
# hf_alibi.convert.planning.original_length reads them without torch)
LENGTH_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx")
# what a stored name that no hf_alibi path knows is dispatched to (an engine that wrote it past the setter)
FOREIGN = "foreign"
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


# Where a config keeps the one other engine allowed to run its model (:func:`grant_engine`); never saved
ENGINE_GRANT = "_alibi_engine"


def grant_engine(config, name: str) -> None:
    """Let this one config's model run with another engine's attention function ``name`` (vLLM's ``"vllm"``): only
    the code that has handed that engine's kernels the model's slopes calls this (``hf_alibi.serve.vllm``), so the
    engine applies the bias itself. Every other config, and this one under any other unknown name, is still refused
    (:func:`check_backend`). In memory only: ``to_dict`` and config.json never carry it."""
    config.__dict__[ENGINE_GRANT] = name


def granted_engine(config) -> str | None:
    """The engine :func:`grant_engine` allowed for ``config``, or None."""
    return getattr(config, "__dict__", {}).get(ENGINE_GRANT)


def is_alibi(model_or_config) -> bool:
    """Whether a model was converted by hf_alibi (or loaded from such a checkpoint), or a config is such a model's:
    a model, a ``PretrainedConfig`` or config.json as a dict, with an ``alibi`` field and a model_type
    ``alibi_<type>``. The one rule. It answers "was this converted", not "does this model use ALiBi": a model trained
    with ALiBi (BLOOM, MPT, Falcon-RW) keeps its own format and config, patched or not, so it is False for one; whether
    such a model runs on hf_alibi's attention (``patch_model`` was called on it) is ``hf_alibi.native.is_native``.

    >>> is_alibi({"model_type": "alibi_gpt2", "alibi": {"heads": 12}}), is_alibi({"model_type": "gpt2"})
    (True, False)
    """
    config = model_or_config
    if not isinstance(config, Mapping):
        config = getattr(config, "config", config)  # a model's
    if isinstance(config, Mapping):
        alibi, model_type = config.get("alibi"), config.get("model_type", "")
    else:
        alibi, model_type = getattr(config, "alibi", None), getattr(config, "model_type", "")
    return alibi is not None and str(model_type).startswith(MODEL_TYPE_PREFIX)
