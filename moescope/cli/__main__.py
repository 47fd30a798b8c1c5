"""`python -m moescope.cli`: the command line without the installed `moescope` script."""

import sys

from moescope.cli import main

sys.exit(main())
