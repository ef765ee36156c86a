"""``python -m routereplay.cli``: the command line."""
import sys

from routereplay.cli.main import main

sys.exit(main())
