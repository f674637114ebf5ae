"""The tensor-only wire format: round trips, declared shapes, corrupt messages."""
import pytest
import torch

from htfl_dist.errors import ProtocolError
from htfl_dist.runtime.screening import unpack_rank_message
from htfl_dist.runtime.wire import Encoded, Field, PayloadDeclarationError, decode, encode

SPEC = (Field("class_ids", torch.int64), Field("protos", torch.float32, (4,)))


def test_round_trip_variable_rows_in_client_order():
    entries = {
        7: {"class_ids": torch.tensor([1, 3]), "protos": torch.randn(2, 4)},
        2: {"class_ids": torch.tensor([0]), "protos": torch.randn(1, 4)},
        5: {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 4)},
    }
    message = encode(SPEC, entries)
    assert message.header.dtype == torch.int64 and message.body.dtype == torch.uint8
    decoded = decode(SPEC, message)
    assert list(decoded) == [2, 5, 7]
    for cid, payload in entries.items():
        assert torch.equal(decoded[cid]["class_ids"], payload["class_ids"])
        assert torch.equal(decoded[cid]["protos"], payload["protos"])
    # exact size: 3 int64 ids + 3 rows of 4 float32, plus the header
    assert message.body.numel() == 3 * 8 + 3 * 16
    assert message.nbytes == message.body.numel() + 8 * (1 + 3 * 3)


def test_a_rank_with_nobody_to_speak_for_sends_a_count_of_zero():
    """A client rank whose clients all sat the round out: one int64 (the count 0), no body."""
    message = encode(SPEC, {})
    assert message.header.tolist() == [0] and message.body.numel() == 0 and message.nbytes == 8
    assert decode(SPEC, message) == {}


def test_a_one_byte_field_round_trips():
    flags = (Field("flag", torch.uint8),)
    decoded = decode(flags, encode(flags, {4: {"flag": torch.tensor([201], dtype=torch.uint8)}}))
    assert decoded[4]["flag"].tolist() == [201]


def test_encode_names_a_missing_declared_field():
    with pytest.raises(PayloadDeclarationError, match=r"payload of client 3 .*missing \['protos'\]"):
        encode(SPEC, {3: {"class_ids": torch.tensor([1])}})


def test_encode_rejects_undeclared_dtype_and_shape():
    """A payload off its own declaration is a bug in the sending algorithm: a TypeError with a
    traceback, not a one-line user error."""
    with pytest.raises(PayloadDeclarationError, match="dtype"):
        encode(SPEC, {0: {"class_ids": torch.tensor([1]), "protos": torch.randn(1, 4, dtype=torch.float64)}})
    with pytest.raises(PayloadDeclarationError, match="shape"):
        encode(SPEC, {0: {"class_ids": torch.tensor([1]), "protos": torch.randn(1, 5)}})
    with pytest.raises(PayloadDeclarationError, match="undeclared"):
        encode(SPEC, {0: {"class_ids": torch.tensor([1]), "protos": torch.randn(1, 4), "x": torch.ones(1)}})


def test_decode_rejects_truncated_or_padded_body():
    message = encode(SPEC, {0: {"class_ids": torch.tensor([1]), "protos": torch.randn(1, 4)}})
    with pytest.raises(ProtocolError, match="too short"):
        decode(SPEC, Encoded(message.header, message.body[:-1]))
    with pytest.raises(ProtocolError, match="has 3 unexpected trailing bytes"):
        decode(SPEC, Encoded(message.header, torch.cat([message.body, torch.zeros(3, dtype=torch.uint8)])))
    with pytest.raises(ProtocolError, match="header"):
        decode(SPEC, Encoded(message.header[:-1], message.body))


def _upload(*client_ids):
    return encode(SPEC, {cid: {"class_ids": torch.tensor([1]), "protos": torch.ones(1, 4)} for cid in client_ids})


def test_decode_rejects_a_client_twice():
    """A repeated entry would otherwise replace the first one silently."""
    message = _upload(3, 4)
    header = message.header.clone()
    header[1 + 3] = 3  # the second entry's id (1 count, then id + 2 row counts per entry)
    with pytest.raises(ProtocolError, match="client 3 twice"):
        decode(SPEC, Encoded(header, message.body))


@pytest.mark.parametrize("sent,why", [((1, 999), "a client that does not exist"),
                                      ((1, 2), "another rank's client"),
                                      ((1,), "one of its participants missing")])
def test_a_rank_speaks_only_for_its_own_participants(sent, why):
    with pytest.raises(ProtocolError, match=r"^sent uploads for clients") as exc:
        unpack_rank_message(SPEC, _upload(*sent), [1, 3])
    assert "expected its participants [1, 3]" in str(exc.value), why
    assert sorted(unpack_rank_message(SPEC, _upload(3, 1), [1, 3])) == [1, 3]


def test_a_malformed_message_is_a_protocol_error():
    message = _upload(1)
    with pytest.raises(ProtocolError, match=r"^sent a malformed message: message body too short"):
        unpack_rank_message(SPEC, Encoded(message.header, message.body[:-1]), [1])


