"""Which rank hosts which logical client, and who takes part in a round.

Both are pure functions of the config, so every rank computes the same answer without
talking to the others.
"""
from __future__ import annotations

from htfl_dist.errors import HtflError
from htfl_dist.seeding import numpy_rng


def check_world_size(world_size: int, num_clients: int) -> None:
    client_ranks = world_size - 1
    if client_ranks > num_clients:
        raise HtflError(
            f"{world_size} ranks give {client_ranks} client ranks but there are only {num_clients} "
            f"logical clients; start at most {num_clients + 1} ranks or raise num_clients"
        )


def hosting_rank(client_id: int, world_size: int) -> int:
    """Round-robin over ranks 1..W-1; world size 1 hosts everything on rank 0."""
    if world_size == 1:
        return 0
    return 1 + client_id % (world_size - 1)


def clients_of_rank(rank: int, world_size: int, num_clients: int) -> list[int]:
    return [cid for cid in range(num_clients) if hosting_rank(cid, world_size) == rank]


def describe_rank(rank: int, world_size: int, num_clients: int) -> str:
    """'rank r (clients [...])' or 'rank 0 (server)', for messages that must name a rank."""
    hosted = clients_of_rank(rank, world_size, num_clients)
    if not hosted:
        return f"rank {rank} (server)"
    more = "..." if len(hosted) > 8 else ""
    return f"rank {rank} (clients {hosted[:8]}{more})"


def client_ranks(world_size: int) -> list[int]:
    return [0] if world_size == 1 else list(range(1, world_size))


def sample_participants(seed: int, round_index: int, num_clients: int, join_ratio: float) -> list[int]:
    """int(N·ρ) clients (at least one), drawn without replacement from the (seed, round) stream."""
    count = max(1, int(num_clients * join_ratio))
    if count >= num_clients:
        return list(range(num_clients))
    chosen = numpy_rng(seed, "participants", round_index).choice(num_clients, size=count, replace=False)
    return sorted(int(c) for c in chosen)


def describe_placement(world_size: int, num_clients: int, ranks_shown: int = 8) -> str:
    """One line for the start-up log: which ranks host how many clients (the first ``ranks_shown``
    ranks in full, then a count)."""
    if world_size == 1:
        return f"placement: rank 0 is the server and hosts all {num_clients} clients"
    parts = []
    for rank in client_ranks(world_size)[:ranks_shown]:
        hosted = clients_of_rank(rank, world_size, num_clients)
        shown = ",".join(str(cid) for cid in hosted[:6]) + (",..." if len(hosted) > 6 else "")
        parts.append(f"rank {rank}: {len(hosted)} ({shown})")
    rest = world_size - 1 - ranks_shown
    more = f"; {rest} more ranks" if rest > 0 else ""
    return f"placement: rank 0 is the server; clients per rank: {'; '.join(parts)}{more}"
