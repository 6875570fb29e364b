"""A rank's control thread under a hostile local client: one connection held open, a byte at a
time, or a flood of junk, must not keep ``ping``/``abort`` from the client. The server runs in this
process (the same code an engine runs), no engines needed."""

from __future__ import annotations

import os
import socket
import threading
import time

from workbench.rank import control


def _where() -> dict:
    return control.start("127.0.0.1", 0)


def _drip(sock: socket.socket, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            sock.send(b" ")
        except OSError:
            return
        stop.wait(0.5)


def test_one_slow_connection_does_not_block_ping():
    where = _where()
    slow = socket.create_connection((where["host"], where["port"]))
    stop = threading.Event()
    t = threading.Thread(target=_drip, args=(slow, stop), daemon=True)
    t.start()
    try:
        time.sleep(0.3)  # the server has accepted it and is reading
        for _ in range(3):
            assert control.ask(where, "ping", timeout=3.0) == {"ok": True, "pid": os.getpid()}
    finally:
        stop.set()
        t.join()
        slow.close()


def test_a_request_that_never_ends_is_cut_at_its_deadline():
    where = _where()
    slow = socket.create_connection((where["host"], where["port"]))
    stop = threading.Event()
    t = threading.Thread(target=_drip, args=(slow, stop), daemon=True)
    t.start()
    try:
        slow.settimeout(60)  # far past the server's deadline: the server, not this, ends the wait
        reply = slow.recv(4096)
        assert b"request not complete" in reply
    finally:
        stop.set()
        t.join()
        slow.close()


def test_oversized_and_non_object_requests_get_one_error_each():
    where = _where()
    for junk in (b"x" * (control.MAX_REQUEST + 10), b"[1, 2]\n", b"\xff\xfe\n"):
        with socket.create_connection((where["host"], where["port"]), timeout=10) as s:
            s.sendall(junk)
            reply = s.makefile("rb").readline()
        assert b"error" in reply
    assert control.ask(where, "ping")["ok"] is True
