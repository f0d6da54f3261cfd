"""Where a listener is exposed: the loopback test every HTTP endpoint of ours applies.

Flower, `/metrics` and the emulator refuse to listen beyond loopback without credentials.
"""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """True when every address `host` stands for is a loopback address.

    An empty host or `0.0.0.0` means every interface (not loopback); a name counts as
    loopback only if all of its addresses are (so `localhost` does, a LAN name does not).
    """
    host = host.strip("[]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)
