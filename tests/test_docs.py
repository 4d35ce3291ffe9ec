"""The documents: docs/cli.md is what the parser gives now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "tools" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_generated_from_the_parser():
    gen = _generator()
    assert (ROOT / "docs" / "cli.md").read_text() == gen.render(), (
        "docs/cli.md differs from the parser: run `make docs` (python tools/gen_cli_docs.py)"
    )
