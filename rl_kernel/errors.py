"""Errors raised by rl_kernel. Strict mode fails closed: it never falls back silently."""


class StrictModeError(RuntimeError):
    """An op was asked to run under its strict contract and cannot honour it."""

    def __init__(self, op: str, backend: str, reason: str):
        self.op, self.backend, self.reason = op, backend, reason
        super().__init__(f"rl_kernel strict op '{op}' (backend '{backend}') cannot run: {reason}")