def test_max_message_bytes_by_hand():
    from htfl_dist.payload import max_message_bytes

    # 3 entries of (class_ids int64 ≤ 10 rows, protos float32 [≤ 10, 4]):
    # header 1 + 3·(1 + 2) = 10 values = 80 bytes; body 3·(10·8 + 10·16) = 720 bytes
    spec = (Field("class_ids", torch.int64, max_rows=10), Field("protos", torch.float32, (4,), max_rows=10))
    assert max_message_bytes(spec, 3) == 80 + 720
    assert max_message_bytes(spec, 0) == 8  # an empty message: its entry count
    honest = encode(spec, {c: {"class_ids": torch.arange(10), "protos": torch.zeros(10, 4)} for c in range(3)})
    assert honest.nbytes == max_message_bytes(spec, 3)  # the bound is exact for a full message
    assert max_message_bytes((*spec, Field("free", torch.float32)), 3) is None  # no bound declared


def test_the_protocol_bound_refuses_before_the_megabyte_limit():
    from htfl_dist.errors import ProtocolError
    from htfl_dist.runtime.transport import checked_sizes

    assert checked_sizes([10, 720], 2, 1 << 30, protocol_bytes=800) == (10, 720)
    with pytest.raises(ProtocolError, match=r"rank 2 announced .* what it hosts can send at most 800 bytes"):
        checked_sizes([10, 721], 2, 1 << 30, protocol_bytes=800)


def test_a_message_within_one_process_is_copied_checked_and_counted_as_encoded():
    """World size 1 skips the byte buffer: the receiver gets what decode(encode(...)) gives, in
    fresh tensors (changing them leaves the sender's intact), and the same byte count."""
    from htfl_dist.runtime.wire import PayloadDeclarationError, pass_within_process

    spec = (Field("class_ids", torch.int64), Field("protos", torch.float32, (3,)))
    sent = {4: {"class_ids": torch.tensor([1, 7]), "protos": torch.arange(6.0).reshape(2, 3)},
            2: {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 3)}}
    copied, nbytes = pass_within_process(spec, sent)
    decoded = decode(spec, encode(spec, sent))
    assert list(copied) == [2, 4] and nbytes == encode(spec, sent).nbytes == (1 + 2 * 3) * 8 + 2 * 8 + 6 * 4
    for entry_id, payload in decoded.items():
        for name, tensor in payload.items():
            assert torch.equal(copied[entry_id][name], tensor) and copied[entry_id][name].dtype == tensor.dtype
    copied[4]["protos"].zero_()
    assert sent[4]["protos"][1, 2] == 5.0
    with pytest.raises(PayloadDeclarationError, match="dtype"):
        pass_within_process(spec, {0: {"class_ids": torch.tensor([1]), "protos": torch.ones(1, 3).double()}})
    with pytest.raises(PayloadDeclarationError, match="undeclared"):
        pass_within_process(spec, {0: sent[4] | {"extra": torch.ones(1)}})
    handed, _ = pass_within_process(spec, sent, owned=True)  # the train phase owns uploads: no copy
    assert handed[4]["protos"] is not sent[4]["protos"]
    assert handed[4]["protos"].data_ptr() == sent[4]["protos"].data_ptr()
    strided = {0: {"class_ids": torch.tensor([3]), "protos": torch.arange(6.0).reshape(3, 2).t()[:1]}}
    handed, _ = pass_within_process(spec, strided, owned=True)  # contiguous on arrival, as decoded
    assert handed[0]["protos"].is_contiguous() and torch.equal(handed[0]["protos"], torch.tensor([[0.0, 2.0, 4.0]]))
    with pytest.raises(PayloadDeclarationError, match="undeclared"):
        pass_within_process(spec, {0: sent[4] | {"extra": torch.ones(1)}}, owned=True)


def test_an_upload_that_shares_storage_with_what_its_client_keeps_is_copied_before_it_leaves():
    """Uploads are handed over within one process, so the train phase copies every upload tensor
    that shares storage with what outlives the round on the client's side (model, optimizer
    state, modules, data, the round's knowledge); a tensor made for the upload is passed as is."""
    from helpers import make_client, make_context

    from htfl_dist.runtime.local_training import owned_upload

    _, context = make_context("FedProto")
    client = make_client(context)
    client.modules["extra"] = torch.nn.Linear(2, 2)
    head = client.model.head
    client.optimizer = torch.optim.SGD(client.model.parameters(), lr=0.1, momentum=0.9)
    client.model(client.train_x).sum().backward()
    client.optimizer.step()
    momentum = client.optimizer.state[head.weight]["momentum_buffer"]
    knowledge = {"protos": torch.ones(3, 4)}
    fresh = torch.ones(2)
    upload = {"weight": head.weight.detach().reshape(1, -1), "bias_view": head.bias[1:], "fresh": fresh,
              "momentum": momentum[0], "module": client.modules["extra"].weight, "protos": knowledge["protos"][:1],
              "data": client.train_x[0, 0, 0]}
    owned = owned_upload(upload, client, knowledge)
    assert owned["fresh"] is fresh
    for name in ("weight", "bias_view", "momentum", "module", "protos", "data"):
        assert owned[name].untyped_storage().data_ptr() != upload[name].untyped_storage().data_ptr(), name
        assert torch.equal(owned[name], upload[name]), name
