"""Where things are, for tests in any folder of tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent  # the checkout
HELPERS = TESTS / "helpers"
SCRIPTS = ROOT / "scripts"
DOCS = ROOT / "docs"
