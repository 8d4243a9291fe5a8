"""Run a test module's function in a fresh Python process and return its JSON result.

Why: a resident-memory peak (``AnonymousPeak``) counts only the pages a phase touches for
the first time. In the pytest process, pages freed by earlier tests are reused unseen, so a
measurement there depends on which tests ran before it: a float64 convolution's 57 MB
unfold read 4 KB after the planner tests, and a traced U-Net stage read 39 % under its
prediction after the whole suite. Measured in a fresh process, it reads the same every time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def in_fresh_process(module: str, function: str, *args: Any, timeout: float = 300.0) -> Any:
    """``module.function(*args)`` (a module of ``tests/``; JSON-able arguments and result),
    run in a new interpreter; AssertionError with its stderr if it fails."""
    code = (
        "import json, sys\n"
        f"sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]\n"
        f"from {module} import {function}\n"
        f"print(json.dumps({function}(*json.loads(sys.argv[1]))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(list(args))],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"{module}.{function} failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.splitlines()[-1])
