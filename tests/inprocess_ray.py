"""Ray's call protocol answered in process, for stand-in actors: `Method(fn).remote(*args)` runs fn at once and
returns a `Reply` (its value, or the exception it raised), and `get` (monkeypatched over `ray.get`) hands the
value back or re-raises, as `ray.get` does. Used where the code under test calls actors but the test runs no Ray."""

from __future__ import annotations


class Reply:
    """What a stand-in's `.remote()` returns: its reply, or the exception it raised (Ray's object ref)."""

    def __init__(self, fn, *args):
        try:
            self.value, self.error = fn(*args), None
        except Exception as e:  # noqa: BLE001 - re-raised by `get`, as ray.get would
            self.value, self.error = None, e


def get(refs, **_):
    """`ray.get` of one `Reply` or a list of them."""
    one = not isinstance(refs, list)
    for r in [refs] if one else refs:
        if r.error is not None:
            raise r.error
    return refs.value if one else [r.value for r in refs]


class Method:
    """An actor method: `.remote(*args)` calls it now."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return Reply(self.fn, *args)
