"""`python -m serving.router` = `cpkv-router`."""

import sys

from serving.router.app import main

sys.exit(main())
