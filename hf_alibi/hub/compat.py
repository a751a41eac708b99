"""Every private transformers API that saving a checkpoint uses (its remote code's files, its card's Hub id), each
with the versions it was checked on: a loaded model never runs these, so they stay out of ``core/compat.py``, which a
checkpoint's remote code copies."""

from __future__ import annotations

from transformers import PretrainedConfig


def relative_import_files(module_file) -> list[str]:
    """Every file ``module_file`` imports with flat relative imports, followed recursively, the way
    transformers' dynamic-module loader follows them for remote code
    (``dynamic_module_utils.get_relative_import_files``; checked on transformers 5.19.0, 5.23.0 and 5.24.0)."""
    from transformers.dynamic_module_utils import get_relative_import_files

    return get_relative_import_files(module_file)


def name_or_path(config: PretrainedConfig) -> str:
    """Where a config was loaded from (``PretrainedConfig._name_or_path``, a folder or a Hub id; "" when
    built in code; checked on transformers 5.19.0, 5.23.0 and 5.24.0)."""
    return getattr(config, "_name_or_path", "") or ""
