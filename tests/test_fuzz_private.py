"""torch's private names under random call sequences, against torch.amp.GradScaler.

Code written for torch's scaler reads and writes its private names (``ampscaler.compat`` lists
each and who uses it), so ampscaler's ``GradScaler`` gives them torch's values and effects. The
public calls are fuzzed elsewhere (tests/test_fuzz_stateful.py, tests/test_fuzz_differential.py);
here a hypothesis state machine drives torch's ``GradScaler("cpu")`` and ampscaler's side by
side, each over its own twin model and SGD (and a second SGD on the head, sometimes), through
random interleavings of the public calls (scaled backwards with an inf or NaN written into a
gradient, ``unscale_``, ``step``, ``update`` with and without ``new_scale``, checkpoints at
iteration boundaries) and the private names as real code uses them: it reads ``_scale``,
``_growth_tracker``, ``_get_scale_async()``, ``_get_growth_tracker()``, ``_init_scale``, the
per-optimizer stage and flags (an entry taken before ``unscale_()`` and read after it, or after
``update()``, as SAM hooks do), ``_found_inf_per_device``; it calls ``_check_inf_per_device``
(torch's step for an optimizer of the ``grad_scaler=`` protocol; training loops that check after
``unscale_()`` and clipping, then ``update()`` without a step on an overflow),
``_check_scale_growth_tracker`` and ``_maybe_opt_step`` (NeMo's scaler),
``_lazy_init_scale_growth_tracker`` before the first ``scale()`` (Accelerate), and torch's
``update()`` copied through the private names (NeMo's and Composer's scalers,
``twins.torch_update``); it assigns ``_per_optimizer_states`` afresh (ends or drops an
iteration: Composer), the rule's numbers, ``_scale`` (a floor of its own), ``_growth_tracker``
(a state to save) and ``_init_scale``/``_init_growth_tracker`` (where the run starts).

A call that raises in torch's scaler must raise the same type in ampscaler's, and both are then
left as they are. After every rule both must agree: scale, growth tracker, parameters and
gradients bit for bit, which steps were skipped, every value read, the stages and flags of each
optimizer, the state dicts at iteration boundaries; ours' counters add up.

Left out, as deliberate differences (docs/migration.md, ``ampscaler.compat``): ``_scale``
before the first ``scale()`` (``None`` on torch's, the scale tensor on ours), its identity
after an assignment, writes into an entry of ``_per_optimizer_states`` (read-only on ours), and
a checkpoint loaded in the middle of an iteration (refused by ours). Left out as no code seen
does them (see the rules): ``_scale`` assigned between two optimizers' steps, and an entry of
one of two optimizers held across ``update()``.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch.amp.grad_scaler import _refresh_per_optimizer_state

import ampscaler
from scaler_readings import counts
from twins import nan_equal, torch_update

POISONS = st.sampled_from([None, None, float("inf"), float("nan")])
SCALES = st.sampled_from([1.0, 3.0, 200.0, 2.0**16, 2.0**20])


class Side:
    """One scaler with its own twin model and optimizers; ``entries``: those it took of
    ``_per_optimizer_states`` (a SAM hook's), by optimizer index."""

    def __init__(self, scaler: Any, two: bool) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)
        )
        body, head = self.model[0], self.model[2]
        first = body.parameters() if two else self.model.parameters()
        self.optimizers = [torch.optim.SGD(first, lr=0.05, momentum=0.9)]
        if two:
            self.optimizers.append(torch.optim.SGD(head.parameters(), lr=0.1))
        self.scaler = scaler
        self.entries: dict[int, Any] = {}

    def params(self, index: int | None = None) -> list[torch.Tensor]:
        if index is None:
            return list(self.model.parameters())
        return [p for group in self.optimizers[index].param_groups for p in group["params"]]

    def entry(self, index: int) -> Any:
        return self.scaler._per_optimizer_states[id(self.optimizers[index])]

    def walk(self) -> list[tuple[int, Any]]:
        """``_per_optimizer_states.items()``, each entry read, by optimizer index, READY ones
        without flags left out."""
        keys = [id(optimizer) for optimizer in self.optimizers]
        read = ((keys.index(k), _read(v)) for k, v in self.scaler._per_optimizer_states.items())
        return sorted(item for item in read if item[1] != ("READY", ([], 0)))


def _flag_sum(flags: dict[torch.device, torch.Tensor]) -> tuple[list[str], float]:
    return sorted(d.type for d in flags), sum(float(f) for f in flags.values())


def _read(entry: Any) -> tuple[str, tuple[list[str], float]]:
    return entry["stage"].name, _flag_sum(entry["found_inf_per_device"])


