"""Deprecated alias of :mod:`hf_alibi.cli.jobs` (the command line is one package now: hf_alibi/cli/). Kept for one
release, for code that imported ``hf_alibi.jobs.recover_checkpoint`` and the other jobs; warns with
``FutureWarning``. It is the same module object, so what is set on one is set on the other."""

import sys
import warnings

from .cli import jobs

warnings.warn(
    "hf_alibi.jobs is now hf_alibi.cli.jobs; the old name goes in the next release.", FutureWarning, stacklevel=2
)
sys.modules[__name__] = jobs
