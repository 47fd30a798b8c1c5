"""Records through `moescope.core.wire` and back: every field as it was, and a frame that names what
it may not hold is refused before anything is built."""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import threading

import numpy as np
import pytest

from moescope.core import wire
from moescope.core.records import KVCacheLayer, TokenSample
from tests.support.store_records import make_record, run_info


def _same(a, b, where: str = "") -> None:
    """A field-by-field comparison written here (numpy arrays by value, dtype and shape)."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, where
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and np.isnan(a):
        assert isinstance(b, float) and np.isnan(b), where
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} != {b!r}"


def test_a_record_with_every_kind_of_field_comes_back_as_it_was():
    record = make_record("run-w", 7, np.random.default_rng(0), tags={"phase": "decode", "replay": "x"})
    layer = record.layers[1]
    layer.router_logits = TokenSample(token=np.arange(3, dtype=np.int32), token_ids=None,
                                      values=np.random.default_rng(1).random((3, 6), dtype=np.float32),
                                      top1_expert=np.array([0, 5, 2], dtype=np.int32),
                                      step=np.array([7, 7, 8], dtype=np.int64))
    layer.trust_weight = np.array([1.0, 0.0, 1.0, 1.0, 0.5, 1.0])
    layer.router_entropy_mean = float("nan")
    layer.capacity, layer.capacity_use = 12, 0.75
    record.kv_cache = [KVCacheLayer(layer=0, bytes=4096, seq_len=17)]
    run = run_info("run-w", tags={"a": "1"})
    message = {"op": "export", "records": [record], "run": run, "count": np.int64(3), "flag": np.bool_(True)}
    back = wire.decode(wire.encode(message))
    _same(back["records"][0], record)
    _same(back["run"], run)
    assert back["count"] == 3 and type(back["count"]) is int and back["flag"] is True
    assert back["records"][0].ts == record.ts and back["records"][0].ts.tzinfo is not None


def test_through_a_socket_frames_arrive_whole_and_in_order():
    ours, theirs = socket.socketpair()
    try:
        big = make_record("run-w", 0, np.random.default_rng(2), tokens=4096)  # ~ MBs: many recv calls
        small = make_record("run-w", 1, np.random.default_rng(3))

        def sender() -> None:  # a frame larger than the socket's buffer: sent while the other end reads
            for record in (big, small):
                wire.send(ours, wire.encode(record))
            ours.close()

        thread = threading.Thread(target=sender)
        thread.start()
        _same(wire.decode(wire.receive(theirs)), big)
        _same(wire.decode(wire.receive(theirs)), small)
        with pytest.raises(EOFError):
            wire.receive(theirs)
        thread.join(10)
    finally:
        theirs.close()


def _frame(header: object, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack(">I", len(text)) + text + data


@pytest.mark.parametrize("header, data, says", [
    ({"$r": "Popen", "f": []}, b"", "record it cannot hold"),
    ({"$r": "LayerStep", "f": [1]}, b"", "record it cannot hold"),  # not the fields the type has
    ({"$a": ["|O", [1], 0]}, b"\0" * 8, "array it cannot"),  # an object array
    ({"$a": ["<f8", [4], 0]}, b"\0" * 8, "past its end"),
    ({"$a": ["<f8", [-1], 0]}, b"", "array it cannot"),
    ({"$x": 1}, b"", "does not know"),
])
def test_a_frame_naming_what_it_may_not_hold_is_refused(header, data, says):
    with pytest.raises(wire.WireError, match=says):
        wire.decode(_frame(header, data))


def test_what_a_frame_cannot_hold_is_refused_at_encoding():
    with pytest.raises(TypeError, match="numbers or bools"):
        wire.encode(np.array(["a"], dtype=object))
    with pytest.raises(TypeError, match="cannot hold a"):
        wire.encode({"f": object()})


def test_a_frame_larger_than_the_bound_is_refused_before_it_is_read(monkeypatch):
    ours, theirs = socket.socketpair()
    try:
        monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 100)
        ours.sendall(struct.pack(">Q", 101))
        with pytest.raises(wire.WireError, match="more than"):
            wire.receive(theirs)
    finally:
        ours.close()
        theirs.close()
