"""What `specserve serve` sets up before loading: glibc's mmap threshold and the address check."""

from __future__ import annotations

import platform
import socket

import pytest

from specserve.server.cli import address_problem, fixed_mmap_threshold


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_mmap_threshold_is_fixed_on_glibc() -> None:
    assert fixed_mmap_threshold() is True


def test_a_taken_port_is_named_before_loading() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert address_problem("127.0.0.1", port) is not None
    assert address_problem("127.0.0.1", port) is None
