"""`python -m keras_dist ...` runs the `keras-dist` command line."""

import sys

from keras_dist.cli import main

if __name__ == "__main__":
    sys.exit(main())
