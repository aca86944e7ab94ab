"""`python -m rl_kernel.selftest`: see `rl_kernel.selftest.main`."""

import sys

from rl_kernel.selftest import main

sys.exit(main())
