"""The rendezvous port (smp_adapter/launch/free_port.py): picked below the kernel's ephemeral range, where
the connections and gloo listeners of jobs beside this one cannot take it, and free when picked."""

import socket

from smp_adapter.launch import free_port as module


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_the_port_is_below_the_ephemeral_range_and_free():
    low = _ephemeral_low()
    ports = {module.free_port() for _ in range(20)}
    assert all(max(1024, low - module._BELOW_RANGE) <= p < low for p in ports), ports
    assert len(ports) > 1  # random picks: two jobs started together do not meet
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_picked(monkeypatch):
    low = _ephemeral_low()
    held = socket.socket()
    held.bind(("127.0.0.1", module.free_port()))
    busy = held.getsockname()[1]
    held.listen()
    try:
        picks = iter([busy, busy, busy + 1 if busy + 1 < low else busy - 1])
        monkeypatch.setattr(module.random.Random, "randrange", lambda self, a, b: next(picks))
        assert module.free_port() != busy
    finally:
        held.close()


def test_nothing_free_below_the_range_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(module, "_bindable", lambda host, port: False)
    port = module.free_port()
    assert port >= _ephemeral_low()  # bind(0): from the ephemeral range
