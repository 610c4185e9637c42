"""Counting host reads: the ops that copy a tensor's value to the host, which on a GPU wait for it.

Why one helper: the decode-step tests (tests/test_static_decode.py) and the nucleus test
(tests/test_sampling.py) all assert where such reads happen, through the same dispatch mode.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

# .item()/bool()/int() (aten._local_scalar_dense, is_nonzero), torch.equal, nonzero, allclose
HOST_READS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "allclose")


class HostReads(TorchDispatchMode):
    """While active, calls `record(name)` for each dispatched op named in `names` (by default the
    list it keeps, `seen`). Higher-order ops such as flex_attention pass through."""

    supports_higher_order_operators = True

    def __init__(self, names: tuple[str, ...] = HOST_READS, record: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.names, self.seen = names, []
        self.record = record or self.seen.append

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
        if name in self.names:
            self.record(name)
        return func(*args, **(kwargs or {}))
