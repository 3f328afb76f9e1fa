"""The wheel against a reference model, driven by Hypothesis.

The model is a dict of pending timers: handle -> (deadline_ns, payload).
A fake clock moves only through ``poll(now)``; deadlines are drawn at
offsets around every level boundary (W**l ticks, for W = 16 so that the
levels are many and reachable) and overflow into every level.  After every
step the C invariant checker runs and ``len()`` must equal the model.
"""

from __future__ import annotations

import hypothesis.strategies as st
from conftest import fresh_name, header
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

import shmwheel
from shmwheel._binding import ffi, lib

TICK_NS = 1_000_000
WHEEL_BITS = 4
W = 1 << WHEEL_BITS
LEVELS = lib.shmw_levels_for(TICK_NS, WHEEL_BITS)
#: Deadlines and clocks stay below this (~146 years of uptime) so that a
#: long run of far jumps never overflows an int64 of nanoseconds.
LIMIT_NS = lib.SHMW_MAX_DELAY_NS


def to_ns(seconds: float) -> int:
    """The C core's own seconds-to-nanoseconds conversion."""
    out = ffi.new("int64_t *")
    assert lib.shmw_seconds_to_ns(seconds, out) == 0
    return out[0]


def ticks_ceil(ns: int) -> int:
    return -(-ns // TICK_NS)


# Offsets (in ticks) that sit on, just before and just after every level
# boundary, plus a few anywhere; then a sub-tick offset in nanoseconds.
boundary_ticks = st.builds(
    lambda level, k, d: max(0, k * W**level + d),
    st.integers(0, LEVELS - 1),
    st.sampled_from([1, 2, W - 1, W]),
    st.integers(-2, 2),
)
offset_ticks = st.one_of(boundary_ticks, st.integers(0, 3 * W), st.integers(0, W**4))
sub_tick_ns = st.sampled_from([0, 1, TICK_NS // 2, TICK_NS - 1])
payloads = st.binary(max_size=8)


class WheelMachine(RuleBasedStateMachine):
    handles = Bundle("handles")

    SHARDS = 1

    @initialize()
    def setup(self) -> None:
        self.name = fresh_name()
        self.wheel = shmwheel.create(
            self.name, capacity=64, tick=TICK_NS / 1e9, payload_size=8, wheel_size=W, shards=self.SHARDS
        )
        self.index_mask = (1 << lib.shmw_index_bits(64)) - 1
        self.now_ns = round(self.wheel.stats().clock * 1e9)
        self.model: dict[int, tuple[int, bytes]] = {}
        # The tick each timer fires at: its own, or the wheel clock's if it
        # was already due when added (those fire in the order they came).
        self.fire_tick: dict[int, int] = {}
        self.full = False

    def teardown(self) -> None:
        wheel = getattr(self, "wheel", None)
        if wheel is not None:
            try:
                wheel.check()
            finally:
                wheel.close()
                shmwheel.unlink(self.name)

    # -- rules ---------------------------------------------------------------

    @rule(target=handles, ticks=offset_ticks, ns=sub_tick_ns, payload=payloads, behind=st.booleans())
    def add_at(self, ticks: int, ns: int, payload: bytes, behind: bool) -> int:
        base = self.now_ns - ticks * TICK_NS if behind else self.now_ns + ticks * TICK_NS
        deadline = min(max(0, base + ns), LIMIT_NS) / 1e9
        if len(self.model) == 64:
            try:
                self.wheel.add_at(deadline, payload)
            except shmwheel.WheelFullError:
                return -1
            raise AssertionError("a full wheel accepted a timer")
        h = self.wheel.add_at(deadline, payload)
        assert h not in self.model
        self.model[h] = (to_ns(deadline), payload)
        self.fire_tick[h] = max(ticks_ceil(to_ns(deadline)), self.wheel_clock(h))
        return h

    def shard(self, h: int) -> int:
        return (h & self.index_mask) // (64 // self.SHARDS)

    def wheel_clock(self, h: int) -> int:
        """The clock of the shard the timer is in."""
        return header(self.wheel, self.shard(h)).elapsed

    @rule(h=handles)
    def cancel(self, h: int) -> None:
        if h < 0:  # the marker for "the wheel was full"
            return
        assert self.wheel.cancel(h) is (h in self.model)
        self.model.pop(h, None)

    @rule(h=consumes(handles))
    def cancel_and_forget(self, h: int) -> None:
        self.cancel(h)

    @rule(h=handles, ticks=offset_ticks, ns=sub_tick_ns)
    def reset_at(self, h: int, ticks: int, ns: int) -> None:
        if h < 0:
            return
        deadline = min(self.now_ns + ticks * TICK_NS + ns, LIMIT_NS) / 1e9
        expected = h in self.model
        assert self.wheel.reset_at(h, deadline) is expected
        if expected:
            self.model[h] = (to_ns(deadline), self.model[h][1])
            self.fire_tick[h] = max(ticks_ceil(to_ns(deadline)), self.wheel_clock(h))

    @rule(ticks=offset_ticks, ns=sub_tick_ns, max_fires=st.one_of(st.none(), st.integers(0, 5)))
    def poll(self, ticks: int, ns: int, max_fires: int | None) -> None:
        now_ns = min(self.now_ns + ticks * TICK_NS + ns, LIMIT_NS)
        fires = self.wheel.poll(now_ns / 1e9, max_fires=max_fires)
        now_tick = to_ns(now_ns / 1e9) // TICK_NS
        due = {h for h, (d, _) in self.model.items() if ticks_ceil(d) <= now_tick}
        got = [f.handle for f in fires]
        assert len(got) == len(set(got)), "a timer fired twice"
        if max_fires is None:
            assert set(got) == due
        else:
            assert len(got) == min(max_fires, len(due)) and set(got) <= due
        last_tick: dict[int, int] = {}  # a shard's fires come in order; a poll hands out the shards in turn
        for f in fires:
            deadline_ns, payload = self.model.pop(f.handle)
            assert f.deadline_ns == deadline_ns
            assert f.payload == payload
            assert f.fired_at_ns == to_ns(now_ns / 1e9)
            assert f.fired_at_ns >= f.deadline_ns, "fired before its deadline"
            shard = self.shard(f.handle)
            assert self.fire_tick[f.handle] >= last_tick.get(shard, 0), "out of firing order"
            last_tick[shard] = self.fire_tick[f.handle]
        self.now_ns = now_ns

    # -- invariants --------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "wheel"):
            self.wheel.check()
            assert len(self.wheel) == len(self.model)


class ShardedWheelMachine(WheelMachine):
    """The same on a wheel of two shards of 32: the adds of this one
    process spill from its shard into the other once it is full."""

    SHARDS = 2


for machine in (WheelMachine, ShardedWheelMachine):
    machine.TestCase.settings = settings(
        max_examples=150,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
TestWheelAgainstModel = WheelMachine.TestCase
TestShardedWheelAgainstModel = ShardedWheelMachine.TestCase
