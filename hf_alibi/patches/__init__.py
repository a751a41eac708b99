"""Source-checkout stand-in for ``hf_alibi.patches``: the rows live in the top-level ``patches/`` folder.

An installed hf_alibi (wheel or ``pip install -e``) maps ``hf_alibi.patches`` to that folder
(pyproject.toml, ``package-dir``) and never ships this file. Run from a checkout without installing
(the tests, ``PYTHONPATH=$PWD``), this package looks for its modules there instead.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "patches")]
