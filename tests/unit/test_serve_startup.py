"""What `specserve serve` checks before minutes of loading: the address."""

from __future__ import annotations

import socket

from specserve.server.cli import address_problem


def test_a_taken_port_is_named_before_loading() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert address_problem("127.0.0.1", port) is not None
    assert address_problem("127.0.0.1", port) is None
