"""Start-up cost of hf_alibi: ``import hf_alibi`` and the ``hf-alibi`` command against their baselines.

Each measurement is a fresh interpreter; the variants run interleaved, ``--repeats`` times, and the
median is printed (wall seconds, and CPU seconds of the child, which a busy machine disturbs less).
Two baselines: what ``import hf_alibi`` cannot avoid (``import torch`` and ``from transformers import
PreTrainedModel``), and importing the transformers classes it registers (``AutoConfig`` with the config class of
every built-in row, ``AutoModel``: the model classes themselves are made when a row is first used). The command's
lines (``hf-alibi --help``, ``convert --help``, ``--version``, an argument error) run its entry point
(``hf_alibi.cli.main``, what the installed ``hf-alibi`` script calls) and should cost a bare interpreter's time: they
import neither torch nor transformers. To see where the time goes: ``python -X importtime -c "import hf_alibi"``.

    PYTHONPATH=$PWD python benchmarks/import_time.py --repeats 5
    python benchmarks/import_time.py --root /path/to/another/checkout   # the same for another copy
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import resource, sys, time
start = time.perf_counter()
{body}
wall = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT", wall, usage.ru_utime + usage.ru_stime)
"""
REGISTERED_CLASSES = """
import re, torch
from transformers import AutoConfig, AutoModel, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
# the built-in rows' model types, read as text (importing patches/ would import hf_alibi)
text = "".join(open(f"patches/{name}.py").read() for name in ("absolute", "relative", "rotary"))
for model_type in sorted(set(re.findall(r'"([a-z0-9_]+)"', text)) & set(CONFIG_MAPPING.keys())):
    CONFIG_MAPPING[model_type]  # imports the type's configuration module, as registering its Alibi<Config> does
"""
COMMAND = "import hf_alibi.cli\ntry:\n    hf_alibi.cli.main({argv})\nexcept SystemExit:\n    pass"
VARIANTS = {
    "baseline": "import torch\nfrom transformers import PreTrainedModel",
    "transformers' classes": REGISTERED_CLASSES,
    "import hf_alibi": "import torch\nfrom transformers import PreTrainedModel\nimport hf_alibi",
    "import hf_alibi, then transformers": "import hf_alibi\nimport torch\nfrom transformers import PreTrainedModel",
    "import hf_alibi alone (registers later)": "import hf_alibi",
    "bare interpreter": "pass",
    "hf-alibi --help": COMMAND.format(argv=["--help"]),
    "hf-alibi convert --help": COMMAND.format(argv=["convert", "--help"]),
    "hf-alibi --version": COMMAND.format(argv=["--version"]),
    "hf-alibi (argument error)": COMMAND.format(argv=["convert", "missing-folder/x/y", "out"]),
}


def run_once(body: str, root: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh interpreter running ``body``."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(body=body)], env=env, cwd=root, capture_output=True, text=True, check=True
    ).stdout
    _, wall, cpu = next(line for line in out.splitlines() if line.startswith("RESULT")).split()
    return float(wall), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="checkout to time")
    args = parser.parse_args()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, body in VARIANTS.items():
            times[name].append(run_once(body, args.root))
    medians = {name: [statistics.median(t[i] for t in runs) for i in (0, 1)] for name, runs in times.items()}
    base_wall, base_cpu = medians["baseline"]
    print(f"{args.root}: median of {args.repeats} fresh interpreters (interleaved)")
    print("| what | wall s | CPU s | wall / baseline | CPU / baseline |")
    print("|---|---|---|---|---|")
    for name, (wall, cpu) in medians.items():
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {wall / base_wall:.3f} | {cpu / base_cpu:.3f} |")
    print(json.dumps({"root": str(args.root), "repeats": args.repeats, "medians": medians}))


if __name__ == "__main__":
    main()
