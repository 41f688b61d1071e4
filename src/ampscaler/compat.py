"""torch.amp.GradScaler's private names, the only module that knows them.

Libraries and tests written against torch's scaler read a few of its private attributes.
:class:`TorchPrivateNames`, the one base class of :class:`~ampscaler.GradScaler`, gives them the
values and effects torch gives them, from the scaler's own parts: its state
(``self._state``, a :class:`~ampscaler.state.ScalerState`) and the iteration in progress
(``self._iteration``, an :class:`~ampscaler.iteration.Iteration`). Each name, and who uses it:

- ``_scale``, ``_growth_tracker``: the live tensors (``None`` before a device is known);
  torch's CUDA-graph tests and pickling test read them. Assigning one (training code holding
  the scale at a floor of its own, ``if scaler._scale < m: scaler._scale = torch.tensor(m)``,
  or a test setting a state to save) sets its value, validated as ``update(new_scale)`` is
  (an ``InvalidConfigError`` naming it; nothing changes): the live tensor keeps its identity,
  where torch's takes the new tensor. On a disabled scaler, as on torch's, neither exists
  (reading one, or ``_get_scale_async()``, raises ``AttributeError``: code tells a disabled
  scaler by ``hasattr(scaler, "_scale")``) until assigned; then it holds the value, never used.
- ``_get_scale_async()``: the scale tensor without a sync (Accelerate, torch's tests);
  ``_get_growth_tracker()``: the growth tracker as an int (a host sync; torch's tests).
- ``_init_scale``, ``_init_growth_tracker``: the scale and growth tracker given at construction,
  loaded from a checkpoint, or held when the scaler was pickled (torch's pickling and
  state-dict tests). Assigned before the first ``scale()``, where the run starts (torch's
  scaler reads them only then, so code assigns them to choose it); later, only kept, as by
  torch's (whose ``load_state_dict()`` assigns them and fills the live tensors beside them).
  A disabled scaler has neither until code assigns one, as torch's.
- ``_per_optimizer_states``: ``{id(optimizer): {"stage": torch's OptState, "found_inf_per_device":
  {device: flag}}}`` for the iteration in progress, a new ``defaultdict`` on each read (torch's
  tests, code that checks whether an optimizer was unscaled). The flag is the optimizer's combined
  flag, on the scale's device: the tensor itself, so that writes into it count (an ``unscale_()``
  override agreeing on it across ranks; an ``update()`` copied from torch's adds the flags into the
  first), while what a fused optimizer's step decided stays as it was (``step_skipped()``). An entry
  is read from the iteration it was taken in at each read, as torch's is the dict its ``unscale_()``
  and ``step()`` write into: taken before them (a SAM step takes it, then unscales), it shows what
  they did. Two writes are taken: ``stage`` set to ``OptState.READY`` before the optimizer's
  ``step()`` (Composer's closure scaler, before each closure of a SAM step) lets ``unscale_()``
  check new gradients again, the old flag kept until it does, as torch's; after ``step()`` it raises
  a ``RuntimeError``. ``stage`` set to ``OptState.STEPPED`` (or ``2``) after ``unscale_()`` says the
  loop stepped the optimizer itself (the SAM-with-AMP recipe); written into an ended iteration's
  entry it changes nothing. ``found_inf_per_device`` set to ``{}`` where the stage is ``READY``
  (GPViT's runner, after writing ``READY``, gives the batch to fp32) forgets the check. Any other
  write (an ``unscale_()`` copied from torch's sharded scaler writes ``found_inf_per_device`` and
  ``stage = UNSCALED`` there) raises a ``TypeError`` that says to call ``super().unscale_()`` and
  change the flags in place instead. Flags changed in place between ``unscale_()`` and ``step()``
  (a loop all-reducing them) decide the step, as in torch: once code has taken them, ``step()``
  reads them again. The dict forgets as torch's does: ``pop``, ``del`` or torch's fresh entry
  (``_refresh_per_optimizer_state()``, hivemind's scaler) under an optimizer's key forgets what
  the iteration did with it (a loop giving up a batch after ``unscale_()``), ``clear()`` is a
  fresh mapping assigned; another value put there raises a ``TypeError``. Assigning it a fresh,
  empty mapping (how torch's ``update()`` ends an iteration, and so code that copies that
  ``update()`` into a subclass; a trainer dropping a batch it runs again; torch's sharded
  scaler's ``__init__``) ends a stepped iteration as ``update()`` does, with the state as that
  code left it, and drops one that stepped nothing; another value raises ``AttributeError``.
- ``_found_inf_per_device(optimizer)``: that entry's ``found_inf_per_device``.
- ``_check_inf_per_device(optimizer)``: checks without unscaling and records the flag, as
  torch's deprecated ``grad_scaler=`` step protocol uses it.
- ``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)``: torch's unscale-and-check,
  per device (torch's tests).
- ``_lazy_init_scale_growth_tracker(device)``: makes the live state on ``device``
  (Accelerate's FSDP2 checkpoint loading calls it).
- ``_growth_factor``, ``_backoff_factor``, ``_growth_interval``: the dynamic rule's numbers,
  readable and writable (Accelerate's ``GradScalerKwargs`` test reads them; writes are
  validated as the setters' are). A disabled scaler has none until code assigns one (then kept,
  never used), as torch's: scripts read them with torch's defaults, ``getattr(scaler,
  "_growth_interval", -1)``.
- ``_enabled``: whether scaling is on (an attribute of the scaler itself).
- ``_maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)``: torch's step-unless-flagged
  (``optimizer.step(...)`` unless the flags in ``optimizer_state["found_inf_per_device"]``
  sum to more than 0); ``_check_scale_growth_tracker(funcname)``: the live tensors, or torch's
  error before ``scale()`` (NeMo's scaler calls both).

**Subclasses.** torch's ``scale()``, ``unscale_()`` and ``step()`` call three of these, and
``unscale_()`` itself, on ``self``, and code that subclasses torch's scaler overrides them
(torch's sharded scaler, NeMo's and ColossalAI's scalers, trackers of skipped steps, optimizers
that unscale their own gradients); they are chosen once, when the class is made. A subclass of
ampscaler's scaler that overrides one (also one defined while :func:`ampscaler.patch_torch` is
in force, over torch's names) gets it called where torch calls it:

- ``_lazy_init_scale_growth_tracker(device)``: by the first ``scale()`` (since construction or
  unpickling), with the device of what it scales (the override calls ``super()``);
- ``unscale_(optimizer)`` (public, but torch's ``step()`` calls it): by ``step()`` for a
  non-fused optimizer not unscaled yet. Such an override (torch's sharded scaler's pattern:
  ``super().unscale_(optimizer)``, then reduce the flags of ``_per_optimizer_states`` in
  place) may change the flags after ampscaler's check, so ``unscale_()`` does not read them
  early: ``step()`` reads them, as torch's does;
- ``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)``: to unscale and check an
  optimizer's gradients, by ``unscale_()`` (``allow_fp16`` as torch's, ``True`` for
  :class:`~ampscaler.ShardedGradScaler`) and, with ``inv_scale`` 1, for a fused optimizer's
  ``step()``; the flags it returns are the optimizer's;
- ``_maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)``: by ``step()`` for a
  non-fused optimizer, to step it or not; ``optimizer_state["found_inf_per_device"]`` holds
  ampscaler's decision as a float32 flag (1.0: skip), and its return is ``step()``'s. The
  scaler's own records (``last_step_skipped``, ``metrics()``, the update) follow that flag.

An override of ``_unscale_grads_`` decides about float16 gradients, as in torch (whose
``unscale_()`` leaves the refusal to ``_unscale_grads_``): fairscale's ``GradScaler`` passes
``allow_fp16=True`` to ``super()`` for its sharded models' float16 gradients, and they are
checked. Code may also assign ``_unscale_grads_`` or ``_maybe_opt_step`` to one scaler
instead (kohya-ss's sd-scripts, for float16 weights: ``original = scaler._unscale_grads_``,
then ``scaler._unscale_grads_ =`` a function that calls ``original`` with
``allow_fp16=True``): torch's scaler calls ``self``'s, so the assigned function; ampscaler's
scaler then calls it where it calls a subclass's override. (An ``unscale_`` assigned to one
scaler is called by code that calls ``scaler.unscale_()``, not by ``step()``, where torch's
calls it: override it in a subclass for that.)

The other methods torch's scaler calls on ``self`` (``_check_scale_growth_tracker``,
``_check_inf_per_device``, ``_get_scale_async``, ``_get_growth_tracker``) ampscaler's methods do
not call: overriding one warns when the class is made, as the override would change only what
code calling it gets.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import torch
from torch.amp.grad_scaler import OptState as TorchOptState

from .errors import ScalerUsageError, warn_at_caller
from .grads.check import combined_flag, unscale_per_device_
from .grads.collect import collect
from .iteration import Iteration, OptState
from .policy.base import float32_value, require_int
from .policy.derived import torch_rule
from .policy.scale import INT32_MAX
from .state import ScalerState

if TYPE_CHECKING:
    from .grads.collect import GradGroups
    from .iteration import OptimizerRecord
    from .state import LiveState

__all__ = ["TorchPrivateNames"]

#: torch's methods that torch's own scaler calls on ``self`` but ampscaler's does not.
NOT_CALLED = (
    "_check_scale_growth_tracker",
    "_check_inf_per_device",
    "_get_scale_async",
    "_get_growth_tracker",
)

_N = TypeVar("_N", float, int)


class _OptimizerEntry(Mapping[str, Any]):
    """One optimizer's entry of ``_per_optimizer_states``: ``stage`` and
    ``found_inf_per_device``, read from its record in the iteration the entry was taken in, at
    each read. torch's entry is the dict its ``unscale_()`` and ``step()`` write into, so code
    that takes it first and reads it after them (a SAM step) sees what they did, and one
    taken in an earlier iteration shows how that one ended. Read-only but for ``stage`` set
    back to ``READY`` (:meth:`OptimizerRecord.ready_again`) or on to ``STEPPED``
    (:meth:`TorchPrivateNames._stepped_by_caller`): another write would change nothing, so
    code that writes there (an ``unscale_()`` copied from torch's sharded scaler) is told what
    to do instead."""

    def __init__(self, scaler: TorchPrivateNames, iteration: Iteration, key: int) -> None:
        self._scaler, self._iteration, self._key = scaler, iteration, key

    def _values(self) -> dict[str, Any]:
        record = self._iteration.records.get(self._key)
        if record is None:
            return {"stage": TorchOptState.READY, "found_inf_per_device": {}}
        found = record.found_inf
        if record.outcome is not None:  # stepped: code of its own may now write the flag
            record.outcome.keep_own_flag(found)  # in place (torch's update() adds them so)
        flags = {} if found is None else {found.device: found}
        return {"stage": TorchOptState[record.stage.name], "found_inf_per_device": flags}

    def __getitem__(self, key: str) -> Any:
        if key == "found_inf_per_device":
            record = self._iteration.records.get(self._key)
            if record is not None and record.stage is OptState.UNSCALED:
                # Code holding the flags may change them in place before step() (a loop that
                # all-reduces them so that every rank skips alike), which decides on them as
                # torch's does: what unscale_() read of them is read again there.
                record.known_overflow = None
        return self._values()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(("stage", "found_inf_per_device"))

    def __len__(self) -> int:
        return 2

    def __repr__(self) -> str:
        return repr(self._values())

    def __setitem__(self, key: str, value: object) -> None:
        stage = _stage_written(key, value)
        if stage is OptState.READY:
            # Composer's ClosureGradScaler, before each closure of a SAM step: the optimizer
            # may be unscaled again, its new gradients checked.
            record = self._iteration.records.get(self._key)
            if record is not None:
                record.ready_again()
            return
        if stage is OptState.STEPPED:
            # SAM's first step with AMP: the loop steps the optimizer itself after unscale_().
            self._scaler._stepped_by_caller(self._iteration, self._key)
            return
        if key == "found_inf_per_device" and _empty_mapping(value) and self._ready():
            # After stage = READY (GPViT's runner, giving up an fp16 step after unscale_()
            # for an fp32 one): the entry is torch's fresh one again, the check forgotten.
            self._scaler._forget(self._iteration, self._key)
            return
        raise TypeError(
            f"_per_optimizer_states is a read-only view on ampscaler's GradScaler: writing "
            f"{key!r} there (as an unscale_() copied from torch's sharded scaler does) would "
            "change nothing. Override unscale_ by calling super().unscale_(optimizer) and then "
            "change the flags in place (for flag in scaler._found_inf_per_device(optimizer)"
            ".values(): dist.all_reduce(flag, group=...)), or pass process_group= and let the "
            "scaler agree across ranks."
        )

    def _ready(self) -> bool:
        record = self._iteration.records.get(self._key)
        return record is None or record.stage is OptState.READY


def _empty_mapping(value: object) -> bool:
    return isinstance(value, Mapping) and not value


def _fresh_entry(value: object) -> bool:
    """Whether ``value`` is torch's entry of an optimizer not seen in the iteration
    (``_refresh_per_optimizer_state()``: stage ``READY``, no flags)."""
    return (
        isinstance(value, Mapping)
        and set(value) == {"stage", "found_inf_per_device"}
        and _stage_written("stage", value["stage"]) is OptState.READY
        and _empty_mapping(value["found_inf_per_device"])
    )


def _stage_written(key: str, value: object) -> OptState | None:
    """The stage a write of ``value`` under ``key`` sets, where it is ``READY`` or ``STEPPED``
    (torch's enum, ampscaler's, or their values 0 and 2, which code copied from torch's writes
    as well); ``None`` for any other write."""
    if key != "stage":
        return None
    if isinstance(value, (TorchOptState, OptState)):
        value = value.value
    if type(value) is not int or value not in (OptState.READY.value, OptState.STEPPED.value):
        return None
    return OptState(value)


class _Entries(defaultdict[int, _OptimizerEntry]):
    """``_per_optimizer_states``: the entries of the optimizers the iteration has seen, and, as
    torch's ``defaultdict``, one made on reading any other key (it then shows what the
    iteration does with that optimizer)."""

    def __init__(self, scaler: TorchPrivateNames) -> None:
        super().__init__()
        self._scaler, self._iteration = scaler, scaler._iteration
        for key in self._iteration.records:
            super().__setitem__(key, _OptimizerEntry(scaler, self._iteration, key))

    def __missing__(self, key: int) -> _OptimizerEntry:
        entry = _OptimizerEntry(self._scaler, self._iteration, key)
        super().__setitem__(key, entry)
        return entry

    # Forgetting entries, as torch's dict forgets them: a trainer that gives up a batch after
    # unscale_() (out of memory, or its gradients moved aside) clears the dict or pops the
    # optimizer's entry, so that the next unscale_() checks new gradients; hivemind's scaler
    # puts a fresh entry back after a step it does not update on.

    def clear(self) -> None:
        super().clear()
        self._scaler._per_optimizer_states = {}  # as a fresh mapping assigned (module docstring)

    def __delitem__(self, key: int) -> None:
        super().__delitem__(key)
        self._scaler._forget(self._iteration, key)

    def pop(self, key: int, *default: Any) -> Any:
        if key not in self:
            return super().pop(key, *default)
        entry = super().pop(key)
        self._scaler._forget(self._iteration, key)
        return entry

    def __setitem__(self, key: int, value: _OptimizerEntry) -> None:
        if not _fresh_entry(value):
            raise TypeError(
                "_per_optimizer_states takes only torch's fresh entry "
                "(_refresh_per_optimizer_state()) on ampscaler's GradScaler: it forgets what "
                "the iteration did with that optimizer. Its entries are read from ampscaler's "
                "iteration: to change an optimizer's flags, change "
                "_per_optimizer_states[id(optimizer)]['found_inf_per_device'] in place."
            )
        self._scaler._forget(self._iteration, key)
        super().__setitem__(key, _OptimizerEntry(self._scaler, self._iteration, key))


class _RuleNumber(Generic[_N]):
    """``_growth_factor`` and friends: the policy's number of torch's rule, read and written
    (a write validated and applied as torch's setter of the same name would be)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._field = name.removeprefix("_")

    def __get__(self, scaler: TorchPrivateNames | None, owner: type) -> _N:
        # On the class (help(), inspect), the descriptor itself.
        if scaler is None:
            return cast(_N, self)
        if not scaler._enabled:  # torch's constructor sets none when disabled
            return cast(_N, _unset_when_disabled(scaler, f"_{self._field}"))
        return cast(_N, getattr(torch_rule(scaler._state.policy), self._field))

    def __set__(self, scaler: TorchPrivateNames, value: _N) -> None:
        if not scaler._enabled:  # kept and never used, as on torch's disabled scaler
            scaler.__dict__[f"_{self._field}"] = value
            return
        scaler._state.change_rule(f"_{self._field}", **{self._field: value})


class _Assignable:
    """A method of torch's that torch's scaler calls on ``self`` (``_unscale_grads_``,
    ``_maybe_opt_step``), which code may assign to one scaler rather than override in a subclass
    (kohya-ss's sd-scripts: ``scaler._unscale_grads_ = ...``). Read on a scaler, the function
    assigned to it, else the method; assigned, it has that scaler's calls go through the
    function, as a subclass's override has (module docstring)."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self._method = method
        self.__doc__ = method.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, scaler: TorchPrivateNames | None, owner: type) -> Any:
        if scaler is None:  # on the class: the method (help(), a subclass's override check)
            return self._method
        assigned = scaler.__dict__.get(self._name)
        return self._method.__get__(scaler, owner) if assigned is None else assigned

    def __set__(self, scaler: TorchPrivateNames, function: object) -> None:
        scaler.__dict__[self._name] = function
        _route(scaler, self._name)


class _StartValue:
    """``_init_scale`` and ``_init_growth_tracker``: where the scale and the growth tracker
    start (given at construction, loaded, or held when the scaler was pickled), kept in the
    scaler's ``__dict__`` under the same name. torch's scaler reads them when the first
    ``scale()`` makes its tensors, so code written for it assigns them before training to
    choose where the run starts: assigned before the scale is first used, the value (validated)
    is put into the state; afterwards it is only kept, as on torch's scaler."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, scaler: TorchPrivateNames | None, owner: type) -> Any:
        # On the class (help(), inspect), the descriptor itself. A disabled scaler has none
        # until code assigns it, as torch's.
        return self if scaler is None else _unset_when_disabled(scaler, self._name)

    def __set__(self, scaler: TorchPrivateNames, value: object) -> None:
        state: ScalerState | None = scaler.__dict__.get("_state")
        if state is None or not scaler._enabled or state.used:
            # Before __init__ made the state, disabled, or once the scale is in use: kept, as
            # torch keeps it, and not read (torch's own load_state_dict() assigns it so, and
            # fills the live tensors beside it).
            scaler.__dict__[self._name] = value
            return
        scaler.__dict__[self._name] = _put(state, self._name, value)


def _put(state: ScalerState, name: str, value: object) -> float | int:
    """Write ``value``, assigned to torch's name ``name``, into ``state``: a scale (``_scale``,
    ``_init_scale``) validated as ``update(new_scale)`` is, or a growth tracker count; an
    ``InvalidConfigError`` naming ``name`` changes nothing. Returns what was written."""
    if name.endswith("scale"):
        scale = float32_value(state.policy.check_scale(name, value))
        state.put(scale=scale)
        return scale
    count = require_int(name, value, 0, INT32_MAX, integral_floats=True)
    state.put(growth_tracker=count)
    return count


def _unset_when_disabled(scaler: object, name: str) -> Any:
    """One of torch's names a disabled scaler lacks (``_scale``, ``_growth_tracker``,
    ``_init_scale``, ``_init_growth_tracker``, ``_growth_factor``, ``_backoff_factor``,
    ``_growth_interval``): torch's constructor sets none of them when disabled, so reading one
    raises ``AttributeError`` (code tells a disabled scaler by ``hasattr(scaler, "_scale")``,
    or reads ``getattr(scaler, "_growth_interval", -1)``) until code assigns it; then the value
    assigned, never used."""
    try:
        return scaler.__dict__[name]
    except KeyError:
        raise AttributeError(
            f"{type(scaler).__name__!r} object has no attribute {name!r}: this scaler is "
            "disabled, and a disabled scaler keeps no scale or growth settings (torch's has no "
            "such attribute either); get_scale() returns 1.0, and scaler.policy holds the "
            "configured rule"
        ) from None


class TorchPrivateNames:
    """torch's private names over the scaler's state and iteration (module docstring).

    What it reads of the scaler, and nothing else: ``_enabled``, ``_state`` and
    ``_iteration``.
    """

    _enabled: bool
    _state: ScalerState
    _iteration: Iteration
    #: Ends the iteration in progress with the state as code outside the scaler left it.
    _end_moved_outside: Callable[[], None]
    #: Records an optimizer's step: its flag, the guards' flag, the live state.
    _stepped: Callable[
        [OptimizerRecord, torch.Tensor | bool, torch.Tensor | bool | None, LiveState], None
    ]

    # ------------------------------------------------------------------ the state

    @property
    def _scale(self) -> Any:
        return self._get_scale_async()

    @_scale.setter
    def _scale(self, value: object) -> None:
        # Code written for torch's scaler assigns it to set the value (a floor of its own after
        # update(), or a state before saving): written into the live scale, which keeps its
        # identity. A disabled scaler keeps it and never uses it, as torch's.
        if self._enabled:
            _put(self._state, "_scale", value)
        else:
            self.__dict__["_scale"] = value

    @property
    def _growth_tracker(self) -> Any:
        if not self._enabled:
            return _unset_when_disabled(self, "_growth_tracker")
        live = self._state.live
        return None if live is None else live.growth_tracker

    @_growth_tracker.setter
    def _growth_tracker(self, value: object) -> None:
        if self._enabled:  # as _scale
            _put(self._state, "_growth_tracker", value)
        else:
            self.__dict__["_growth_tracker"] = value

    def _get_scale_async(self) -> Any:
        """The scale tensor without a sync (``None`` before a device is known).

        Raises:
            AttributeError: the scaler is disabled and ``_scale`` was never assigned, as
                torch's (whose ``_get_scale_async()`` reads ``self._scale``).
        """
        if not self._enabled:
            return _unset_when_disabled(self, "_scale")
        live = self._state.live
        return None if live is None else live.scale

    def _get_growth_tracker(self) -> int:
        """The growth tracker as an int (0 when disabled). A host sync."""
        return self._state.growth_tracker_value() if self._enabled else 0

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        self._state.use(torch.device(dev))

    _init_scale = _StartValue()
    _init_growth_tracker = _StartValue()

    def _keep_start(self, scale: float, growth_tracker: int) -> None:
        """Keep where the state starts now (construction, a load) under torch's names; the
        state itself is the caller's to set."""
        self.__dict__.update(_init_scale=scale, _init_growth_tracker=growth_tracker)

    # ------------------------------------------------------------------ the rule

    _growth_factor = _RuleNumber[float]()
    _backoff_factor = _RuleNumber[float]()
    _growth_interval = _RuleNumber[int]()

    # ------------------------------------------------------------------ per optimizer

    @property
    def _per_optimizer_states(self) -> defaultdict[int, _OptimizerEntry]:
        return _Entries(self)

    @_per_optimizer_states.setter
    def _per_optimizer_states(self, value: object) -> None:
        # torch's idiom for ending an iteration (its update() does it last) or dropping one:
        # a fresh, empty mapping. Anything else would write entries read from the iteration.
        if not isinstance(value, Mapping) or value:
            raise AttributeError(
                "_per_optimizer_states takes only a fresh, empty mapping on ampscaler's "
                "GradScaler (defaultdict(_refresh_per_optimizer_state), as torch's update() "
                "assigns it): it ends or drops the iteration in progress. Its entries are read "
                "from ampscaler's iteration: to change an optimizer's flags, override "
                "unscale_(), call super().unscale_(optimizer), then change the flags of "
                "_per_optimizer_states[id(optimizer)] in place."
            )
        self._end_moved_outside()

    def _stepped_by_caller(self, iteration: Iteration, key: int) -> None:
        """``stage`` set to ``STEPPED`` in the entry of the optimizer keyed ``key``: the loop
        stepped that optimizer itself after ``unscale_()`` and ends the iteration with
        ``update()`` (SAM's first step with AMP, a recipe copied widely: it steps unless
        ``found_inf_per_device`` holds a flag > 0). The step is counted as ``step()`` would
        have decided it (skipped where the flag is > 0). As on torch's scaler, the write
        changes nothing on an entry of an iteration that has ended (the recipe writes into the
        first step's entry again after its second) or of an optimizer already stepped.

        Raises:
            ScalerUsageError: the optimizer was not unscaled in this iteration: there is no
                check for ``update()`` to decide on.
        """
        record = iteration.records.get(key)
        if iteration is not self._iteration or (
            record is not None and record.stage is OptState.STEPPED
        ):
            return
        if record is None or record.stage is not OptState.UNSCALED:
            raise ScalerUsageError(
                "_per_optimizer_states[id(optimizer)]['stage'] was set to STEPPED before "
                "scaler.unscale_(optimizer): no check of its gradients was made for update() "
                "to decide on. Call scaler.unscale_(optimizer) first, then step the optimizer "
                "unless its found_inf_per_device flags are > 0, or call "
                "scaler.step(optimizer)."
            )
        found = record.found_inf
        live = self._state.require("step")
        self._stepped(record, False if found is None else found, record.spike, live)

    def _forget(self, iteration: Iteration, key: int) -> None:
        """The entry of the optimizer keyed ``key`` popped, deleted or made fresh, as torch's
        dict forgets it: what the iteration did with that optimizer (its check, its flag, its
        step) is forgotten, and ``unscale_()`` and ``step()`` start over for it. Into an
        ended iteration's entries it changes nothing, as on torch's scaler."""
        if iteration is self._iteration:
            iteration.records.pop(key, None)

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Any]:
        found: dict[torch.device, Any] = self._per_optimizer_states[id(optimizer)][
            "found_inf_per_device"
        ]
        return found

    @_Assignable
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # torch flags into copies of found_inf, one per device, and leaves found_inf as it was
        groups = collect(optimizer, allow_fp16=allow_fp16)
        return unscale_per_device_(groups, inv_scale, found_inf.clone())

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Any]:
        """Check ``optimizer``'s gradients without unscaling them, and record the flags.

        Raises:
            ScalerUsageError: (an ``AssertionError``, as torch's) ``scale()`` has not been used
                yet: a ``GradScaler("cpu")`` has its state from construction, torch's not.
        """
        live = self._state.require("_check_inf_per_device")
        ones = torch.ones((), dtype=torch.float32, device=live.device)
        flags: dict[torch.device, Any] = self._unscale_grads_(
            optimizer, ones, torch.zeros_like(ones), True
        )
        record = self._iteration.record(optimizer, "_check_inf_per_device")
        record.found_inf = combined_flag(flags, live.device)
        return flags

    # ------------------------------------------------------------------ for subclasses

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The live scale and growth tracker.

        Raises:
            ScalerUsageError: (an ``AssertionError``, as torch's) ``scale()`` has not been used
                yet.
        """
        live = self._state.require(funcname)
        iteration = self._iteration
        if iteration.start_scale is None and iteration.stepped:
            # A subclass's own update() starts so, as torch's does, before it moves the scale:
            # the copy is what the iteration is counted from (see _end_moved_outside).
            iteration.start_scale = live.scale.double()
        return live.scale, live.growth_tracker

    @_Assignable
    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """``optimizer.step(*args, **kwargs)`` unless the flags in
        ``optimizer_state["found_inf_per_device"]`` sum to more than 0 (then ``None``); one
        host read per flag."""
        flags = optimizer_state["found_inf_per_device"].values()
        if sum(flag.item() for flag in flags):
            return None
        return optimizer.step(*args, **kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Route the scaler's calls through torch's methods that ``cls`` overrides (itself, or
        through a mixin), and warn of an override that nothing of the scaler calls, once, at
        the class that brings it (module docstring)."""
        super().__init_subclass__(**kwargs)
        parent = next(base for base in cls.__mro__[1:] if issubclass(base, TorchPrivateNames))

        def _overridden(name: str, since: type = TorchPrivateNames) -> bool:
            return getattr(cls, name) is not getattr(since, name)

        lazy_init = "_lazy_init_scale_growth_tracker"
        if _overridden(lazy_init) and getattr(parent, lazy_init) is getattr(
            TorchPrivateNames, lazy_init
        ):
            # the first class to override it (a class below inherits the routed scale_on)
            cls._scale_on = _initializing_lazily(cls._scale_on)  # type: ignore[attr-defined]
        # unscale_ is the scaler's own (public): overridden below the class that defines it
        home = next((c for c in reversed(cls.__mro__) if "_unscale_in_step" in vars(c)), cls)
        if _overridden("unscale_", since=home):
            _route(cls, "unscale_")
        for name in ("_unscale_grads_", "_maybe_opt_step"):
            if _overridden(name):
                _route(cls, name)
        for name in NOT_CALLED:
            if _overridden(name, since=parent):
                warn_at_caller(
                    f"{cls.__qualname__} overrides {name}(), which torch's GradScaler calls "
                    "from its own methods and ampscaler's does not: the override changes only "
                    "what code that calls it gets. Move what it does into an override of the "
                    "public method that should do it (scale, unscale_, step, update, "
                    "state_dict).",
                    UserWarning,
                )


def _initializing_lazily(
    scale_on: Callable[[Any, torch.device], torch.Tensor],
) -> Callable[[Any, torch.device], torch.Tensor]:
    """``scale_on`` (``scale()``'s scale for a device), after the subclass's
    ``_lazy_init_scale_growth_tracker(device)`` at the first ``scale()`` (since construction or
    unpickling), as torch's ``scale()`` calls it while its ``_scale`` is ``None``."""

    def _initialized_first(scaler: Any, device: torch.device) -> torch.Tensor:
        if not scaler._state.used:
            scaler._lazy_init_scale_growth_tracker(device)
        return scale_on(scaler, device)

    return _initialized_first


def _through_unscale_(scaler: Any, record: OptimizerRecord, live: Any) -> None:
    """``step()``'s unscale by the subclass's ``unscale_`` (``live`` unused: it asks again)."""
    scaler.unscale_(record.optimizer)


def _through_unscale_grads(
    scaler: Any,
    record: OptimizerRecord,
    groups: GradGroups,
    multiplier: torch.Tensor,
    device: torch.device,
    allow_fp16: bool,
) -> torch.Tensor | None:
    """The check by the subclass's ``_unscale_grads_`` (``groups``, ampscaler's own collection,
    go to the hooks): the flags it returns, summed on ``device``."""
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    flags = scaler._unscale_grads_(record.optimizer, multiplier, found_inf, allow_fp16)
    return combined_flag(flags, device)


def _through_maybe_opt_step(
    scaler: Any,
    record: OptimizerRecord,
    skipped: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The subclass's ``_maybe_opt_step``, given the scaler's decision as torch's per-optimizer
    state: a float32 flag on the scale's device, 1.0 to skip (one small op)."""
    assert record.found_inf is not None, "step() refuses an optimizer without gradients"
    device = record.found_inf.device
    flag = torch.full((), float(skipped), dtype=torch.float32, device=device)
    state = {"stage": TorchOptState.UNSCALED, "found_inf_per_device": {device: flag}}
    return scaler._maybe_opt_step(record.optimizer, state, *args, **kwargs)


#: For each of torch's methods that torch's scaler calls on ``self`` and a subclass overrides
#: (or code assigns to one scaler): the scaler's attributes that make its calls go through it.
_ROUTES: dict[str, dict[str, Any]] = {
    "unscale_": {"_unscale_in_step": _through_unscale_, "_reads_early": False},
    "_unscale_grads_": {"_unscale_and_check": _through_unscale_grads, "_fp16_to_override": True},
    "_maybe_opt_step": {"_step_optimizer": _through_maybe_opt_step},
}


def _route(target: Any, name: str) -> None:
    """Have ``target`` (a class that overrides torch's method ``name``, or a scaler it was
    assigned to) call ``name`` where torch's scaler calls it: set the attributes of
    ``_ROUTES[name]`` on it (on a scaler, a function bound to it)."""
    for attribute, value in _ROUTES[name].items():
        if callable(value) and not isinstance(target, type):
            value = functools.partial(value, target)
        setattr(target, attribute, value)
