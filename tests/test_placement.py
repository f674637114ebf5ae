"""Placement and participant sampling are pure functions of the config."""
import pytest

from htfl_dist.errors import HtflError
from htfl_dist.runtime.placement import check_world_size, clients_of_rank, hosting_rank, sample_participants


def test_every_client_hosted_exactly_once():
    for world in (1, 2, 3, 5):
        hosted = sorted(c for r in range(world) for c in clients_of_rank(r, world, 11))
        assert hosted == list(range(11))
        if world > 1:
            assert clients_of_rank(0, world, 11) == []  # rank 0 is the server only
    assert hosting_rank(4, 3) == 1 and hosting_rank(5, 3) == 2


def test_participants_seeded_and_independent_of_world():
    a = sample_participants(0, 3, 20, 0.5)
    assert a == sample_participants(0, 3, 20, 0.5)
    assert len(a) == 10 and a == sorted(set(a))
    assert a != sample_participants(0, 4, 20, 0.5)
    assert sample_participants(0, 0, 20, 1.0) == list(range(20))
    assert len(sample_participants(0, 0, 3, 0.1)) == 1


def test_too_many_ranks_is_a_user_error():
    check_world_size(5, 4)
    with pytest.raises(HtflError, match="at most 5 ranks"):
        check_world_size(6, 4)
