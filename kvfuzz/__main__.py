"""`python -m kvfuzz` is the `kvfuzz` command."""

import sys

from kvfuzz.fuzz.cli import main

sys.exit(main())
