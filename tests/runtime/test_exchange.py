"""The round's messages in one process (the local transport, world size 1): what rank 0 gets back
from a gather, and what it refuses, by hand."""
from __future__ import annotations

import pytest
import torch

from htfl_dist.errors import ProtocolError
from htfl_dist.payload import Field
from htfl_dist.runtime.exchange import ClientReport, Exchange, RankReport, RoundTraffic
from htfl_dist.runtime.placement import Placement
from htfl_dist.runtime.screening import LeftOut, check_finite, id_ranges, screen_uploads
from htfl_dist.runtime.transport import LocalTransport

SPEC = (Field("class_ids", torch.int64), Field("protos", torch.float32, (2,)))


def _exchange(on_bad_upload="skip", epsilon_budget=None) -> Exchange:
    return Exchange(LocalTransport(), Placement.round_robin(1, 3), torch.device("cpu"), on_bad_upload,
                    epsilon_budget=epsilon_budget)


def _upload(rows: int) -> dict[str, torch.Tensor]:
    return {"class_ids": torch.arange(rows), "protos": torch.ones(rows, 2)}


def test_uploads_come_back_in_client_order_and_count_their_bytes():
    traffic = RoundTraffic()
    gathered, skipped = _exchange().gather_uploads(SPEC, {2: _upload(1), 0: _upload(2)}, [0, 2], 1, traffic)
    assert list(gathered) == [0, 2] and skipped == []
    assert torch.equal(gathered[0]["protos"], torch.ones(2, 2))
    assert traffic.up > (2 + 1) * (8 + 2 * 4)  # the rows, plus the message's header


def test_a_message_for_clients_its_rank_does_not_host_leaves_them_out_of_the_round(capsys):
    """Rank 0 hosts participants 0 and 2 but speaks for 1: with skip the round goes on without
    them, and the outcome says who was left out; with fail it ends naming the rank."""
    gathered, skipped = _exchange().gather_uploads(SPEC, {1: _upload(1)}, [0, 2], 3, RoundTraffic())
    assert gathered == {} and skipped == [0, 2]
    assert "round 3: left out rank 0" in capsys.readouterr().err
    with pytest.raises(ProtocolError, match=r"^rank 0"):
        _exchange("fail").gather_uploads(SPEC, {1: _upload(1)}, [0, 2], 3, RoundTraffic())


def test_a_report_of_more_epsilon_than_the_budget_is_refused():
    reports = {0: ClientReport(None, None, [4.5]), 1: ClientReport(None, None, [1.0])}
    mine = RankReport(1.0, 0.0, 0.0)
    honest = _exchange(epsilon_budget=5.0).gather_reports(reports, mine, [0], tested=())
    assert honest.clients[0]["privacy"].tolist() == [[4.5]] and honest.ranks == [mine]
    with pytest.raises(ProtocolError, match=r"client 0"):
        _exchange(epsilon_budget=4.0).gather_reports(reports, mine, [0], tested=())


def test_a_private_clients_training_row_is_refused_and_a_public_ones_required():
    """With privacy on (an ε budget) a participant's training loss and count must not reach rank
    0: a rank that sends them is refused, naming it; without privacy they are required."""
    mine = RankReport(1.0, 0.0, 0.0)
    leaking = {0: ClientReport([30.68, 12.0], None, [1.0])}
    with pytest.raises(ProtocolError, match=r"^rank 0 .*reported training for clients \[0\] .* expected \[\]"):
        _exchange(epsilon_budget=4.0).gather_reports(leaking, mine, [0], tested=())
    assert _exchange().gather_reports({0: ClientReport([30.68, 12.0], None, None)}, mine, [0], tested=())
    with pytest.raises(ProtocolError, match=r"expected \[0\]"):
        _exchange().gather_reports({0: ClientReport(None, None, None)}, mine, [0], tested=())


NAN = {"class_ids": torch.tensor([0]), "protos": torch.full((1, 2), float("nan"))}


