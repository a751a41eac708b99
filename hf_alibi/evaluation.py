"""Deprecated alias of :mod:`hf_alibi.evaluate.lengths` (evaluation is one wing now: hf_alibi/evaluate/). Kept for
one release, for code that imported ``hf_alibi.evaluation.evaluate_lengths`` and the rest; warns with
``FutureWarning``. It is the same module object, so what is set on one is set on the other."""

import sys
import warnings

from .evaluate import lengths

warnings.warn(
    "hf_alibi.evaluation is now hf_alibi.evaluate (the module: hf_alibi.evaluate.lengths); the old name goes in the "
    "next release.",
    FutureWarning,
    stacklevel=2,
)
sys.modules[__name__] = lengths
