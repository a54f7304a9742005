"""Not the package: the root of a clone of autotune's repository.

Where the clone's folder is named ``autotune`` and Python starts in the folder above it, ``python -m autotune``
takes the clone's folder for the package and runs this file: say so in one line, instead of a traceback.
"""

import sys

sys.exit("autotune: the folder 'autotune' here is a clone of autotune's repository, which Python started in its "
         "parent takes for the package; run from another folder (the clone itself works), or clone it under another "
         "name (git clone URL autotune-src)")
