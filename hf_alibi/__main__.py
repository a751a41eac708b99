"""``python -m hf_alibi``: the ``hf-alibi`` command (its answers that need no model came before the package's
import: hf_alibi/__init__.py, hf_alibi_boot.answer_module_run)."""

import sys

from hf_alibi_boot import main

sys.exit(main())
