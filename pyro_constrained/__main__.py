"""``python -m pyro_constrained``: run the showcase and print its results table."""

import sys

from pyro_constrained.showcase import main

if __name__ == "__main__":
    sys.exit(main())
