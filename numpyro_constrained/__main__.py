"""``python -m numpyro_constrained``: run the showcase and print its results table."""

import sys

from numpyro_constrained.showcase import main

if __name__ == "__main__":
    sys.exit(main())
