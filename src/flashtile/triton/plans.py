"""Launch plans: what a launcher decides for one call key, decided once and replayed after.

A small call is bound by the host, not the GPU (benchmarks/NOTES.md, "Host time on the GPU"):
``JITFunction.run`` binds and specialises each of a kernel's ~60 arguments on every launch (~13 µs
of a CPU core for the forward kernel), and the launchers' own Python, which picks the code path,
configuration, grid and strides, costs ~35 µs more. Everything they decide depends on the call's
**key** alone: each tensor's shape, strides, dtype, device and address modulo 16 (Triton
specialises pointer arguments on 16-byte alignment, and the copy engine requires it), and the
call's scalar options. So a launcher decides once per key:

* on the first call of a key it launches through a :class:`LaunchPlan` (:func:`launch`), which
  records each launch's compiled kernel, grid and arguments in the kernel's parameter order, with
  the call's tensors (and tensor descriptors over them) replaced by their positions in the tuple of
  the call's tensors that the launcher bound to the plan;
* later calls with the key allocate their outputs and :meth:`LaunchPlan.replay` the launches: the
  slots are filled with this call's tensors and the compiled kernel's launcher is called directly,
  with no binding, specialisation or deciding. On an NVIDIA GPU the replay calls the launcher's C
  function itself (:class:`_Direct`), with the argument list Triton's Python wrapper would build:
  each tensor descriptor's fixed fields laid out once, and its encoded copy-engine descriptor
  (``cuTensorMapEncodeTiled``, what Triton's wrapper redoes on every launch) kept per address.

One tensor may fill several slots (``k`` passed as ``v`` too; ``q`` standing in for an absent
tensor; one ``cu_seqlens`` for queries and keys). Such a recording takes the first slot and notes
the pair: a replay checks that the same slots hold one tensor again, and where they do not, the
launcher records the call anew. A launch whose tensor is not among the bound ones (a view made
inside the launcher) leaves the plan incomplete, and an incomplete plan is never stored: such calls
keep the full path, correct but slower. Plans hold no tensors. Under ``TRITON_INTERPRET=1`` there
is no compiled kernel and a replay goes through ``kernel[grid]``, so the CPU tests exercise the slot
filling; so does a GPU replay while a launch hook (a profiler's) is set.

A plan assumes that the launchers' policy (``configs``, the code-path switches) stays as it was
when it was recorded: whoever changes the policy calls :func:`clear` (the tests' fixtures do). A
stale plan would still compute the right result, by the path that was chosen before.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton import knobs

__all__ = ["LaunchPlan", "clear", "key", "launch", "lookup", "replay_or_record", "store"]

_LAUNCH_OPTIONS = ("num_warps", "num_stages")

MAX_PLANS = 4096  # keys in use at once; a workload of ever-changing shapes starts over when it is reached
_PLANS: dict = {}


_TENSOR = torch.Tensor  # a module global: ``torch.Tensor`` is an attribute lookup on every part of every key


def key(*parts) -> tuple:
    """A call's key: each tensor as (shape, strides, dtype, device index, address mod 16), anything
    else (None, options, Python scalars) as it is. A list comprehension, not a generator: every launcher
    builds one per call (~0.5 µs less on a CPU core with 3 tensors and 8 other parts)."""
    return tuple([(p.shape, p.stride(), p.dtype, p.get_device(), p.data_ptr() & 15)
                  if isinstance(p, _TENSOR) else p for p in parts])


def lookup(call_key: tuple) -> LaunchPlan | None:
    return _PLANS.get(call_key)


def store(call_key: tuple, plan: LaunchPlan) -> None:
    """Keep a plan whose launches were all recorded (it forgets the tensors it was bound to)."""
    plan.unbind()
    if not plan.complete:
        return
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[call_key] = plan


def replay_or_record(call_key: tuple, plan: LaunchPlan, call: tuple, record) -> LaunchPlan:
    """Every launcher's last step: ``plan``'s launches replayed on ``call``, or, on the key's first call
    (or where the recording's aliases do not hold), ``record(plan)`` makes them through a plan bound to
    ``call`` (anew, with the same decisions), which is then stored under ``call_key``. → the plan used."""
    if plan.recorded and plan.replay(call):
        return plan
    if plan.recorded:
        plan = plan.anew()
    plan.bind(call)
    record(plan)
    store(call_key, plan)
    return plan


def launch(plan: LaunchPlan, kernel, grid, **arguments) -> None:
    """``kernel[grid]`` (a Triton or Gluon kernel) with every argument given by name, and the launch
    options (num_warps, num_stages) among them, recorded in ``plan``. The values are laid out in the
    kernel's own parameter order here and passed positionally: CPython binds ~70 keyword arguments by
    scanning the parameter names for each, which measured ~25 µs more per launch than positional
    binding on a CPU core (~80 µs on the H200's host)."""
    options = {name: arguments.pop(name) for name in _LAUNCH_OPTIONS if name in arguments}
    names = kernel.arg_names
    if len(arguments) != len(names):
        raise TypeError(f"{kernel.fn.__name__}: unknown arguments {sorted(set(arguments) - set(names))}, "
                        f"missing {sorted(set(names) - set(arguments))}")
    plan.record(kernel, grid, [arguments[name] for name in names], options)


def clear() -> None:
    """Forget every plan: call it after changing the launchers' policy."""
    _PLANS.clear()


def _hooked() -> bool:
    """Whether a launch hook (a profiler's) is set: Triton 3.6 keeps them in ``HookChain``s, empty
    when none is (earlier series: None)."""
    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


@functools.cache
def _stream_of():
    from triton.runtime import driver  # the GPU's driver, resolved on the first GPU replay only
    return driver.active.get_current_stream


def _is_descriptor(value) -> bool:
    """A tensor descriptor, Triton's or Gluon's: a dataclass over a ``base`` tensor."""
    return dataclasses.is_dataclass(value) and isinstance(getattr(value, "base", None), torch.Tensor)


def _descriptor_box(d) -> tuple:
    """(class, every field but the base): what rebuilds ``d`` over another tensor of its key."""
    return type(d), {field.name: getattr(d, field.name) for field in dataclasses.fields(d) if field.name != "base"}


def _rebuilt(box: tuple, base: torch.Tensor):
    """The recorded descriptor over ``base``, without its constructor's checks, which passed at the
    recording for every tensor of the same key (shape, strides, dtype, alignment)."""
    cls, fields = box
    d = cls.__new__(cls)
    d.__dict__.update(fields, base=base)
    return d


class _Launch:
    """One recorded launch: ``fills`` are (argument position, slot, descriptor box or None); ``direct``
    the same launch through the C launcher (:class:`_Direct`), or None."""

    __slots__ = ("kernel", "grid", "template", "fills", "options", "compiled", "direct")

    def __init__(self, kernel, grid, template, fills, options, compiled, direct):
        self.kernel, self.grid, self.template, self.fills = kernel, grid, template, fills
        self.options, self.compiled, self.direct = options, compiled, direct


_TENSOR_MAPS_KEPT = 16  # encoded descriptors kept per descriptor argument (the addresses a workload reuses)


class _TensorMaps:
    """One tensor-descriptor argument's encoded copy-engine descriptors (``cuTensorMapEncodeTiled``), by
    base address: the recorded descriptor's fields over any tensor of the plan's key, encoded once per
    address. An encoded descriptor holds the address, not the tensor."""

    __slots__ = ("box", "meta", "maps", "encode")

    def __init__(self, box: tuple, meta, encode):
        self.box, self.meta, self.maps, self.encode = box, meta, {}, encode

    def of(self, t: torch.Tensor):
        address = t.data_ptr()
        encoded = self.maps.get(address)
        if encoded is None:
            if len(self.maps) >= _TENSOR_MAPS_KEPT:
                self.maps.clear()
            encoded = self.maps[address] = self.encode(_rebuilt(self.box, t), self.meta)[0]
        return encoded


class _Direct:
    """A recorded launch as the C function of Triton's CUDA launcher takes it: ``template`` is the
    argument list after the grid and stream, with None where this call's tensors go; ``fills`` are
    (position, slot, :class:`_TensorMaps` or None for a tensor passed as it is). Triton's Python
    wrapper (``wrap_handle_tensordesc``) walks every argument on every launch and encodes each tensor
    descriptor anew; here the walk happens once per plan and the encoding once per address."""

    __slots__ = ("function", "template", "fills")

    def __init__(self, function, template, fills):
        self.function, self.template, self.fills = function, template, fills

    @classmethod
    def of(cls, compiled, function, arguments: list, fills) -> _Direct | None:
        """The direct form of ``compiled`` (its ``function`` handle) launched on the recording's
        ``arguments`` with its ``fills``, or None where Triton's launcher is not the one this knows:
        scratch buffers to allocate per launch, another backend or another wrapper."""
        launcher = compiled.run
        if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
            return None
        launch = getattr(launcher, "launch", None)
        descriptors, descriptor_meta = (), ()
        if hasattr(launch, "__code__"):  # wrap_handle_tensordesc's wrapper around the C function
            closure = dict(zip(launch.__code__.co_freevars, (cell.cell_contents for cell in launch.__closure__)))
            if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= closure.keys():
                return None
            launch, descriptors, descriptor_meta = (closure["launcher"], closure["tensordesc_indices"],
                                                    closure["tensordesc_meta"])
        if launch is None or hasattr(launch, "__code__"):
            return None
        from triton.backends.nvidia.driver import make_tensordesc_arg

        recorded = {position: (slot, box) for position, slot, box in fills}
        # the arguments of Triton 3.6's C launcher before the kernel's own, after the grid and stream: function,
        # cooperative grid, PDL, global and profile scratch, kernel metadata, launch metadata, enter and exit hooks
        template = [function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                    compiled.packed_metadata, None, None, None]
        direct_fills, meta = [], iter(descriptor_meta)
        for position, value in enumerate(arguments):
            slot, box = recorded.get(position, (None, None))
            if position not in descriptors:
                if position in recorded:
                    direct_fills.append((len(template), slot, None))
                    value = None
                template.append(value)
                continue
            meta_i = next(meta)
            expanded = make_tensordesc_arg(value, meta_i)
            # first the encoded descriptor, or (no metadata: not lowered to one) the base tensor; then
            # shapes and strides, fixed by the key
            maps = None if expanded[0] is value.base else _TensorMaps(box, meta_i, make_tensordesc_arg)
            direct_fills.append((len(template), slot, maps))
            template.extend([None, *expanded[1:]])
        return cls(launch, template, tuple(direct_fills))

    def __call__(self, grid: tuple, stream: int, call: tuple) -> None:
        arguments = list(self.template)
        for position, slot, maps in self.fills:
            t = call[slot]
            arguments[position] = t if maps is None else maps.of(t)
        self.function(*grid, stream, *arguments)


class LaunchPlan:
    """The launches of one call key, recorded on its first call and replayed on the next ones.
    Keyword arguments are the launcher's own decisions for the key (read back as attributes)."""

    def __init__(self, **decisions):
        self.__dict__.update(decisions)
        self._decisions = decisions
        self.launches: list[_Launch] = []
        self.complete = True
        self.aliases: set[tuple[int, int]] = set()  # (slot, later slot) bound to one tensor when recorded
        self._bound: tuple = ()

    def anew(self) -> LaunchPlan:
        """An empty plan with the same decisions, to record a call that this one could not replay."""
        return LaunchPlan(**self._decisions)

    @property
    def recorded(self) -> bool:
        return bool(self.launches)

    def bind(self, call: tuple) -> None:
        """The call's tensors (None where absent) that the launches to record may take as arguments."""
        self._bound = call

    def unbind(self) -> None:
        self._bound = ()

    def _slot(self, t) -> int | None:
        slots = [i for i, bound in enumerate(self._bound) if bound is t]
        self.aliases.update((slots[0], later) for later in slots[1:])
        return slots[0] if slots else None

    def record(self, kernel, grid: tuple, arguments: list, options: dict) -> None:
        """``kernel[grid](*arguments, **options)``, recorded."""
        compiled = kernel[grid](*arguments, **options)  # compiles on first use; None in the interpreter
        if hasattr(compiled, "result"):  # Triton's asynchronous compilation mode
            compiled = compiled.result()
        template, fills = list(arguments), []
        for position, value in enumerate(arguments):
            if _is_descriptor(value):
                slot, box = self._slot(value.base), _descriptor_box(value)
            elif isinstance(value, torch.Tensor):
                slot, box = self._slot(value), None
            else:
                continue
            if slot is None:
                self.complete = False
            fills.append((position, slot, box))
            template[position] = None  # a plan holds no tensors
        grid = tuple(grid) + (1,) * (3 - len(grid))
        compiled = compiled if compiled is not None and hasattr(compiled, "function") else None
        direct = None
        if compiled is not None and self.complete:
            direct = _Direct.of(compiled, compiled.function, arguments, fills)
        self.launches.append(_Launch(kernel, grid, tuple(template), tuple(fills), options, compiled, direct))

    def replay(self, call: tuple) -> bool:
        """The recorded launches on this call's tensors (bound in the order of the recording's);
        False, launching nothing, where the slots that held one tensor at the recording do not now."""
        if any(call[first] is not call[later] for first, later in self.aliases):
            return False
        stream = None
        hooked = _hooked()
        for launch in self.launches:
            compiled = launch.compiled
            if compiled is not None and not hooked:
                if stream is None:
                    stream = _stream_of()(torch.cuda.current_device())
                if launch.direct is not None:
                    launch.direct(launch.grid, stream, call)
                    continue
            arguments = list(launch.template)
            for position, slot, box in launch.fills:
                t = call[slot]
                arguments[position] = t if box is None else _rebuilt(box, t)
            if compiled is None or hooked:
                launch.kernel[launch.grid](*arguments, **launch.options)
                continue
            compiled.run(*launch.grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *arguments)
        return True
