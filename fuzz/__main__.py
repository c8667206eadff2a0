"""`python -m fuzz` is `kvfuzz`."""

import sys

from fuzz.cli import main

sys.exit(main())
