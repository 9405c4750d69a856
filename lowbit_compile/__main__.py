"""``python -m lowbit_compile run|estimate ...`` (see ``cli.py``)."""

import sys

from .cli import main

sys.exit(main())
