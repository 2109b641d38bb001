"""The sampler's adapter bookkeeping (services/sampler/residency.py): least recently used out first,
never one in use, the byte bound, and what refuses instead of evicting."""

import pytest

from temper.common.errors import AdapterNotLoaded, InvalidArgument, ResourceExhausted, Unavailable
from temper.services.sampler.residency import Residency


def load(r: Residency, key: str, size: int = 0) -> list[str]:
    victims = r.reserve(key, size)
    r.loaded(key)
    return victims


def test_least_recently_used_goes_first_and_use_counts():
    r = Residency(max_adapters=2)
    assert load(r, "a") == [] and load(r, "b") == []
    pin = r.use("a")  # a is now the most recently used
    r.release(pin)
    assert load(r, "c") == ["b"] and r.keys() == ["a", "c"]
    with pytest.raises(AdapterNotLoaded, match="^ADAPTER_NOT_LOADED: checkpoint b is not loaded"):
        r.use("b")
    assert load(r, "a") == [] and r.keys() == ["c", "a"]  # replacing one evicts nothing
    assert load(r, "b") == ["c"]


def test_an_adapter_in_use_is_never_chosen():
    r = Residency(max_adapters=2)
    load(r, "a")
    load(r, "b")
    pin_a, pin_b = r.use("a"), r.use("b")
    with pytest.raises(ResourceExhausted, match="no room for adapter c"):
        r.reserve("c", 0)
    assert r.keys() == ["a", "b"]  # nothing changed
    r.release(pin_b)
    assert load(r, "c") == ["b"]  # b, more recently used than a, but a is in use
    assert r.pins("a") == 1 and r.release(pin_a) == 0
    assert load(r, "d") == ["a"]


def test_a_loading_adapter_is_not_usable_nor_evictable():
    r = Residency(max_adapters=2)
    assert r.reserve("a", 0) == []
    with pytest.raises(AdapterNotLoaded):
        r.use("a")
    load(r, "b")
    pin = r.use("b")
    with pytest.raises(ResourceExhausted):
        r.reserve("c", 0)  # a is loading, b in use
    r.loaded("a")
    r.release(r.use("a"))
    r.release(pin)
    assert load(r, "c") == ["b"]


def test_the_byte_bound():
    r = Residency(max_adapters=10, max_bytes=100)
    load(r, "a", 40)
    load(r, "b", 30)
    load(r, "c", 30)
    assert r.total_bytes == 100
    assert load(r, "d", 50) == ["a", "b"] and r.total_bytes == 80  # a alone frees 40: not enough
    with pytest.raises(InvalidArgument, match="at most 100"):
        r.reserve("e", 101)
    assert r.keys() == ["c", "d"]
    assert load(r, "d", 70) == [] and r.total_bytes == 100  # a replacement that grows
    assert load(r, "d", 71) == ["c"] and r.total_bytes == 71 and r.keys() == ["d"]


def test_retiring_stops_new_uses_and_replacements():
    r = Residency(max_adapters=3)
    load(r, "a")
    pin = r.use("a")
    r.retire("a")
    with pytest.raises(AdapterNotLoaded):
        r.use("a")
    with pytest.raises(Unavailable):
        r.reserve("a", 0)
    assert r.release(pin) == 0
    r.forget("a")
    with pytest.raises(AdapterNotLoaded):
        r.retire("a")


def test_a_pin_outlives_a_replaced_entry():
    r = Residency(max_adapters=1)
    load(r, "a")
    old = r.use("a")
    r.forget("a")     # its replacement failed to load
    load(r, "a")      # pushed again
    new = r.use("a")
    r.release(old)    # the old request ends: the new one still holds its pin
    assert r.pins("a") == 1
    with pytest.raises(ResourceExhausted):
        r.reserve("b", 0)
    r.release(new)
    assert load(r, "b") == ["a"]
