"""Deprecated alias of :mod:`hf_alibi.core.conversion` (renamed in 0.x: ``modeling.py`` beside ``modeling_alibi.py``
and ``hf_alibi/models.py`` said nothing of what it holds). Kept for one release, for code that imported it and for
models pickled before the rename; warns with ``FutureWarning``."""

import warnings

from .conversion import *  # noqa: F403
from .conversion import ForwardSetup, bound_arguments, class_by_name  # noqa: F401  (what pickles and imports named)

warnings.warn(
    "hf_alibi.core.modeling is now hf_alibi.core.conversion; the old name goes in the next release.",
    FutureWarning,
    stacklevel=2,
)
