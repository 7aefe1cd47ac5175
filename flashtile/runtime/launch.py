"""Launching a Triton kernel many times with the same compile-time arguments, for less host time.

``fn[grid](*args)`` runs Triton's ``JITFunction.run`` on every call: it binds
all arguments, specialises each one (dtype and 16-byte alignment of a tensor,
type and divisibility of an int), hashes the result to find the compiled
kernel, and only then launches it.  For a decoding step whose kernels take
~10 µs on the GPU, that is the cost that matters: on an H100 host it measured
28 µs for a kernel with 48 arguments, against 11 µs to launch the same
compiled kernel directly.

:class:`KernelLauncher` does the binding once.  It is built for one kernel,
one grid, one set of *static* arguments (every int, bool and ``tl.constexpr``
the kernel takes, passed last) and one set of launch options.  The per-call
*dynamic* arguments (tensors, then floats, passed first) are what changes
between calls.  Of those, Triton specialises on a tensor's dtype and on
whether its address is a multiple of 16 bytes; floats are not specialised
(always fp32).  So:

* the first call goes through ``fn[grid]`` (which compiles, or finds the
  kernel in Triton's caches) and keeps the compiled kernel's launcher, keyed
  by the tensors' alignment;
* a later call whose tensors have the same alignment launches that compiled
  kernel directly (``CompiledKernel[grid](*args)``, which still runs Triton's
  launch hooks for profilers); a different alignment takes the first-call
  path again, once.

Per-call ints: ``dynamic`` may end with ints that change between calls (a
key count, a growing cache's batch stride), so one launcher serves a
decoding loop.  Triton specialises an int on ``== 1`` and divisibility by 16
unless the kernel lists it in ``do_not_specialize``, and a kernel compiled
for one such value would be wrong for another: the first call checks that
every int among the dynamic arguments is ``do_not_specialize``.  Its width
(i32, or i64 from 2^31 on) stays part of Triton's signature, so the kept
launchers are also keyed by the widths of those ints once one leaves i32.

Contract: the tensors' dtypes are part of what the caller keys a launcher
on (the decode wrapper's launchers are memoised per dtype), so a launcher
only ever sees one dtype per argument slot; that is checked on the first
call of each key, not per call.  Under Triton's interpreter ``fn[grid]``
returns no compiled kernel and every call takes Triton's path.

Devices: Triton launches on the *current* CUDA device, and a compiled kernel
is loaded into that device's context, so the kept launchers are keyed by the
current device as well as by alignment (the callers make the tensors' device
current first, see ``flashtile.ops.autograd``).  Threads: the per-call path
only reads dicts; a first call builds the new entry under a lock and
publishes it with one assignment.  Triton's interpreter keeps its grid index
and its patches of ``triton.language`` in module globals, so interpreted
launches are serialised.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Sequence

import torch

from flashtile.runtime.common import cuda_device_index

try:
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted
except ImportError:  # a Triton without the interpreter: nothing is interpreted
    class _Interpreted:  # type: ignore[no-redef]
        pass

__all__ = ["KernelLauncher", "launch", "launcher"]

# held around every launch through Triton's interpreter (its state is module-global)
_INTERPRETER_LOCK = threading.Lock()

def _current_device() -> int:
    """The current CUDA device, whose context a compiled kernel is loaded into; -1 before CUDA is initialised."""
    return cuda_device_index() if torch.cuda.is_initialized() else -1


_I32 = 2**31


def _alignment_key(dynamic: Sequence[Any], check: Sequence[int], ints: Sequence[int] = ()) -> Any:
    """0 when the tensors at positions ``check`` all start at a multiple of 16 bytes (the usual
    case: one OR over the addresses), else the tuple of "is aligned" per checked position; paired
    with the Triton types of the per-call ints at positions ``ints`` when one does not fit i32."""
    acc = 0
    for i in check:
        acc |= dynamic[i].data_ptr()
    key = 0 if not acc & 15 else tuple(dynamic[i].data_ptr() % 16 == 0 for i in check)
    for i in ints:
        if not -_I32 <= dynamic[i] < _I32:  # Triton passes it as i64 (or u64): another compiled kernel
            return key, tuple(_int_width(dynamic[j]) for j in ints)
    return key


def _int_width(x: int) -> str:
    """The type Triton gives an int argument: i32, i64, or u64 from 2^63 on."""
    return "i32" if -_I32 <= x < _I32 else "i64" if -(2**63) <= x < 2**63 else "u64"


def _unspecialised(fn: Any) -> tuple[list[str], set[str]] | None:
    """(parameter names, names of the ``do_not_specialize`` ones) of a JIT or interpreted kernel; None
    for a stand-in that declares neither."""
    names = getattr(fn, "arg_names", None)
    dns = getattr(fn, "do_not_specialize", None)
    if dns is None:
        dns = (getattr(fn, "kwargs", {}).get("do_not_specialize") or []) if isinstance(fn, _Interpreted) else None
    if names is None or dns is None:
        return None
    return list(names), {names[i] if isinstance(i, int) else i for i in dns}


class KernelLauncher:
    """``fn[grid](*dynamic, *static, **options)``, with Triton's argument binding done once per alignment.

    ``grid`` is a tuple of up to 3 ints; ``static`` the kernel's trailing
    arguments (ints, bools, constexpr values, in signature order); the per-call
    ``dynamic`` ones are tensors, then floats, then ints that may change per call
    (``do_not_specialize`` in the kernel, checked on the first call); ``options``
    launch options such as ``num_warps`` / ``num_stages``.  ``fn`` may be any
    object indexable by a grid (a ``triton.JITFunction``, or a stand-in in tests).
    ``check``: positions among the dynamic arguments of the tensors whose
    alignment may vary (the caller's inputs); the default is every tensor.  A
    tensor left out must be 16-byte aligned on every call: a fresh allocation
    of the caller, as the CUDA caching allocator aligns to 512 bytes (checked on
    the first call of each alignment).
    """

    __slots__ = (
        "_fn", "_grid", "_static", "_options", "_check", "_ints", "_runners", "_dtypes", "_lock", "_interpreted",
    )

    def __init__(
        self, fn: Any, grid: Sequence[int], static: Sequence[Any], options: dict[str, Any],
        check: Sequence[int] | None = None,
    ) -> None:
        grid = tuple(int(g) for g in grid)
        if not 1 <= len(grid) <= 3:
            raise ValueError(f"grid must have 1 to 3 dimensions, got {grid}")
        self._fn = fn
        self._grid = grid + (1,) * (3 - len(grid))
        self._static = tuple(static)
        self._options = dict(options)
        self._check = None if check is None else tuple(check)
        self._ints: tuple[int, ...] = ()  # positions of the per-call ints among the dynamic arguments
        # current device -> alignment key -> launch of the kernel compiled (loaded) on that device;
        # replaced, never mutated in place, so the per-call lookups need no lock
        self._runners: dict[int, dict[int | tuple[bool, ...], Callable[..., None]]] = {}
        self._dtypes: tuple | None = None
        self._lock = threading.Lock()
        self._interpreted = isinstance(fn, _Interpreted)

    def __call__(self, *dynamic: Any) -> None:
        if self._runners:
            runners = self._runners.get(_current_device())
            if runners is not None:
                runner = runners.get(_alignment_key(dynamic, self._check, self._ints))
                if runner is not None:
                    runner(*dynamic, *self._static)
                    return
        self._first_call(dynamic)

    def _first_call(self, dynamic: tuple) -> None:
        """Triton's own launch path; keeps the compiled kernel for later calls with this device and alignment."""
        tensors = [i for i, a in enumerate(dynamic) if isinstance(a, torch.Tensor)]
        dtypes = tuple(dynamic[i].dtype for i in tensors)
        ints = tuple(i for i, a in enumerate(dynamic) if type(a) is int)
        if ints:
            self._check_unspecialised(ints)
        with self._lock:
            if self._check is None:
                self._check = tuple(tensors)
            if self._dtypes is None:
                self._dtypes = dtypes
            self._ints = ints
            check, expected = self._check, self._dtypes
        unchecked = [i for i in tensors if i not in check and dynamic[i].data_ptr() % 16]
        if unchecked:
            raise ValueError(f"KernelLauncher: tensor arguments {unchecked} must be 16-byte aligned (they are not checked per call)")
        if dtypes != expected:
            raise TypeError(f"KernelLauncher: tensor dtypes changed from {expected} to {dtypes}; build one launcher per dtype")
        if self._interpreted:
            with _INTERPRETER_LOCK:
                compiled = self._fn[self._grid](*dynamic, *self._static, **self._options)
        else:
            compiled = self._fn[self._grid](*dynamic, *self._static, **self._options)
        getter = getattr(type(compiled), "__getitem__", None) if compiled is not None else None
        if getter is None:  # the interpreter returns no compiled kernel: nothing to keep
            return
        if len({dynamic[i].device for i in tensors}) != 1:
            return
        device = _current_device()  # after the launch, which initialises CUDA on a first call
        runner = compiled[self._grid]
        key = _alignment_key(dynamic, check, ints)
        with self._lock:
            runners = dict(self._runners.get(device, {}))
            runners[key] = runner
            table = dict(self._runners)
            table[device] = runners
            self._runners = table

    def _check_unspecialised(self, ints: tuple[int, ...]) -> None:
        """Every per-call int must be ``do_not_specialize`` (a specialised one would make the kept kernel
        wrong for other values)."""
        found = _unspecialised(self._fn)
        if found is None:
            return
        names, dns = found
        bad = [names[i] if i < len(names) else f"#{i}" for i in ints if i >= len(names) or names[i] not in dns]
        if bad:
            raise ValueError(
                f"KernelLauncher: per-call int arguments {bad} of {getattr(self._fn, '__name__', self._fn)} must be "
                "in the kernel's do_not_specialize (or be passed among the static arguments)"
            )


@functools.lru_cache(maxsize=512)
def _bound(
    kernel: Any, grid: tuple, static: tuple, num_warps: int, num_stages: int, pdl: bool, dtypes: tuple, device: Any
) -> KernelLauncher:
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if pdl:
        options["launch_pdl"] = True
    return KernelLauncher(kernel, grid, static, options)


def launcher(
    kernel: Any, grid: tuple, dynamic: tuple, static: tuple, *, num_warps: int, num_stages: int, bind: bool = True,
    pdl: bool = False,
) -> Callable[..., None]:
    """What :func:`launch` runs ``dynamic`` through, for a caller that keeps it (a plan launching one problem
    signature many times): the memoised :class:`KernelLauncher` with ``bind``, else Triton's own path.
    ``dynamic``: one call's per-call arguments (their dtypes and device key the binding)."""
    if bind:
        tensors = [x for x in dynamic if isinstance(x, torch.Tensor)]
        dtypes = tuple(t.dtype for t in tensors)
        return _bound(kernel, grid, static, num_warps, num_stages, pdl, dtypes, tensors[0].device)
    return functools.partial(_unbound, kernel, grid, static, num_warps, num_stages, pdl)


def _unbound(kernel: Any, grid: tuple, static: tuple, num_warps: int, num_stages: int, pdl: bool, *dynamic) -> None:
    extra = {"launch_pdl": True} if pdl else {}
    if isinstance(kernel, _Interpreted):
        with _INTERPRETER_LOCK:
            kernel[grid](*dynamic, *static, num_warps=num_warps, num_stages=num_stages, **extra)
    else:
        kernel[grid](*dynamic, *static, num_warps=num_warps, num_stages=num_stages, **extra)


def launch(
    kernel: Any, grid: tuple, dynamic: tuple, static: tuple, *, num_warps: int, num_stages: int, bind: bool = True,
    pdl: bool = False,
) -> None:
    """``kernel[grid](*dynamic, *static)``.  With ``bind``, through a :class:`KernelLauncher`
    memoised on (kernel, grid, static arguments, options, the tensors' dtypes and device): a
    wrapper called with one problem signature again and again binds once; ints at the end of
    ``dynamic`` (``do_not_specialize`` in the kernel) may change per call without a new binding.  ``bind=False``
    (arguments that change every call, such as a Philox seed) goes through Triton.
    ``pdl``: programmatic dependent launch (``launch_pdl``; the kernel must ``gdc_wait()``
    before reading the previous kernel's output, see ``flashtile.runtime.common.pdl_supported``)."""
    launcher(kernel, grid, dynamic, static, num_warps=num_warps, num_stages=num_stages, bind=bind, pdl=pdl)(*dynamic)
