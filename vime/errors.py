"""vime's errors: each says what went wrong and what to do about it."""


class VimeError(RuntimeError):
    """Base class of vime's errors. `bad_input`: the error is about what the user gave (a config value, a
    model, a run dir or checkpoint to resume), told as `config error: ...`, the one format of every check
    before and after Hydra; else a failure of the run, told as `<ErrorType>: ...`."""

    bad_input = False


class ConfigError(VimeError, ValueError):
    """The configuration cannot run (the message names the key and what to use instead)."""

    bad_input = True


class DataError(VimeError, ValueError):
    """The data or tokenizer does not fit the model (e.g. tokenizer vocab larger than the model's)."""

    bad_input = True


class ComparabilityError(VimeError):
    """The trainer and rollout results cannot be compared (different weight version, tokens, positions,
    sampling semantics, vocab range or numeric contracts). This is an error, never a mismatch count."""


class WeightSyncError(VimeError):
    """An engine did not acknowledge the weight version the driver expects."""


class EngineDiedError(VimeError):
    """A Ray actor (rollout engine or trainer rank) died or raised; the message names which one."""


class TPWorkerDiedError(EngineDiedError):
    """A TP worker process of a vLLM engine died: the engine cannot serve any more (a rollout engine death).
    Defined here, not beside the engine, so that the driver handles it without importing vLLM."""

    def __init__(self, message: str, engine: int | None = None, tp_rank: int | None = None):
        super().__init__(message)
        self.engine, self.tp_rank = engine, tp_rank


class TrainingError(VimeError):
    """The optimisation went wrong (e.g. a non-finite loss)."""


def one_line(error: VimeError) -> str:
    """The console line of a vime error: `config error: <message>` for bad input, `<ErrorType>: <message>`
    for a failure of the run (its type says which part failed)."""
    return f"config error: {error}" if error.bad_input else f"{type(error).__name__}: {error}"
