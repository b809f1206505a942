"""Memory-efficient LLM fine-tuning and RLHF on PyTorch Lightning (see the README)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

_DISTRIBUTION = "lightning-mem"


def _version() -> str:
    """The version of the code being imported, not of whatever copy is installed: a source tree
    imported from the working directory or ``PYTHONPATH`` (the GPU script runs that way) has its
    pyproject.toml beside the package, and an installed wheel has its metadata."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if pyproject.is_file():
        try:
            import tomllib  # Python >= 3.11
        except ModuleNotFoundError:  # 3.10: the installed metadata below is the best left
            tomllib = None
        if tomllib is not None:
            project = tomllib.loads(pyproject.read_text()).get("project", {})
            if project.get("name") == _DISTRIBUTION and "version" in project:
                return str(project["version"])
    try:
        return metadata.version(_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"  # neither installed nor in its source tree: a copied folder


__version__ = _version()
