"""common/channel_target.py: how an address string becomes a gRPC target and channel options (one
address unchanged; a list or a dns: name gets round_robin), and the clear errors on bad input. The
client and the gateway both read addresses through it. No network."""

from __future__ import annotations

import pytest

from temper.client.runtime import Runtime, resolve_target
from temper.common.channel_target import ROUND_ROBIN, channel_target
from temper.common.server_options import CHANNEL_OPTIONS, CLIENT_KEEPALIVE
from temper.services.gateway.upstream import Scheduler


def test_one_address_is_passed_on_unchanged_with_todays_options():
    for address in ("127.0.0.1:50051", "scheduler:50051", "localhost:1", "unix:/tmp/s.sock", "[::1]:5000"):
        target, options = channel_target(address)
        assert target == address
        assert options == [*CHANNEL_OPTIONS, *CLIENT_KEEPALIVE]  # pings while a call waits: a frozen server fails it
        assert ROUND_ROBIN not in options
    assert channel_target("  127.0.0.1:1 ") == ("127.0.0.1:1", [*CHANNEL_OPTIONS, *CLIENT_KEEPALIVE])


def test_a_list_becomes_an_ipv4_or_ipv6_target_with_round_robin():
    assert channel_target("127.0.0.1:5001,127.0.0.2:5002") == (
        "ipv4:127.0.0.1:5001,127.0.0.2:5002", [*CHANNEL_OPTIONS, *CLIENT_KEEPALIVE, ("grpc.lb_policy_name", "round_robin")])
    assert channel_target(" 10.0.0.1:1 , 10.0.0.2:2 ")[0] == "ipv4:10.0.0.1:1,10.0.0.2:2"
    target, options = channel_target("[::1]:5001,[0:0::1]:5002")
    assert target == "ipv6:[::1]:5001,[::1]:5002"
    assert options[-1] == ROUND_ROBIN


def test_dns_and_explicit_multi_address_targets_get_round_robin():
    for address in ("dns:///scheduler.internal:50051", "dns:scheduler:50051", "dns://8.8.8.8/scheduler:50051",
                    "ipv4:127.0.0.1:1,127.0.0.1:2", "ipv6:[::1]:1"):
        target, options = channel_target(address)
        assert target == address
        assert options == [*CHANNEL_OPTIONS, *CLIENT_KEEPALIVE, ROUND_ROBIN]


@pytest.mark.parametrize("address, message", [
    ("", "is empty"),
    ("   ", "is empty"),
    ("127.0.0.1:1,", "empty entry"),
    ("127.0.0.1:1,,127.0.0.1:2", "empty entry"),
    (",127.0.0.1:1", "empty entry"),
    ("127.0.0.1,127.0.0.2:2", "has no port"),
    ("127.0.0.1:,127.0.0.2:2", "is not a number"),
    ("127.0.0.1:http,127.0.0.2:2", "is not a number"),
    ("127.0.0.1:70000,127.0.0.2:2", "is not a number"),
    ("127.0.0.1:0,127.0.0.2:2", "is not a number"),
    ("::1:5000,127.0.0.2:2", "[addr]:port"),
    ("127.0.0.1:1,[::1]:2", "mixes IPv4 and IPv6"),
    ("sched-a:1,sched-b:2", "dns:///name:port"),
    ("dns:///scheduler", "has no port"),
    ("dns:///", "names no host"),
    ("dns:///scheduler:x", "is not a number"),
    ("ipv4:127.0.0.1:1,", "empty entry"),
])
def test_bad_addresses_are_a_clear_value_error(address, message):
    with pytest.raises(ValueError, match="scheduler address") as caught:
        channel_target(address)
    assert message in str(caught.value)


def test_the_client_and_the_gateway_read_addresses_through_it():
    assert resolve_target("dns:///scheduler:50051") == ("dns:///scheduler:50051", None)
    assert resolve_target("grpc://127.0.0.1:1,127.0.0.1:2") == ("127.0.0.1:1,127.0.0.1:2", None)
    with pytest.raises(ValueError, match="empty entry"):
        Runtime("127.0.0.1:1,,127.0.0.1:2", [])
    upstream = Scheduler("127.0.0.1:1,127.0.0.1:2")
    assert (upstream._target, upstream._options[-1]) == ("ipv4:127.0.0.1:1,127.0.0.1:2", ROUND_ROBIN)
    with pytest.raises(ValueError, match="has no port"):
        Scheduler("127.0.0.1,127.0.0.1:2")
