"""Resuming a training run (scripts/run_clm.py): the checkpoint must belong to the model being trained, ALiBi or not,
and every checkpoint-N carries config.json to say which (:class:`SaveConfigCallback`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..core.names import is_alibi

logger = logging.getLogger(__name__)


class SaveConfigCallback(TrainerCallback):
    """Writes config.json into every checkpoint-N that lacks one. With FSDP's SHARDED_STATE_DICT the Trainer
    saves only the shards (``pytorch_model_fsdp_0``) and the optimizer there; config.json says whether the
    checkpoint is ALiBi, with which settings, when it is resumed or merged (``accelerate merge-weights``)."""

    def on_save(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero or model is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "config.json")):
            model.config.save_pretrained(folder)


def checkpoint_alibi_settings(checkpoint: str | os.PathLike) -> dict | None:
    """The ``alibi`` settings in a checkpoint folder's config.json; ``None`` when it is not an ALiBi checkpoint."""
    config_path = os.path.join(checkpoint, "config.json")
    if not os.path.isdir(checkpoint):
        raise ValueError(f"--resume_from_checkpoint {checkpoint!r} is not a folder: pass output_dir/checkpoint-N.")
    if not os.path.isfile(config_path):
        logger.warning(f"{checkpoint} has no config.json: cannot check that it is ALiBi (or not) like this run.")
        return None
    with open(config_path) as f:
        config = json.load(f)
    if is_alibi(config):
        return config["alibi"]
    return None


def check_resume(model_args: Any, resume_from_checkpoint: str | None) -> None:
    """Resuming needs the model the checkpoint was saved from: ALiBi or not, the optimizer state and the weights
    only fit that one. An ALiBi checkpoint resumed without ``--alibi`` continues as ALiBi (with its saved heads);
    a checkpoint without ALiBi resumed with ``--alibi`` is an error."""
    if not resume_from_checkpoint or model_args.model_name_or_path:
        return  # no resuming, or the model itself is loaded from a checkpoint (ALiBi or not, as saved)
    if not os.path.isfile(os.path.join(resume_from_checkpoint, "config.json")):
        checkpoint_alibi_settings(resume_from_checkpoint)  # not a folder: an error; no config.json: a warning
        return
    settings = checkpoint_alibi_settings(resume_from_checkpoint)
    if settings is not None and not model_args.alibi:
        logger.warning(
            f"--resume_from_checkpoint {resume_from_checkpoint} is an ALiBi checkpoint ({settings}): "
            "continuing as ALiBi, as with --alibi."
        )
        model_args.alibi = True
    elif settings is None and model_args.alibi:
        raise ValueError(
            f"--resume_from_checkpoint {resume_from_checkpoint} is not an ALiBi checkpoint (no 'alibi' in its "
            "config.json), but --alibi was given: its weights and optimizer state belong to the model with position "
            "embeddings. Resume it without --alibi, or start a new ALiBi run (another --output_dir)."
        )
    if settings is not None and model_args.alibi_heads not in (None, settings["heads"]):
        raise ValueError(
            f"--alibi_heads {model_args.alibi_heads} but the checkpoint {resume_from_checkpoint} was trained with "
            f"{settings['heads']} heads. Omit --alibi_heads to resume it."
        )
