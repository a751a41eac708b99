"""Sharing converted checkpoints: remote code, ``auto_map``, the model card and the Hub upload.

Every folder an ALiBi model is saved to (``save_pretrained``, ``push_to_hub``, ``hf-alibi convert``)
also gets:

* ``modeling_alibi.py`` and the modules it imports: hf_alibi's own ``core`` package, byte for byte
  (the entry module and its flat relative imports), and ``auto_map`` in config.json pointing at it,
  so that people without hf_alibi can load the checkpoint with ``trust_remote_code=True``;
* ``README.md``: a model card with the Hub's metadata header (kept when the folder already has one).

:class:`AlibiPreTrainedMixin` is the base of every ``Alibi<Class>`` made by the registry; it routes
``save_pretrained`` and ``push_to_hub`` through this module, so they keep the settings and the code.

Modules, one job each: ``remote_code`` (the copied core files and ``auto_map``), ``card`` (README.md),
``upload`` (:func:`push_folder`), ``folder`` (:func:`write_converted`: what convert and recover write,
SRC's companion files kept), ``saving`` (:func:`finish_folder` and the mixin; the registry imports
only this one). The names below are loaded from them on first use, so importing the mixin does not
load the card or upload code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

_HOMES = {
    "REMOTE_CODE_FILE": "remote_code",
    "REMOTE_MODULE": "remote_code",
    "add_remote_code": "remote_code",
    "auto_classes_for": "remote_code",
    "auto_map_for": "remote_code",
    "remote_code_files": "remote_code",
    "PIPELINE_TAGS": "card",
    "model_card": "card",
    "write_model_card": "card",
    "HubConnectionError": "upload",
    "push_folder": "upload",
    "AlibiPreTrainedMixin": "saving",
    "finish_folder": "saving",
    "companion_files": "folder",
    "copy_companions": "folder",
    "lift_length_limits": "folder",
    "select_companions": "folder",
    "write_converted": "folder",
    "checkpoint_info": "info",
    "learned_slopes": "info",
}
__all__ = [
    "AlibiPreTrainedMixin",
    "HubConnectionError",
    "PIPELINE_TAGS",
    "REMOTE_CODE_FILE",
    "REMOTE_MODULE",
    "add_remote_code",
    "auto_classes_for",
    "auto_map_for",
    "checkpoint_info",
    "companion_files",
    "copy_companions",
    "finish_folder",
    "learned_slopes",
    "lift_length_limits",
    "model_card",
    "push_folder",
    "remote_code_files",
    "select_companions",
    "write_converted",
    "write_model_card",
]

if TYPE_CHECKING:
    from .card import PIPELINE_TAGS, model_card, write_model_card
    from .folder import companion_files, copy_companions, lift_length_limits, select_companions, write_converted
    from .info import checkpoint_info, learned_slopes
    from .remote_code import (
        REMOTE_CODE_FILE,
        REMOTE_MODULE,
        add_remote_code,
        auto_classes_for,
        auto_map_for,
        remote_code_files,
    )
    from .saving import AlibiPreTrainedMixin, finish_folder
    from .upload import HubConnectionError, push_folder


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
