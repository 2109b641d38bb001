"""The sampler's in-flight pieces without a model (docs/async_rl.md): the per-run target table
(``inflight.InflightTargets``: monotone, per run, refusals change nothing, thread-safe), the follow hook
(``inflight.Follower``: moves once to a newer usable version and pins it once, keeps its pins until
closed, never pins after), version spans (``backend.add_token`` as ``decode_steps`` drives it), the
residency checks the follow and install paths rely on (``usable``, ``reserve(keep=...)``) and the
install queue (``installs.PendingInstalls``, through the servicer's own ``_install_one`` on a fake
backend). tests/engine/test_inflight_sampler.py covers the same paths with a real model."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from temper.common.errors import AdapterNotLoaded, InvalidArgument, ResourceExhausted
from temper.services.sampler.backend import VersionSpan, WeightsVersion, add_token
from temper.services.sampler.decode_steps import _follow
from temper.services.sampler.inflight import Follower, InflightTargets, Target
from temper.services.sampler.installs import Busy, PendingInstalls
from temper.services.sampler.residency import Residency
from temper.services.sampler.servicer import SamplerServicer

RUN = "run-r"


def v(n: int, run: str = RUN) -> WeightsVersion:
    return WeightsVersion(f"tinker://{run}/sampler_weights/inflight-{n}", n)


def loaded(*keys: str, max_adapters: int = 8, max_bytes: int = 0, size: int = 0) -> Residency:
    residency = Residency(max_adapters, max_bytes)
    for key in keys:
        residency.reserve(key, size)
        residency.loaded(key)
    return residency


# ---- the target table -------------------------------------------------------------------------

def test_the_table_only_moves_forward_and_answers_the_held_version():
    targets = InflightTargets()
    assert targets.get(RUN) is None and targets.newer(RUN, 0) is None
    assert targets.advance(RUN, "k1", v(1)) == Target("k1", v(1))
    assert targets.advance(RUN, "k3", v(3)) == Target("k3", v(3))
    assert targets.advance(RUN, "k2", v(2)) == Target("k3", v(3))     # older: ignored, the held one answered
    assert targets.advance(RUN, "other", v(3)) == Target("k3", v(3))  # not newer: the held key stays
    assert targets.get(RUN) == Target("k3", v(3))
    assert targets.newer(RUN, 2) == Target("k3", v(3))
    assert targets.newer(RUN, 3) is None and targets.newer(RUN, 7) is None


def test_runs_are_independent():
    targets = InflightTargets()
    targets.advance("a", "ka5", v(5, "a"))
    targets.advance("b", "kb1", v(1, "b"))
    assert targets.advance("b", "kb2", v(2, "b")) == Target("kb2", v(2, "b"))   # a's 5 does not hold b back
    assert targets.get("a") == Target("ka5", v(5, "a"))
    assert targets.newer("a", 2) == Target("ka5", v(5, "a")) and targets.newer("b", 2) is None
    assert targets.get("c") is None


@pytest.mark.parametrize("run,key,version", [("", "k9", 9), (RUN, "", 9), (RUN, "k9", 0), (RUN, "k9", -1)])
def test_bad_targets_are_refused_and_change_nothing(run, key, version):
    targets = InflightTargets()
    targets.advance(RUN, "k2", v(2))
    with pytest.raises(InvalidArgument) as refused:
        targets.advance(run, key, WeightsVersion("p", version))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert targets.get(RUN) == Target("k2", v(2)) and targets.get("") is None
    empty = InflightTargets()
    with pytest.raises(InvalidArgument):
        empty.advance(run, key, WeightsVersion("p", version))
    assert empty.get(run) is None and empty.get(RUN) is None


def test_concurrent_advances_keep_the_newest_and_readers_never_see_it_go_back():
    targets, stop = InflightTargets(), threading.Event()
    seen: list[int] = []
    answers: list[tuple[int, int]] = []   # (version asked, version answered)
    lock = threading.Lock()

    def reader():
        while not stop.is_set():
            held = targets.get(RUN)
            seen.append(held.weights.version if held else 0)

    def writer(seed: int):
        versions = list(range(1, 201))
        random.Random(seed).shuffle(versions)
        for n in versions:
            held = targets.advance(RUN, f"k{n}", v(n))
            with lock:
                answers.append((n, held.weights.version))

    watcher = threading.Thread(target=reader)
    watcher.start()
    writers = [threading.Thread(target=writer, args=(seed,)) for seed in range(6)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    watcher.join()
    assert targets.get(RUN) == Target("k200", v(200))   # key and version of one advance, never mixed
    assert len(answers) == 6 * 200 and all(held >= asked for asked, held in answers)
    assert seen == sorted(seen)


# ---- the follow hook --------------------------------------------------------------------------

def test_a_follower_moves_once_pins_once_and_keeps_its_pins_until_closed():
    residency, targets = loaded("A", "B", "C"), InflightTargets()
    targets.advance(RUN, "A", v(1))
    start = residency.use("A")                       # the request's own pin (servicer._using)
    follow = Follower(targets, RUN, residency.use)
    assert follow(v(1)) is None and residency.pins("B") == 0
    targets.advance(RUN, "B", v(2))
    assert follow(v(1)) == ("B", v(2))
    assert follow(v(1)) == ("B", v(2))              # asked again: the same answer, no second pin
    assert residency.pins("B") == 1 and residency.pins("A") == 1   # the old pin stays
    assert follow(v(2)) is None                      # on the newest: stays
    targets.advance(RUN, "C", v(3))
    assert follow(v(2)) == ("C", v(3))
    assert [residency.pins(k) for k in "ABC"] == [1, 1, 1]
    pins = follow.close()
    assert [key for key, _ in pins] == ["B", "C"]
    for _, pin in pins:
        residency.release(pin)
    residency.release(start)
    assert [residency.pins(k) for k in "ABC"] == [0, 0, 0]


def test_a_follower_stays_put_while_the_new_adapter_is_not_usable():
    residency, targets = loaded("A", "C"), InflightTargets()
    follow = Follower(targets, RUN, residency.use)
    residency.reserve("B", 0)                        # pushed, still loading
    targets.advance(RUN, "B", v(2))
    assert follow(v(1)) is None and residency.pins("B") == 0
    residency.loaded("B")
    assert follow(v(1)) == ("B", v(2)) and residency.pins("B") == 1
    residency.retire("C")                            # being dropped: no new uses
    targets.advance(RUN, "C", v(3))
    assert follow(v(2)) is None and residency.pins("C") == 0
    targets.advance(RUN, "D", v(4))                  # never here at all
    assert follow(v(2)) is None
    assert [key for key, _ in follow.close()] == ["B"]


def test_a_closed_follower_never_pins_again():
    residency, targets = loaded("A", "B"), InflightTargets()
    follow = Follower(targets, RUN, residency.use)
    assert follow.close() == []
    targets.advance(RUN, "B", v(2))
    assert follow(v(1)) is None and residency.pins("B") == 0
    assert follow.close() == []


def test_pins_taken_while_following_are_all_returned_by_close():
    """Follow (compute thread) races the request's end (event loop): every pin taken is handed back by
    close, none after."""
    keys = [f"k{n}" for n in range(1, 301)]
    residency, targets = loaded(*keys, max_adapters=len(keys)), InflightTargets()
    follow = Follower(targets, RUN, residency.use)
    closed = threading.Event()

    def decode():
        current = v(0)
        while not closed.is_set():
            moved = follow(current)
            if moved is not None:
                current = moved[1]

    thread = threading.Thread(target=decode)
    thread.start()
    targets.advance(RUN, keys[0], v(1))
    while residency.pins(keys[0]) == 0:   # it follows (then the race: advances against the close)
        closed.wait(0.001)
    for n, key in enumerate(keys[1:200], start=2):
        targets.advance(RUN, key, v(n))
    pins = follow.close()
    closed.set()
    for n, key in enumerate(keys[200:], start=201):
        targets.advance(RUN, key, v(n))
    thread.join()
    assert len({key for key, _ in pins}) == len(pins) > 0
    assert sum(residency.pins(k) for k in keys) == len(pins)
    assert all(residency.pins(k) == 0 for k in keys[200:])
    for _, pin in pins:
        residency.release(pin)
    assert sum(residency.pins(k) for k in keys) == 0


# ---- version spans ----------------------------------------------------------------------------

def test_consecutive_tokens_of_one_version_merge_and_a_switch_starts_a_new_span():
    spans: list[VersionSpan] = []
    for position, n in enumerate([1, 1, 1, 2, 2, 4]):
        add_token(spans, v(n), position)
    assert spans == [VersionSpan(v(1), 0, 3), VersionSpan(v(2), 3, 2), VersionSpan(v(4), 5, 1)]
    assert sum(s.count for s in spans) == 6


def test_a_switch_decided_after_token_s_minus_1_makes_token_s_the_first_of_the_new_span():
    """decode_steps' order per step: record the token on the row's version, then ask the follow hooks."""
    residency, targets = loaded("A", "B"), InflightTargets()
    targets.advance(RUN, "A", v(1))

    def state(retarget):
        return SimpleNamespace(request=SimpleNamespace(retarget=retarget), alive=[True], key="A", weights=v(1), spans=[])

    following, pinned = state(Follower(targets, RUN, residency.use)), state(None)
    ended = state(Follower(targets, RUN, residency.use))
    ended.alive = [False]
    live, moved_at = [following, pinned, ended], []
    for position in range(8):
        for s in live[:2]:
            add_token(s.spans, s.weights, position)
        if position == 3:
            targets.advance(RUN, "B", v(2))
        if _follow(live):
            moved_at.append(position)
    assert moved_at == [3]
    assert following.key == "B" and following.spans == [VersionSpan(v(1), 0, 4), VersionSpan(v(2), 4, 4)]
    assert pinned.key == "A" and pinned.spans == [VersionSpan(v(1), 0, 8)]
    assert ended.key == "A" and ended.weights == v(1)   # a finished request is not asked (pins nothing)
    assert residency.pins("B") == 1


# ---- residency: usable() and reserve(keep=...) ------------------------------------------------

def test_usable_means_loaded_and_not_being_dropped():
    residency = loaded("A")
    assert residency.usable("A") and not residency.usable("B")
    residency.reserve("B", 10)
    assert not residency.usable("B")                 # loading
    with pytest.raises(AdapterNotLoaded):
        residency.use("B")
    residency.loaded("B")
    assert residency.usable("B")
    residency.reserve("B", 20)                       # being replaced: the old weights serve meanwhile
    assert residency.usable("B")
    residency.retire("A")
    assert not residency.usable("A")
    with pytest.raises(AdapterNotLoaded):
        residency.use("A")


def test_reserve_never_evicts_a_kept_adapter_and_changes_nothing_without_room():
    residency = loaded("A", "B", max_adapters=2)     # A least recently used
    assert residency.reserve("C", 0, keep=frozenset({"A"})) == ["B"]
    assert residency.keys() == ["A", "C"]
    residency.loaded("C")
    with pytest.raises(ResourceExhausted):
        residency.reserve("D", 0, keep=frozenset({"A", "C"}))
    assert residency.keys() == ["A", "C"] and residency.usable("A") and residency.usable("C")
    by_bytes = loaded("A", "B", max_bytes=100, size=40)
    with pytest.raises(ResourceExhausted):
        by_bytes.reserve("C", 60, keep=frozenset({"A", "B"}))
    assert by_bytes.keys() == ["A", "B"] and by_bytes.total_bytes == 80
    assert by_bytes.reserve("C", 60, keep=frozenset({"A"})) == ["B"]


# ---- the install queue ------------------------------------------------------------------------

def staged(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / f".push-{name}"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"x")
    return folder


class Recorder:
    """An install function: records each install; Busy for the keys in ``busy``; raises ``fail[key]``."""

    def __init__(self, fail: dict | None = None):
        self.installed: list[str] = []
        self.fail = fail or {}
        self.lock = threading.Lock()

    def __call__(self, job, busy):
        if busy is not None and job.key in busy:
            raise Busy(job.key)
        if job.key in self.fail:
            raise self.fail[job.key]
        with self.lock:
            self.installed.append(job.key)


def test_jobs_run_once_in_order_between_steps_or_when_idle(tmp_path):
    install = Recorder()
    queue = PendingInstalls(install)
    jobs = [queue.submit(k, staged(tmp_path, k), 1) for k in "XYZ"]
    queue.run(frozenset({"A"}))                      # between two decode steps of a batch on A
    queue.run()                                      # the idle compute thread comes after: nothing left
    assert install.installed == ["X", "Y", "Z"] and len(queue) == 0
    assert all(j.done.done() and j.done.result() is None and not j.folder.exists() for j in jobs)


def test_a_deferred_job_keeps_its_place_ahead_of_later_pushes(tmp_path):
    install = Recorder()
    queue = PendingInstalls(install)
    a, y = queue.submit("A", staged(tmp_path, "a"), 1), queue.submit("Y", staged(tmp_path, "y"), 1)
    queue.run(frozenset({"A"}))
    assert install.installed == ["Y"] and len(queue) == 1
    assert not a.done.done() and a.folder.exists()   # its staged files wait with it
    z = queue.submit("Z", staged(tmp_path, "z"), 1)  # pushed meanwhile: after the waiting one
    queue.run(frozenset({"A"}))                      # still decoding on A: A waits, Z does not
    assert install.installed == ["Y", "Z"] and len(queue) == 1
    queue.run()                                      # the batch ended
    assert install.installed == ["Y", "Z", "A"] and len(queue) == 0
    assert all(j.done.result() is None for j in (a, y, z)) and not a.folder.exists()


def test_a_later_push_of_a_deferred_key_lands_after_it(tmp_path):
    """The first push of C needs room only the batch's adapters could give (Busy); a second, smaller push
    of C that would fit must not be installed before it, else the older weights would win."""
    installed: list[tuple[str, int]] = []

    def install(job, busy):
        if busy is not None and job.size > 1:
            raise Busy(job.key)
        installed.append((job.key, job.size))

    queue = PendingInstalls(install)
    older, newer = queue.submit("C", staged(tmp_path, "c1"), 5), queue.submit("C", staged(tmp_path, "c2"), 1)
    queue.run(frozenset({"A"}))
    assert installed == [] and len(queue) == 2 and not newer.done.done()
    queue.run()
    assert installed == [("C", 5), ("C", 1)]         # the newest push is what C holds
    assert older.done.result() is None and newer.done.result() is None


def test_a_failure_reaches_its_push_and_later_jobs_still_run(tmp_path):
    refusal = InvalidArgument("bad adapter")
    install = Recorder(fail={"X": refusal})
    queue = PendingInstalls(install)
    bad, good = queue.submit("X", staged(tmp_path, "x"), 1), queue.submit("Y", staged(tmp_path, "y"), 1)
    queue.run()
    assert bad.done.exception() is refusal and not bad.folder.exists()
    assert good.done.result() is None and install.installed == ["Y"]


def test_a_cancelled_push_is_never_installed(tmp_path):
    install = Recorder()
    queue = PendingInstalls(install)
    gone = queue.submit("X", staged(tmp_path, "x"), 1)
    assert gone.done.cancel()
    deferred = queue.submit("A", staged(tmp_path, "a"), 1)
    queue.run(frozenset({"A"}))
    assert install.installed == [] and not gone.folder.exists() and len(queue) == 1
    assert deferred.done.cancel()                    # its push gave up while it waited for the batch
    queue.run()
    assert install.installed == [] and not deferred.folder.exists() and len(queue) == 0


def test_each_job_runs_exactly_once_when_both_takers_race(tmp_path):
    install = Recorder()
    queue = PendingInstalls(install)
    keys = [f"k{n}" for n in range(200)]
    done = threading.Event()

    def taker(busy):
        while not done.is_set() or len(queue):
            queue.run(busy)

    takers = [threading.Thread(target=taker, args=(b,)) for b in (frozenset({"B"}), None)]
    for t in takers:
        t.start()
    jobs = [queue.submit(k, staged(tmp_path, k), 1) for k in keys]
    done.set()
    for t in takers:
        t.join()
    assert sorted(install.installed) == sorted(keys) and all(j.done.result() is None for j in jobs)


class FakeBackend:
    """What the servicer's install path calls, recorded."""

    name = "fake"

    def __init__(self, keys):
        self.loaded, self.calls = list(keys), []

    def describe(self):
        return SimpleNamespace(loaded_checkpoints=list(self.loaded))

    def check_adapter(self, folder):
        pass

    def load_adapter(self, key, folder):
        self.calls.append(("load", key))

    def drop_adapter(self, key):
        self.calls.append(("drop", key))


