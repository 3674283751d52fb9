"""Stragglers: each process's own step time, process 0's detection of one persistently over the others' median
(through a fake key-value store shared by several in-process "processes"), and the watchdog's peer lines."""

import io

import pytest

from jaxtrain import config as config_lib
from jaxtrain import faults, hooks
from jaxtrain.errors import ConfigError


class FakeStore:
    """jax.distributed's key-value store as a dict (parallel.distributed.KeyValueStore's methods)."""

    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value

    def dir(self, prefix):
        return {k.removeprefix(prefix): v for k, v in self.kv.items() if k.startswith(prefix)}

    def delete(self, key):
        self.kv = {k: v for k, v in self.kv.items() if not (k == key or (key.endswith("/") and k.startswith(key)))}


class FakeClock:
    def __init__(self):
        self.wall, self.device_wait_s = 0.0, 0.0

    def train_seconds(self):
        return self.wall


def test_own_step_time_is_the_wall_time_less_the_wait_for_slower_peers():
    # A synchronous step: 1.5 s everywhere; process 2 kept the others waiting 0.5 s beyond the device's 0.2 s.
    own = hooks.own_step_times({0: (1.5, 0.7), 1: (1.5, 0.7), 2: (1.5, 0.2)})
    assert own == pytest.approx({0: 1.0, 1: 1.0, 2: 1.5})
    assert hooks.Stragglers.ratios(own)[2] == pytest.approx(1.5)


def test_a_process_is_named_once_it_is_slow_in_three_reports_in_a_row_and_again_when_it_recovers():
    tracker = hooks.Stragglers(factor=1.5)
    hosts = {0: "a", 1: "b", 2: "c"}
    slow = {0: (2.0, 1.0), 1: (2.0, 1.0), 2: (2.0, 0.0)}  # process 2: 2 s against the others' 1 s
    even = {0: (1.0, 0.1), 1: (1.0, 0.1), 2: (1.0, 0.1)}
    assert tracker.add(50, slow, hosts) == [] and tracker.add(100, slow, hosts) == []
    assert tracker.add(150, even, hosts) == []  # not persistent: the count starts again
    assert tracker.add(200, slow, hosts) == [] and tracker.add(250, slow, hosts) == []
    lines = tracker.add(300, slow, hosts)
    assert lines == ["straggler: host c (process 2) step 2s, 2.0x the median of the others, over the last 3 "
                     "reports (steps 200..300)"]
    assert tracker.add(350, slow, hosts) == []  # named once
    assert tracker.add(400, even, hosts) == ["straggler: host c (process 2) is back under 1.5x the median of the "
                                             "others at step 400 (1.0x)"]


def test_two_processes_compare_each_with_the_other():
    # The median of both would hide a 2x straggler among two processes (2 / 1.5 = 1.33x).
    tracker = hooks.Stragglers(factor=1.5, rounds=1)
    assert tracker.add(10, {0: (2.0, 1.0), 1: (2.0, 0.0)}, {0: "a", 1: "b"})[0].startswith(
        "straggler: host b (process 1) step 2s, 2.0x")


def make_processes(n, every=2, store=None):
    store = store or FakeStore()
    logs = [[] for _ in range(n)]
    clocks = [FakeClock() for _ in range(n)]
    procs = [hooks.StragglerHook(store, process=p, processes=n, every=every, factor=1.5, clock=clocks[p],
                                 start_step=0, print_fn=logs[p].append, host=f"host{p}", hang_wait_s=0.0)
             for p in range(n)]
    return store, procs, clocks, logs


def run_steps(procs, clocks, steps, slow=None, start=1):
    """Every process runs `steps` steps of 1 s; `slow`'s steps take 3 s, which the others spend waiting."""
    for step in range(start, start + steps):
        for p, (hook, clock) in enumerate(zip(procs, clocks)):
            clock.wall += 3.0 if slow is not None else 1.0
            clock.device_wait_s += 0.5 + (2.0 if slow is not None and p != slow else 0.0)
            hook(step, None, None, None)


def test_process_0_names_the_slow_host_from_the_others_reports():
    store, procs, clocks, logs = make_processes(4)
    run_steps(procs, clocks, 6)
    assert logs == [[], [], [], []]
    run_steps(procs, clocks, 8, slow=3, start=7)
    # Reports at steps 8, 10, 12, 14; process 0 reads each round at the next one.
    assert logs[0] == ["straggler: host host3 (process 3) step 3s, 3.0x the median of the others, over the last 3 "
                       "reports (steps 8..12)"]
    assert logs[1:] == [[], [], []]  # process 0 alone logs
    # Rounds read are deleted but for the newest two (the watchdog's), so the store does not grow.
    assert sorted({k.split("/")[2] for k in store.kv if k.startswith(hooks.StragglerHook.PREFIX)}) == ["10", "12", "14"]


def test_no_reports_when_off_and_a_rewind_starts_the_window_again():
    store, procs, clocks, logs = make_processes(2, every=0)
    run_steps(procs, clocks, 4, slow=1)
    assert not any(k.startswith(hooks.StragglerHook.PREFIX) for k in store.kv) and logs == [[], []]
    store, procs, clocks, logs = make_processes(2)
    run_steps(procs, clocks, 4)
    for hook in procs:
        hook.rewind(2)  # a NaN rollback: steps 3.. again; the round of step 4 is published again, not read twice
    run_steps(procs, clocks, 2, start=3)
    assert store.dir(f"{hooks.StragglerHook.PREFIX}4/") == {"0": "1.0 0.5", "1": "1.0 0.5"}


def test_the_watchdog_dump_names_the_peer_that_is_not_stuck_and_the_slowest():
    store, procs, clocks, logs = make_processes(3)
    run_steps(procs, clocks, 4, slow=2)
    procs[1].peer_report()  # process 1 is stuck too; process 2 is not
    lines = procs[0].peer_report()
    assert lines == ["peers: not stuck with this one (no watchdog report within 0 s), the likely cause: process 2 "
                     "on host2",
                     "peers: the slowest at the last report (step 4): process 2 on host2, step 3s, 3.0x the median "
                     "of the others"]
    assert procs[2].peer_report()[0] == "peers: all 3 processes are stuck (last steps: ['4'])"


def dump_with(report, timeout_s=5.0):
    out = io.StringIO()
    dog = faults.Watchdog(1.0, stream=out, exit_fn=lambda code: None)
    dog.peer_report, dog.PEER_REPORT_S = report, timeout_s
    dog._dump(1.5, out)
    return out.getvalue()


def test_the_watchdog_dump_has_the_peer_lines_and_never_waits_long_for_them():
    import threading

    assert "peers: process 1 is behind\n" in dump_with(lambda: ["peers: process 1 is behind"])
    assert "peers: no report (OSError: coordinator gone)" in dump_with(lambda: (_ for _ in ()).throw(
        OSError("coordinator gone")))
    never = threading.Event()
    assert "peers: no answer within 0.2 s" in dump_with(lambda: never.wait() and [], timeout_s=0.2)
    never.set()


@pytest.mark.parametrize("field, value", [("straggler_every_steps", 1), ("straggler_every_steps", -2),
                                          ("straggler_factor", 1.0), ("straggler_factor", "x")])
def test_bad_straggler_settings_name_the_field(field, value):
    group = {**config_lib.base_config().faults.to_dict(), field: value}
    with pytest.raises(ConfigError, match=f"faults.{field}"):
        faults.check_config(group)
