#!/usr/bin/env python
"""Offline generation: the same as `jaxinfer generate` (see `--help`)."""

import sys

from jaxinfer.cli import main

if __name__ == "__main__":
  sys.exit(main(["generate", *sys.argv[1:]]))
