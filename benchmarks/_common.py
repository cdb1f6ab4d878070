"""What the benchmark scripts share beyond the test harness: run metadata, output paths, tables, quiet fits.

Not a benchmark itself. Importing it puts ``tests/`` on ``sys.path``: the model, loss, data, float64 reference and
strategy factory are the tests' own (``tests/_harness.py``), so a benchmark measures exactly what the tests check.
The example's model and corpus come from ``examples/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))  # the shared harness (tests/_harness.py) and cost counter (tests/_cost.py)
sys.path.insert(0, str(ROOT / "examples"))  # the example's model and corpus; examples/ is not a package


def add_output_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``--quick``, ``--json``, ``--markdown``: full runs write to ``benchmarks/results/``, quick ones elsewhere."""
    parser.add_argument("--quick", action="store_true", help="a smoke-test run; writes to a temporary folder")
    parser.add_argument("--json", type=Path, help=f"default: benchmarks/results/{name}.json (quick: a temp folder)")
    parser.add_argument("--markdown", type=Path, help=f"default: benchmarks/results/{name}.md (quick: a temp folder)")


def output_paths(args: argparse.Namespace, name: str) -> tuple[Path, Path]:
    """Where this run writes: the recorded results only for a full run, so a smoke test never overwrites them."""
    folder = Path(tempfile.mkdtemp(prefix=f"token_mean-{name}-")) if args.quick else RESULTS
    return args.json or folder / f"{name}.json", args.markdown or folder / f"{name}.md"


def environment(configuration: dict[str, Any]) -> dict[str, Any]:
    """Hardware, versions, date and configuration: recorded beside every number."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "src", "benchmarks/*.py", "tests/_harness.py", "tests/_cost.py",
             "tests/_fabric.py", "tests/_fabric_cost.py"],
            cwd=ROOT, capture_output=True, text=True,
        ).stdout
        commit += "+dirty" if dirty.strip() else ""
    except (OSError, subprocess.CalledProcessError):  # a copy of the tree without .git (a GPU machine's)
        given = os.environ.get("TOKEN_MEAN_COMMIT")
        commit = f"{given} (TOKEN_MEAN_COMMIT; no git repository here)" if given else "unknown"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": [round(value, 2) for value in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "platform": platform.platform(),
        "commit": commit,
        "torch_threads_per_process": torch.get_num_threads(),
        "configuration": configuration,
    }


def environment_markdown(env: dict[str, Any]) -> str:
    load = env.get("load_average")
    return (
        f"{env['date']} · {env['cpu']}, {env['cores']} cores"
        + (f" (load average {load[0]:.1f} at the start)" if load else "")
        + f" · Python {env['python']}, torch {env['torch']}, lightning {env['lightning']} · commit {env['commit']}"
        f" · {env['torch_threads_per_process']} torch thread per process"
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(json_path: Path, markdown_path: Path, payload: dict[str, Any], markdown: str) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(markdown + "\n")


def quiet_lightning() -> None:
    """Hundreds of fits would print hundreds of banners ("GPU available: False", "Initializing distributed...")."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*is smaller than the logging interval.*")
    warnings.filterwarnings("ignore", ".*an accumulation window had no valid items.*")
    # deprecations inside torch.distributed and Lightning 2.6.6 under torch 2.13, once per rank and fit
    warnings.filterwarnings("ignore", ".*all_gather_into_tensor` is deprecated.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
