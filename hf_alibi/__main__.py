"""``python -m hf_alibi``: the ``hf-alibi`` command."""

import sys

from .cli import main

sys.exit(main())