def test_a_round_that_leaves_every_client_out_says_so_in_one_line(capsys):
    """train.lr=1e30 made six lines a round, one per client, each with the same reason; now one
    line names every client left out and the reason once."""
    kept, skipped = screen_uploads(dict.fromkeys(range(6), NAN), lambda cid, upload: None, "skip", round_number=2)
    assert kept == {} and skipped == list(range(6))
    (line,) = capsys.readouterr().err.splitlines()
    assert line == ("htfl_dist: warning: round 2: left client 0 out: client 0 sent NaN/Inf values in 'protos': its "
                    "local training diverged (lower train.lr or algo.reg_weight); likewise clients 1-5")


def test_one_line_holds_each_reason_once_and_a_refused_rank(capsys):
    """A rank's refused message, two reasons among the uploads and a round's own clients: one line."""
    exchange = _exchange()
    left_out = LeftOut(4)
    exchange.gather_uploads(SPEC, {1: _upload(1)}, [0, 2], 4, RoundTraffic(), left_out)
    uploads = {3: NAN, 5: _upload(1), 7: NAN, 8: NAN, 11: {"class_ids": torch.tensor([9]), "protos": torch.ones(1, 2)}}

    def validate(client_id, upload):
        if int(upload["class_ids"][0]) > 5:
            raise ProtocolError(f"client {client_id} sent a class id outside [0, 5)")

    kept, skipped = screen_uploads(uploads, validate, "skip", 4, left_out)
    assert list(kept) == [5] and skipped == [3, 7, 8, 11] and left_out.client_ids == [0, 2, 3, 7, 8, 11]
    assert capsys.readouterr().err == ""  # the round's owner says it, once
    left_out.say()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("htfl_dist: warning: round 4: left out rank 0 (clients [0, 1, 2])'s clients [0, 2]: "
                           "rank 0 (clients [0, 1, 2]) sent uploads for clients [1]"), line
    assert "; left client 3 out: client 3 sent NaN/Inf values in 'protos'" in line
    assert line.endswith("; likewise clients 7-8; left client 11 out: client 11 sent a class id outside [0, 5)"), line


def test_the_line_stays_short_however_many_clients_and_reasons():
    left_out = LeftOut(1)
    for client_id in range(0, 2000, 2):  # a thousand clients, every other id
        left_out.add_client(client_id, ProtocolError(f"client {client_id} sent NaN/Inf values in 'protos'"))
    for reason in range(5):
        left_out.add_client(3001 + reason, ProtocolError(f"client {3001 + reason} sent reason {reason}"))
    line = left_out.line()
    assert line is not None and len(line) < 600, line
    assert "likewise clients 2, 4, 6" in line and "... (999 in all)" in line
    assert line.endswith("and clients 3003-3005 for 3 other reason(s) (skipped_clients in metrics.jsonl)"), line
    assert LeftOut(2).line() is None
    assert id_ranges([5, 1, 2, 3, 9]) == "1-3, 5, 9"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_value_among_many_is_refused_however_the_sum_goes(bad):
    # +inf beside -inf sums to NaN, a lone infinity to ±inf: every case must still be refused
    rows = torch.ones(1000, 4)
    rows[517, 2] = bad
    with pytest.raises(ProtocolError, match="client 3 sent NaN/Inf values in 'protos'"):
        check_finite(3, {"class_ids": torch.arange(1000), "protos": rows})
    rows[3, 1] = -bad
    with pytest.raises(ProtocolError, match="NaN/Inf"):
        check_finite(3, {"protos": rows})


def test_finite_values_whose_sum_overflows_are_accepted():
    # 3e38 + 3e38 is inf in float32 although both values are finite: the sum alone would refuse it
    huge = torch.full((2, 2), 3e38)
    assert not bool(torch.isfinite(huge.sum()))
    check_finite(0, {"protos": huge})
