"""The remote code of a checkpoint: ``modeling_alibi.py`` and the core modules it imports, copied
byte for byte, and ``auto_map`` in config.json pointing at them, so that people without hf_alibi can
load the checkpoint with ``trust_remote_code=True``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from transformers.utils import logging

from ..core.compat import auto_class_names
from ..core.config import get_settings
from ..core.strategies import STRATEGIES
from .compat import relative_import_files

logger = logging.get_logger(__name__)

# The entry module auto_map names; it and the core modules it imports are copied unchanged.
REMOTE_CODE_FILE = Path(__file__).parent.parent / "core" / "modeling_alibi.py"
REMOTE_MODULE = REMOTE_CODE_FILE.stem  # "modeling_alibi"


def remote_code_files() -> list[Path]:
    """The files a checkpoint's remote code is made of: the entry module and, followed the way
    transformers' dynamic-module loader follows them, the core modules it imports."""
    return [REMOTE_CODE_FILE, *sorted(Path(f) for f in relative_import_files(REMOTE_CODE_FILE))]


auto_classes_for = auto_class_names  # transformers' Auto class name -> model class name, per model_type


def auto_map_for(config) -> dict[str, str]:
    """The ``auto_map`` of an ALiBi config: every Auto class of its architecture, to the remote code."""
    settings = get_settings(config)
    base_config = next(c for c in type(config).__mro__ if getattr(c, "model_type", None) == settings.base_model_type)
    auto_map = {"AutoConfig": f"{REMOTE_MODULE}.Alibi{base_config.__name__}"}
    for auto_name, class_name in auto_classes_for(settings.base_model_type).items():
        auto_map[auto_name] = f"{REMOTE_MODULE}.Alibi{class_name}"
    return auto_map


def add_remote_code(folder: str | os.PathLike, config) -> bool:
    """Copy the remote code into ``folder`` and point config.json's ``auto_map`` at it. True when written.

    A row with a custom strategy (not one of the core's) cannot run from the core's files alone: no
    remote code is written then (a warning says so), and the folder loads only where that code runs.
    """
    folder = Path(folder)
    strategy = (get_settings(config).architecture or {}).get("strategy")
    if strategy is not None and strategy not in STRATEGIES:  # the core's own strategies
        logger.warning(
            f"No remote code written to {folder}: its architecture uses the custom strategy {strategy!r}, "
            "so it loads only after the code that registers it (hf_alibi.register_architecture)."
        )
        return False
    for source in remote_code_files():
        shutil.copyfile(source, folder / source.name)
    config_path = folder / "config.json"
    data = json.loads(config_path.read_text())
    data["auto_map"] = auto_map_for(config)
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return True