def test_the_servicer_defers_an_install_that_would_replace_or_evict_the_batch_adapters(tmp_path):
    backend = FakeBackend(["A", "B"])
    servicer = SamplerServicer(backend, tmp_path / "adapters", max_num_samples=1, max_adapters=2)
    queue = servicer._installs
    replace_a = queue.submit("A", staged(tmp_path, "a"), 1)
    queue.run(frozenset({"A"}))                      # replacing what the batch decodes with: later
    assert backend.calls == [] and not replace_a.done.done()
    new_c = queue.submit("C", staged(tmp_path, "c"), 1)
    queue.run(frozenset({"A", "B"}))                 # room only by evicting the batch's adapters: later
    assert backend.calls == [] and servicer.residency.keys() == ["A", "B"] and len(queue) == 2
    assert servicer.residency.usable("A") and servicer.residency.usable("B")
    queue.run()                                      # the batch ended
    assert backend.calls == [("load", "A"), ("drop", "B"), ("load", "C")]
    assert replace_a.done.result() is None and new_c.done.result() is None
    assert servicer.residency.keys() == ["A", "C"] and servicer.residency.usable("C")
    servicer._compute.shutdown()


def test_the_servicer_evicts_an_adapter_the_batch_does_not_use(tmp_path):
    backend = FakeBackend(["A", "B"])                # A least recently used, but the batch decodes with it
    servicer = SamplerServicer(backend, tmp_path / "adapters", max_num_samples=1, max_adapters=2)
    new_c = servicer._installs.submit("C", staged(tmp_path, "c"), 1)
    servicer._installs.run(frozenset({"A"}))
    assert new_c.done.result() is None and backend.calls == [("drop", "B"), ("load", "C")]
    assert servicer.residency.keys() == ["A", "C"]
    servicer._compute.shutdown()
