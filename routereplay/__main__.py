"""``python -m routereplay``: the command line (routereplay.cli)."""
import sys

from routereplay.cli import main

if __name__ == "__main__":
    sys.exit(main())
