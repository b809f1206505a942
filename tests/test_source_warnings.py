"""The sources compile without a warning: Python 3.12 prints ``SyntaxWarning: invalid escape
sequence`` for every ``"\\`"`` or ``"\\ "`` in a non-raw string (3.11 raises the same as a
``DeprecationWarning``), once per run, at import -- a line a user sees and cannot act on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]


def test_compileall_with_warnings_as_errors_passes(tmp_path):
    # -f: compile even where an up-to-date .pyc exists (it would hide the warning);
    # PYTHONPYCACHEPREFIX: the .pyc files go to tmp_path, not into the source tree.
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-W", "error", "-W", "error::SyntaxWarning", "-W", "error::DeprecationWarning",
         "-m", "compileall", "-f", "-q", "lightning_mem", "recipes", "benchmarks", "scripts"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_invalid_escape_fails_the_check(tmp_path):
    # The check above can fail: a docstring with an invalid escape makes compileall exit non-zero.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "bad.py").write_text('"""the ``fill_token``\\ s"""\n')
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "compileall", "-f", "-q", str(tmp_path / "src")],
        env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert result.returncode != 0
    assert "invalid escape sequence" in result.stdout + result.stderr
