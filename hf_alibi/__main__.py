"""``python -m hf_alibi``: the ``hf-alibi`` command (:mod:`hf_alibi.cli`)."""

import sys

from .cli import main

sys.exit(main())
