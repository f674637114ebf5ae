"""A client lent to another rank for a round: its state on the wire and what a bad one gets."""
from __future__ import annotations

import pytest
import torch
from test_client_store import _Builder, _store, _train_step

from htfl_dist.errors import ProtocolError
from htfl_dist.runtime.lending import FRESH, RECORD, decode_record, encode_record
from htfl_dist.runtime.wire import Encoded


def test_a_record_round_trips_and_a_never_trained_client_is_one_word(tmp_path):
    store = _store(tmp_path, _Builder(), resident=0, replaced_by_download=lambda client: frozenset({"weight"}))
    assert store.lend(1) is None  # never built: the borrower builds it from the seed
    fresh = encode_record(None)
    assert fresh.header.tolist() == [FRESH] and fresh.nbytes == 8
    assert decode_record(fresh, 1, "rank 2") is None
    _train_step(store[0])
    record = decode_record(encode_record(store.lend(0)), 0, "rank 2")
    assert record is not None and sorted(record["model"]) == ["bias"] and record["replaced_by_download"] == ["weight"]
    borrowed = store.borrow(0, record, "rank 2's record")
    assert torch.equal(borrowed.model.bias, store[0].model.bias) and borrowed is not store[0]
    assert torch.equal(borrowed.model.weight, torch.zeros(2, 3))  # the download fills it before any use


@pytest.mark.parametrize("message,match", [
    (Encoded(torch.tensor([7]), torch.empty(0, dtype=torch.uint8)),
     r"^rank 2 \(clients \[1\]\) sent client 0's state with header \[7\]"),
    (Encoded(torch.tensor([RECORD]), torch.arange(50, dtype=torch.uint8)), r"^rank 2 .* does not load"),
    (Encoded(torch.tensor([FRESH]), torch.ones(3, dtype=torch.uint8)), r"header \[0\]"),
])
def test_a_bad_state_from_a_peer_is_one_line_naming_it(message, match):
    with pytest.raises(ProtocolError, match=match):
        decode_record(message, 0, "rank 2 (clients [1])")


def test_another_clients_state_or_a_pickled_object_is_refused():
    with pytest.raises(ProtocolError, match="another client's state for client 3"):
        decode_record(encode_record({"client_id": 4, "model": {}}), 3, "rank 1")

    class Payload:  # anything beyond tensors and containers must not be unpickled
        def __reduce__(self):
            return (print, ("ran",))

    with pytest.raises(ProtocolError, match="does not load"):
        decode_record(encode_record({"client_id": 3, "evil": Payload()}), 3, "rank 1")
