import os
import sys
from pathlib import Path

TESTS = Path(__file__).parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))
# Child processes (fresh-process reload tests) import this checkout's hf_alibi, not another install.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
