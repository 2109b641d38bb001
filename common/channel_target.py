"""One name for several scheduler replicas: a user's address string -> (gRPC target, channel options).

Used by temper.client and the gateway's upstream, so both read an address the same way:

- one ``host:port`` (or any target gRPC takes, e.g. ``unix:/path``): passed on unchanged, as before;
- a comma-separated list ``10.0.0.1:50051,10.0.0.2:50051`` (``[::1]:50051`` for IPv6): gRPC's built-in
  ``ipv4:``/``ipv6:`` multi-address target;
- ``dns:///name:port`` (or an explicit ``ipv4:``/``ipv6:`` target): gRPC resolves it to every address.

Several addresses get the round_robin load-balancing policy: calls spread over the replicas and a dead
one's subchannel is skipped. gRPC's default (pick_first) would send everything to one replica. A call
that was in flight on a replica that died still fails UNAVAILABLE: the callers' own retry resends it.
Every channel pings while a call waits (CLIENT_KEEPALIVE), so one waiting on a frozen replica fails too.
"""

from __future__ import annotations

import ipaddress

from temper.common.server_options import CHANNEL_OPTIONS, CLIENT_KEEPALIVE

ROUND_ROBIN = ("grpc.lb_policy_name", "round_robin")
# Schemes whose targets may name several addresses; anything else with a scheme is one address.
MULTI_SCHEMES = ("dns:", "ipv4:", "ipv6:")


def channel_target(address: str) -> tuple[str, list[tuple[str, object]]]:
    """(target, options) for grpc.aio.*_channel. Raises ValueError, naming the address, on an empty
    address, an empty list entry, or an entry without a valid port."""
    text = (address or "").strip()
    if not text:
        raise ValueError("scheduler address is empty: give host:port, host1:port1,host2:port2 or dns:///name:port")
    if text.startswith(MULTI_SCHEMES):
        _check_scheme_target(text)
        return text, [*CHANNEL_OPTIONS, *CLIENT_KEEPALIVE, ROUND_ROBIN]
    if "," not in text:
        return text, [*CHANNEL_OPTIONS, *CLIENT_KEEPALIVE]
    entries = [_entry(part.strip(), text) for part in text.split(",")]
    families = {family for family, _ in entries}
    if len(families) > 1:
        raise ValueError(f"scheduler address {text!r} mixes IPv4 and IPv6 entries; gRPC takes one family per list "
                         f"(or use dns:///name:port)")
    family = families.pop()
    return f"{family}:" + ",".join(hostport for _, hostport in entries), [*CHANNEL_OPTIONS, *CLIENT_KEEPALIVE, ROUND_ROBIN]


def _entry(part: str, whole: str) -> tuple[str, str]:
    """("ipv4" | "ipv6", normalized host:port) of one list entry."""
    if not part:
        raise ValueError(f"scheduler address {whole!r} has an empty entry (a stray comma?)")
    host, sep, port = part.rpartition(":")
    if not sep or not host:
        raise ValueError(f"scheduler address entry {part!r} in {whole!r} has no port: write host:port")
    _check_port(port, part, whole)
    bracketed = host.startswith("[") and host.endswith("]")
    if ":" in host and not bracketed:
        raise ValueError(f"scheduler address entry {part!r} in {whole!r}: write an IPv6 address as [addr]:port")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        # gRPC's multi-address targets take literals only; a name that resolves to the replicas is
        # what the dns: resolver is for (and it re-resolves when the replicas change).
        raise ValueError(f"scheduler address entry {part!r} in {whole!r}: a list takes IP addresses; for a host name "
                         f"that resolves to the replicas use dns:///name:port") from None
    if ip.version == 6:
        return "ipv6", f"[{ip}]:{port}"
    return "ipv4", f"{ip}:{port}"


def _check_port(port: str, part: str, whole: str) -> None:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"scheduler address entry {part!r} in {whole!r}: port {port!r} is not a number in 1..65535")


def _check_scheme_target(text: str) -> None:
    """A dns: target must name a port (gRPC's default, 443, is never a scheduler's); ipv4:/ipv6: lists
    must have no empty entries. gRPC checks the rest when the channel resolves."""
    scheme, _, rest = text.partition(":")
    if scheme == "dns":
        name = rest.rpartition("/")[2] if rest.startswith("//") else rest
        if not name:
            raise ValueError(f"scheduler address {text!r} names no host: write dns:///name:port")
        host, sep, port = name.rpartition(":")
        if not sep or not host:
            raise ValueError(f"scheduler address {text!r} has no port: write dns:///name:port")
        _check_port(port, name, text)
        return
    for part in rest.split(","):
        if not part.strip():
            raise ValueError(f"scheduler address {text!r} has an empty entry (a stray comma?)")
