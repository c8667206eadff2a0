"""`python -m kvfuzz` is the `kvfuzz` command."""

import os
import sys

# `python -m` puts the current directory first on sys.path: a module lying beside a downloaded
# trace must not become importable (only PYTHONPATH or an installed module make a plugin so).
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from kvfuzz.fuzz.cli import entry  # noqa: E402

entry()
