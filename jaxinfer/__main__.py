import sys

from jaxinfer.cli import main

sys.exit(main())
