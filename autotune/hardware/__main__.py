"""``python -m autotune.hardware [TARGET]``: the capability probe's child process."""

import sys

from autotune.hardware._machine import _main

_main(sys.argv[1:])
