"""``hf-alibi info`` as a library function: what a checkpoint folder or Hub id holds (:func:`checkpoint_info`), and
the learned encoder slopes saved in a folder (:func:`learned_slopes`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..convert.registry import get_native_architecture, supported_model_types
from ..core.settings import AlibiSettings
from .checkpoints import CheckpointError, is_alibi, open_source


def checkpoint_info(path: str) -> dict:
    """What ``hf-alibi info`` reports about a checkpoint folder or Hub id, as a dict: ``alibi``, config.json's
    settings as saved; the same settings flattened (``slopes_given``: explicit slopes or None) and ``slopes``, the
    slopes in use.

    >>> checkpoint_info("gpt2-alibi")["heads"]  # doctest: +SKIP
    12
    """
    source = open_source(path, label="PATH")
    config_dict, model_type, local = source.config, source.config["model_type"], source.local
    info = {
        "path": path,
        "model_type": model_type,
        "architectures": config_dict.get("architectures"),
        "is_alibi": is_alibi(config_dict),
    }
    if info["is_alibi"]:
        settings = AlibiSettings.from_dict(config_dict["alibi"])
        info["alibi"] = settings.to_dict()  # as config.json has them: what describes the options, unrenamed
        info.update(info["alibi"])
        info["slopes_given"] = settings.slopes  # explicit slopes (--slopes), else None
        info["slopes"] = settings.slopes_in_use()  # in use
        info["remote_code"] = sorted(set((config_dict.get("auto_map") or {}).values()))
        if local:
            info["remote_code_file"] = (Path(path) / "modeling_alibi.py").is_file()
        if settings.encoder_variant == "learned":
            info["learned_slopes"] = learned_slopes(path) if local else None
    else:
        info["convertible"] = model_type in supported_model_types()
        native = get_native_architecture(model_type)  # trained with ALiBi: run as it is, not converted
        info["native_alibi"] = native is not None and native.uses_alibi(config_dict)
    if local:
        info["tokenizer"] = source.has_tokenizer()
    return info


LEARNED_SUFFIXES = (".alibi.slopes_left", ".alibi.slopes_right")


def learned_slopes(path: str | os.PathLike) -> dict[str, dict[str, list[float]]]:
    """The learned encoder slopes saved in a checkpoint folder, per layer: ``-sigmoid`` of the saved
    ``...alibi.slopes_left`` / ``slopes_right`` parameters (the bias is ``left * (i - j)`` for keys at or
    left of the query, ``right * (j - i)`` right of it). Keys are the layers' parameter prefixes."""
    import torch
    from safetensors import safe_open

    folder = Path(path).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"PATH {str(path)!r} has no safetensors weights: the learned slopes cannot be read.")
    raw: dict[str, dict[str, torch.Tensor]] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as weights:
            for key in weights.keys():
                for suffix in LEARNED_SUFFIXES:
                    if key.endswith(suffix):
                        side = suffix.rsplit("_", 1)[1]  # "left" / "right"
                        raw.setdefault(key.removesuffix(suffix), {})[side] = weights.get_tensor(key)
    if not raw:
        raise CheckpointError(
            f"PATH {str(path)!r} says encoder_variant 'learned' but its weights hold no learned slopes "
            "(...alibi.slopes_left / slopes_right): the checkpoint is incomplete; save it again with save_pretrained."
        )

    def layer_order(prefix: str) -> list:  # numbered layers in numeric order: layer.2 before layer.10
        return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in prefix.split(".")]

    return {
        prefix: {side: (-torch.sigmoid(raw[prefix][side].double())).tolist() for side in ("left", "right")}
        for prefix in sorted(raw, key=layer_order)
    }
