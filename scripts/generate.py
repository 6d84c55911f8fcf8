#!/usr/bin/env python
"""Offline generation: the same as `jaxinfer generate` (see `--help`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxinfer.cli import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(main(["generate", *sys.argv[1:]]))
