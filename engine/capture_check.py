"""Capture safety, checked on a CPU: the ops that would break or silently corrupt a CUDA graph.

``CaptureHazards`` watches code that a CUDA graph captures (``GraphRunner``'s segments) through
a ``TorchDispatchMode`` (every aten op that runs) and a ``TorchFunctionMode`` (``.tolist()`` and
``.numpy()``, which read CPU memory without dispatching). It records:

- ``host sync``: ``aten._local_scalar_dense`` (``.item()``, ``int()`` / ``bool()`` of a tensor),
  ``Tensor.tolist()``, ``Tensor.numpy()``, a copy to the host;
- ``data-dependent shape``: ``nonzero``, ``masked_select``, ``unique``, ``bincount``,
  ``repeat_interleave`` without ``output_size``, boolean-mask indexing;
- ``random``: any RNG op (a replay repeats the capture's draws; the draft loop reads noise drawn
  before the replay into a static buffer);
- ``host data``: ``torch.tensor(...)`` of more than a scalar and host-to-device copies inside
  the region (a graph keeps the values of its capture; a scalar is passed by value);
- ``outside read`` (when ``allowed`` is given): an op reading a tensor that is neither allowed
  (static buffers, weights, KV caches) nor made inside the region: a replay would read the
  capture's stale copy.

Triton launches are device work: what the interpreter does inside them is not watched. Each
hazard names the op and the innermost Tandem frame that issued it. The checks run on a CPU with
the GPU code paths (``TANDEM_TEST_GPU_PATHS=1``, Triton through the interpreter, no CPU fast
path); ``tests/test_capture_safety.py`` runs every graph key's segments under it, and counts the
host syncs of whole engine steps (``count_host_syncs``).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_PACKAGE = str(Path(__file__).resolve().parents[1])
_SYNC = {aten._local_scalar_dense}
_DATA_DEPENDENT = {
    aten.nonzero, aten.nonzero_static, aten.masked_select, aten._unique, aten._unique2,
    aten.unique_dim, aten.unique_consecutive, aten.bincount, aten.masked_scatter,
}  # fmt: skip
_RANDOM = {
    aten.rand, aten.randn, aten.randint, aten.rand_like, aten.randn_like, aten.randint_like,
    aten.randperm, aten.normal, aten.normal_, aten.uniform_, aten.exponential_, aten.bernoulli,
    aten.bernoulli_, aten.multinomial, aten.random_, aten.geometric_, aten.log_normal_,
    aten.cauchy_,
}  # fmt: skip
_HOST_DATA = {aten.lift_fresh, aten.lift_fresh_copy}
# Python-level reads of a tensor's values on the host.
_READS_HOST = {
    torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
}  # fmt: skip


@dataclass(frozen=True)
class Hazard:
    kind: str
    op: str
    frame: str  # file:line in function, the innermost frame in the package

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.frame}"


class CaptureHazardError(RuntimeError):
    pass


def _frame() -> str:
    for f in reversed(traceback.extract_stack()[:-2]):
        # Resolved: the package may be imported through links (a checkout aliased as `tandem`).
        name = str(Path(f.filename).resolve())
        if (
            name.startswith(_PACKAGE)
            and "site-packages" not in name
            and not name.endswith("capture_check.py")
        ):
            return f"{Path(name).relative_to(_PACKAGE)}:{f.lineno} in {f.name}"
    return "(outside the package)"


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: CaptureHazards) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        owner = self.owner
        if owner.in_kernel:
            return func(*args, **kwargs)
        packet = func.overloadpacket
        tensors = [
            a
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        ]
        if packet in _SYNC:
            owner.add("host sync", func)
        elif packet in _DATA_DEPENDENT:
            owner.add("data-dependent shape", func)
        elif packet is aten.repeat_interleave and kwargs.get("output_size") is None:
            owner.add("data-dependent shape", func)
        elif packet in (aten.index, aten.index_put, aten.index_put_) and any(
            t.dtype == torch.bool for t in tensors[1:]
        ):
            owner.add("data-dependent shape", func)
        elif packet in _RANDOM:
            owner.add("random", func)
        elif packet in _HOST_DATA:
            if tensors and tensors[0].dim() > 0:  # a 0-dim one is a scalar, passed by value
                owner.add("host data", func)
            tensors = []  # its input is the host data itself, not a read
        elif packet in (aten._to_copy, aten.copy_) and len({t.device for t in tensors}) > 1:
            owner.add("host sync" if "cpu" in str(kwargs.get("device", "")) else "host data", func)
        if owner.allowed is not None:
            for t in tensors:
                ptr = _storage(t)
                if ptr is not None and ptr not in owner.allowed and ptr not in owner.made:
                    owner.add("outside read", func)
                    break
        out = func(*args, **kwargs)
        if owner.allowed is not None:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and (ptr := _storage(t)) is not None:
                    owner.made.add(ptr)
        return out


class _Function(torch.overrides.TorchFunctionMode):
    def __init__(self, owner: CaptureHazards) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        owner = self.owner
        if owner.in_kernel or func not in _READS_HOST:
            return func(*args, **(kwargs or {}))
        # Counted here, once: .item() of a CPU tensor under inference mode never dispatches,
        # and elsewhere it would also show as aten._local_scalar_dense below.
        owner.add("host sync", f"Tensor.{func.__name__}()")
        owner.in_kernel = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            owner.in_kernel = False


class CaptureHazards:
    """Records the hazards of the code run inside it (see the module docstring); ``strict``
    raises ``CaptureHazardError`` at the first one. ``allowed``: the tensors a captured region
    may read (None: reads are not checked)."""

    def __init__(self, allowed: Iterable[torch.Tensor] | None = None, strict: bool = False) -> None:
        self.allowed = None if allowed is None else {_storage(t) for t in allowed} - {None}
        self.made: set[int] = set()
        self.strict = strict
        self.hazards: list[Hazard] = []
        self.in_kernel = False

    def add(self, kind: str, func: Any) -> None:
        hazard = Hazard(kind, str(func), _frame())
        self.hazards.append(hazard)
        if self.strict:
            raise CaptureHazardError(str(hazard))

    @property
    def host_syncs(self) -> int:
        return sum(h.kind == "host sync" for h in self.hazards)

    def _device_work(self, *args: Any, **options: int) -> None:
        """A kernel launch: device work, whatever the interpreter does inside it."""
        from tandem.kernels.launch import run_launch

        self.in_kernel = True
        try:
            run_launch(*args, **options)
        finally:
            self.in_kernel = False

    @contextlib.contextmanager
    def watch(self) -> Iterator[CaptureHazards]:
        from tandem.kernels.launch import launch_hook

        with launch_hook(self._device_work), _Function(self), _Dispatch(self):
            yield self


def static_tensors(runner: Any) -> list[torch.Tensor]:
    """What a captured step may read: the graph runner's static buffers, the target's and the
    draft's weights and buffers, and the KV caches."""
    out: list[torch.Tensor] = []
    graphs = runner.graph_runner
    if graphs is not None:
        out += list(graphs.buffers.values())
    for module in (runner.model, getattr(runner.spec, "draft", None)):
        if module is not None:
            out += [*module.parameters(), *module.buffers()]
            for m in module.modules():  # plain tensor attributes too (bound KV caches, tables)
                out += [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
    for caches in runner.kv_caches:
        out += list(caches)
    return out
