"""The weight push protocol moved to `rl_kernel.weights.transfer`; this old name stays importable and is that
very module (so a patch of one is a patch of the other)."""

import sys

from rl_kernel.weights import transfer

sys.modules[__name__] = transfer
