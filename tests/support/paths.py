"""Where the repository is, for tests that read its files (README, units, examples) or run from it."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