def _through_bytes(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


class PrivateNamesMachine(RuleBasedStateMachine):
    @initialize(
        two=st.booleans(),
        init_scale=SCALES,
        interval=st.sampled_from([1, 2, 3]),
        trained=st.sampled_from([0, 1, 1, 3]),
    )
    def start(self, two: bool, init_scale: float, interval: int, trained: int) -> None:
        """Twins, ``trained`` plain iterations into their run (most calls raise before the
        first ``scale()``: a few runs are kept there)."""
        kwargs = {"init_scale": init_scale, "growth_interval": interval}
        self.theirs = Side(torch.amp.GradScaler("cpu", **kwargs), two)
        self.ours = Side(ampscaler.GradScaler("cpu", **kwargs), two)
        self.sides = (self.theirs, self.ours)  # torch's first: it decides what raises
        self.count = len(self.ours.optimizers)
        self.batches = 0
        self.mid_iteration = False  # a backward since the iteration last ended
        self.hand_stepped: set[int] = set()  # stepped by _maybe_opt_step, as NeMo's step does
        for _ in range(trained):
            self.iteration(poison=None, where=0, element=0)

    @precondition(lambda self: self._all_ready())
    @rule(poison=POISONS, where=st.integers(0, 3), element=st.integers(0, 8))
    def iteration(self, poison: float | None, where: int, element: int) -> None:
        """A plain iteration: zero_grad, backward, step each optimizer, update."""
        self.backward(poison, where, element, zero=True)
        for index in range(self.count):
            self.step(index)
        self.update(new_scale=None, as_tensor=False)

    # ------------------------------------------------------------------ helpers

    def _both(self, call: Callable[[Side], Any], starts: bool = False) -> tuple[Any, Any] | None:
        """``call`` on torch's side, then on ours: both return (their results, torch's first),
        or both raise an exception of torch's type (``None``; both are left as they are).
        ``starts``: a call that begins an iteration, even where it raises midway (a step of
        an optimizer without gradients has unscaled it first, in both): ours then refuses a
        checkpoint load until ``update()``, as docs/migration.md says."""
        self.mid_iteration |= starts
        try:
            theirs = call(self.theirs)
        except Exception as error:
            with pytest.raises(type(error)):
                call(self.ours)
            return None
        return theirs, call(self.ours)

    def _same(self, call: Callable[[Side], Any], starts: bool = False) -> None:
        results = self._both(call, starts)
        if results is not None:
            assert results[0] == results[1]

    def _used(self) -> bool:
        """Whether torch's scaler made its scale tensor (a first ``scale()`` since it was made
        or loaded into)."""
        return self.theirs.scaler._scale is not None

    def _stages(self) -> list[str]:
        return [self.theirs.entry(i)["stage"].name for i in range(self.count)]

    def _all_ready(self) -> bool:
        return all(stage == "READY" for stage in self._stages())

    def _ended(self, summed: bool = False) -> None:
        """The iteration ended; ``summed``: by an update() (torch's, or the copy) that added
        the flags of all optimizers in place into the first of ``_per_optimizer_states``.
        Then an entry of one of two optimizers, held across the end, is read no more: the
        first in torch's order (optimizers in the order their keys were first read) holds the
        sum, in ours' (the order the iteration met them) each holds its own or the sum. No
        code seen holds one across update() with two optimizers (a SAM hook does with one)."""
        self.mid_iteration = False
        self.hand_stepped.clear()
        if summed and self.count > 1:
            for side in self.sides:
                side.entries.clear()

    def _stepping(self, index: int, call: Callable[[Side], Any], public: bool = True) -> None:
        """``call`` steps optimizer ``index`` (or skips it) on each side: both must skip alike
        (parameters unchanged), skip when torch's flags say so, and return alike; after a
        ``public`` ``step()``, ours says it skipped exactly when torch's flags say so. (Not the
        converse: gradients unscaled twice, which torch allows, can be too small to move a
        parameter.)"""
        before = [[p.detach().clone() for p in side.params(index)] for side in self.sides]
        results = self._both(call, starts=True)
        if results is None:
            return
        skipped = [
            all(torch.equal(a, b) for a, b in zip(old, side.params(index), strict=True))
            for old, side in zip(before, self.sides, strict=True)
        ]
        assert skipped[0] == skipped[1]
        flagged = _flag_sum(self.theirs.scaler._found_inf_per_device(self.theirs.optimizers[index]))
        assert skipped[0] or not flagged[1]
        assert results[0] == results[1]
        if public:
            assert self.ours.scaler.last_step_skipped is (flagged[1] > 0)

    # ------------------------------------------------------------------ public calls

    @precondition(lambda self: self._all_ready())
    @rule(
        poison=POISONS,
        where=st.integers(0, 3),
        element=st.integers(0, 8),
        zero=st.sampled_from([None, False, True]),
    )
    def backward(self, poison: float | None, where: int, element: int, zero: bool | None) -> None:
        data = torch.Generator().manual_seed(self.batches)
        self.batches += 1
        inputs, target = torch.randn(4, 3, generator=data), torch.randn(4, 1, generator=data)
        for side in self.sides:
            if zero is not None:  # else accumulate
                for optimizer in side.optimizers:
                    optimizer.zero_grad(set_to_none=zero)
            out = side.model(inputs).half().float()  # the gradient passes through float16
            side.scaler.scale((out - target).pow(2).mean()).backward()
            grad = side.params()[where].grad
            if poison is not None and grad is not None:
                grad.view(-1)[element % grad.numel()] = poison
        self.mid_iteration = True

    @rule(index=st.integers(0, 1))
    def unscale(self, index: int) -> None:
        index %= self.count
        if index not in self.hand_stepped:
            self._both(lambda side: side.scaler.unscale_(side.optimizers[index]), starts=True)

    @rule(index=st.integers(0, 1))
    def step(self, index: int) -> None:
        index %= self.count
        if index not in self.hand_stepped:
            self._stepping(index, lambda side: side.scaler.step(side.optimizers[index]))

    @rule(new_scale=st.one_of(st.none(), SCALES), as_tensor=st.booleans())
    def update(self, new_scale: float | None, as_tensor: bool) -> None:
        argument: Any = new_scale
        if new_scale is not None and as_tensor:
            argument = torch.tensor(new_scale)
        if self._both(lambda side: side.scaler.update(argument)) is not None:
            self._ended(summed=new_scale is None)

    @rule(new_scale=st.one_of(st.none(), SCALES))
    def copied_update(self, new_scale: float | None) -> None:
        """torch's update() copied into code of one's own (NeMo's, Composer's scalers)."""
        if self._both(lambda side: torch_update(side.scaler, new_scale)) is not None:
            self._ended(summed=new_scale is None)

    @precondition(lambda self: not self.mid_iteration)
    @rule(fresh=st.booleans())
    def round_trip(self, fresh: bool) -> None:
        """A checkpoint through bytes, loaded into a new scaler built with the defaults (the
        checkpoint's configuration must win) or into the same one."""
        for side in self.sides:
            saved = _through_bytes(side.scaler.state_dict())
            if fresh:
                side.scaler = type(side.scaler)("cpu")
            side.scaler.load_state_dict(saved)
        self._ended()

    # ------------------------------------------------------------------ private reads

    @rule()
    def read_state(self) -> None:
        def read(side: Side) -> Any:
            scaler = side.scaler
            scale, tracker = scaler._scale, scaler._growth_tracker
            values = scaler._get_growth_tracker(), scaler._init_scale, scaler._init_growth_tracker
            if not self._used():  # torch's: None; ours: the tensor (docs/migration.md)
                return values
            assert scaler._get_scale_async() is scale
            return (scale.item(), scale.dtype, tracker.item(), tracker.dtype, *values)

        self._same(read)

    @rule(index=st.integers(0, 1))
    def take_entry(self, index: int) -> None:
        """A SAM step takes the entry before unscale_() and reads its flags after it."""
        index %= self.count
        for side in self.sides:
            side.entries[index] = side.entry(index)

    @rule(index=st.integers(0, 1))
    def read_entry(self, index: int) -> None:
        index %= self.count
        if index in self.theirs.entries:
            self._same(lambda side: _read(side.entries[index]))

    @rule(index=st.integers(0, 1))
    def found_inf_per_device(self, index: int) -> None:
        index %= self.count
        self._same(
            lambda side: _flag_sum(side.scaler._found_inf_per_device(side.optimizers[index]))
        )

    @rule()
    def check_scale_growth_tracker(self) -> None:
        def read(side: Side) -> tuple[float, int]:
            scale, tracker = side.scaler._check_scale_growth_tracker("update")
            return scale.item(), int(tracker.item())

        self._same(read)

    # ------------------------------------------------------------------ private calls, writes

    @rule(index=st.integers(0, 1))
    def check_inf_per_device(self, index: int) -> None:
        """torch's step() for an optimizer of the grad_scaler= protocol, before its step; a
        training loop that checks after unscale_() and clipping, then update()s without a step
        when it found an overflow."""
        index %= self.count
        self._same(
            lambda side: _flag_sum(side.scaler._check_inf_per_device(side.optimizers[index])),
            starts=True,
        )

    @rule(index=st.integers(0, 1))
    def maybe_opt_step(self, index: int) -> None:
        """NeMo's step: after unscale_(), its _maybe_opt_step steps the optimizer unless the
        entry's flags say not to."""
        index %= self.count
        if self._stages()[index] != "UNSCALED" or index in self.hand_stepped:
            return
        self._stepping(
            index,
            lambda side: side.scaler._maybe_opt_step(side.optimizers[index], side.entry(index)),
            public=False,
        )
        self.hand_stepped.add(index)

    @rule(zero=st.booleans())
    def fresh_states(self, zero: bool) -> None:
        """Composer drops a batch it runs again (zeroing the gradients); copied update()s end
        an iteration so."""
        for side in self.sides:
            if zero:
                for optimizer in side.optimizers:
                    optimizer.zero_grad()
            side.scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._ended()

    @rule(
        name=st.sampled_from(["_growth_factor", "_backoff_factor", "_growth_interval"]),
        pick=st.integers(0, 2),
    )
    def set_rule_number(self, name: str, pick: int) -> None:
        value = {
            "_growth_factor": [2.0, 4.0, 1.5],
            "_backoff_factor": [0.5, 0.25, 0.75],
            "_growth_interval": [1, 2, 3],
        }[name][pick]
        for side in self.sides:
            setattr(side.scaler, name, value)

    @precondition(lambda self: self._used() and self._all_ready())
    @rule(floor=SCALES)
    def floor_scale(self, floor: float) -> None:
        """Training code holding the scale at a floor of its own, after update() (or before
        the first unscale_() or step() of an iteration). Not between two optimizers' steps:
        torch unscales the second by the new tensor, ours by the scale the iteration's first
        unscale took (no code seen assigns it there)."""
        for side in self.sides:
            scaler = side.scaler
            if scaler._scale < floor:
                scaler._scale = torch.tensor(floor).to(scaler._scale)

    @rule(init_scale=SCALES, tracker=st.integers(0, 2))
    def choose_start(self, init_scale: float, tracker: int) -> None:
        """Where the run starts, assigned before the first scale() (torch reads them then;
        later, both keep them and change nothing)."""
        for side in self.sides:
            side.scaler._init_scale = init_scale
            side.scaler._init_growth_tracker = tracker

    @precondition(lambda self: self._used() and self._all_ready())
    @rule(tracker=st.integers(0, 3))
    def set_growth_tracker(self, tracker: int) -> None:
        """A test setting a state to save."""
        for side in self.sides:
            side.scaler._growth_tracker = torch.tensor(tracker, dtype=torch.int32)

    @precondition(lambda self: not self._used())
    @rule()
    def lazy_init(self) -> None:
        """Accelerate's FSDP2 checkpoint loading makes the state before the first scale()."""
        for side in self.sides:
            side.scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))

    # ------------------------------------------------------------------ invariants

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "ours"):
            return
        theirs, ours = self.theirs.scaler, self.ours.scaler
        assert ours.get_scale() == theirs.get_scale()
        assert ours._get_growth_tracker() == theirs._get_growth_tracker()
        for name in ("_growth_factor", "_backoff_factor", "_growth_interval", "_enabled"):
            assert getattr(ours, name) == getattr(theirs, name), name
        for index, (mine, other) in enumerate(
            zip(self.ours.params(), self.theirs.params(), strict=True)
        ):
            assert nan_equal(mine.detach(), other.detach()), f"parameter {index}"
            assert nan_equal(mine.grad, other.grad), f"gradient of parameter {index}"
        for index in range(self.count):
            assert _read(self.ours.entry(index)) == _read(self.theirs.entry(index)), index
        # As code walks them (torch's update() sums the flags of all): the entries that say
        # something (torch's also holds an empty one for each key read)
        assert self.ours.walk() == self.theirs.walk()
        stats = counts(ours)
        assert stats.skipped <= stats.steps and stats.growths + stats.backoffs <= stats.steps
        assert stats.consecutive_skips <= stats.skipped
        if not self.mid_iteration:
            saved, torch_saved = ours.state_dict(), theirs.state_dict()
            assert {key: saved[key] for key in torch_saved} == torch_saved


# Short in CI; `--hypothesis-profile=explore-long --hypothesis-seed=N` runs the profile's count.
PrivateNamesMachine.TestCase.settings = settings(
    max_examples=max(200, settings.default.max_examples),
    stateful_step_count=30,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow],
)
TestPrivateNamesMachine = PrivateNamesMachine.TestCase
