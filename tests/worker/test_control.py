"""The snapshot control channel's receive (worker/control.py): each way a message can go wrong is
reported as what it is, and the descriptors that came with it are closed."""

import os
import socket
import threading

import pytest

from worker import control


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_a_message_and_its_descriptors_arrive(pair):
    read, write = os.pipe()
    try:
        control.send(pair[0], {"op": "wake"}, [read])
        message, fds = control.receive(pair[1], 5.0)
        assert message == {"op": "wake"} and len(fds) == 1
        os.close(fds[0])
    finally:
        os.close(read)
        os.close(write)


def test_a_closed_connection_says_so(pair):
    pair[0].sendall(b'{"op": ')
    pair[0].close()
    with pytest.raises(control.ControlError, match="closed the control connection"):
        control.receive(pair[1], 5.0)


def test_an_oversized_message_names_the_limit(pair):
    def flood():
        try:
            pair[0].sendall(b"x" * (control.MAX_MESSAGE + 65536))
        except OSError:  # the receiver stopped reading and closed
            pass

    sender = threading.Thread(target=flood)
    sender.start()
    with pytest.raises(control.ControlError, match=f"over the {control.MAX_MESSAGE}-byte limit"):
        control.receive(pair[1], 5.0)
    pair[1].close()
    sender.join(timeout=10)


def test_bad_json_and_non_objects_are_malformed(pair):
    pair[0].sendall(b"not json\n")
    with pytest.raises(control.ControlError, match="malformed"):
        control.receive(pair[1], 5.0)
    pair[0].sendall(b"[1, 2]\n")
    with pytest.raises(control.ControlError, match="JSON object"):
        control.receive(pair[1], 5.0)
