"""What the package ships beside its code: the tiny model (config and tokenizer) and the hub
architectures' ``config.json`` files that the memory estimator builds models from, offline.

They live in the project's ``assets/`` folder; ``lightning_mem/_assets`` is a link to it, so the
same path works in a source checkout, in an editable install and from a wheel (the wheel carries
the files themselves as package data: ``[tool.setuptools.package-data]`` in pyproject.toml).
Never ``Path(__file__).parents[n] / "assets"``: an installed package has no project root above it.
"""

from __future__ import annotations

from pathlib import Path

#: The shipped assets' root (``assets/`` of the project).
ASSETS = Path(__file__).resolve().parent / "_assets"
#: ``<org>/<name>/config.json`` of the real architectures the GPU-tier configs name.
HUB_ASSETS = ASSETS / "hub"
#: The tiny Llama (config, tokenizer, chat template; no weights): CPU runs and tests.
TINY_MODEL = ASSETS / "tiny-llama"
