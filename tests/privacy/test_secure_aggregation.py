"""Secure aggregation (htfl_dist/privacy/secure_aggregation.py, issue 48 item 3): quantisation and
Shamir sharing worked by hand, the neighbour graph, and the protocol's sum, dropouts, refusals,
authentication, freshness and the server's view."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.privacy import secagg_crypto as crypto
from htfl_dist.privacy.secagg_messages import evaluation_points, neighbour_graph
from htfl_dist.privacy.secagg_quant import dequantize_sum, quantize
from htfl_dist.privacy.secagg_shamir import PRIME, SHARE_BYTES, combine, lagrange_at, share_value, split
from htfl_dist.privacy.secure_aggregation import (
    MaskedInput,
    SecAggAbort,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    UnmaskingShares,
    run_protocol,
    secure_sum,
)

LEVELS = 2 ** 22


def inputs(n: int, length: int = 64, seed: int = 0) -> dict[int, np.ndarray]:
    """Quantised inputs of clients 0 … n − 1 (ids spread out, to catch index/id mix-ups)."""
    rng = np.random.default_rng(seed)
    return {10 * u + 3: rng.integers(0, LEVELS + 1, length, dtype=np.uint32) for u in range(n)}


def exact_sum(quantised: dict[int, np.ndarray], survivors) -> np.ndarray:
    return np.sum([quantised[u] for u in survivors], axis=0, dtype=np.uint64).astype(np.uint32)


# --- quantisation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stochastic", [True, False])
def test_quantisation_of_three_vectors_by_hand(stochastic):
    # c = 1, 4 levels (steps of 0.5): the grid −1, −0.5, 0, 0.5, 1 is 0 … 4; its points stay put
    xs = [np.array([-1.0, 0.0, 0.5]), np.array([1.0, -0.5, 0.0]), np.array([0.5, 0.5, -1.0])]
    qs = [quantize(x, 1.0, 4, stochastic=stochastic) for x in xs]
    assert [q.tolist() for q in qs] == [[0, 2, 3], [4, 1, 2], [3, 3, 0]]
    assert all(q.dtype == np.uint32 for q in qs)
    total = qs[0] + qs[1] + qs[2]
    assert total.tolist() == [7, 6, 5]
    # 7·0.5 − 3·1 = 0.5; 6·0.5 − 3 = 0; 5·0.5 − 3 = −0.5: the three offsets of c come off
    assert dequantize_sum(total, 3, 1.0, 4).tolist() == [0.5, 0.0, -0.5] == list(sum(xs))


def test_quantisation_clips_and_rounds():
    assert quantize(np.array([-7.0, 2.0, 0.3]), 1.0, 4, stochastic=False).tolist() == [0, 4, 3]  # 0.3 → 2.6 → 3
    draws = quantize(np.full(20000, 0.25), 1.0, 4)  # 0.25 → 2.5: 2 or 3, each half the time
    assert set(draws.tolist()) == {2, 3}
    assert abs(draws.mean() - 2.5) < 0.02
    assert not np.array_equal(draws, quantize(np.full(20000, 0.25), 1.0, 4))  # fresh coins, not a seed
    with pytest.raises(ValueError, match="non-finite"):
        quantize(np.array([np.nan]), 1.0, 4)
    with pytest.raises(ValueError, match="wrap"):
        dequantize_sum(np.zeros(1, np.uint32), 1024, 8.0, LEVELS)


# --- Shamir sharing -------------------------------------------------------------------------------

def test_shamir_by_hand():
    # f(x) = 5 + 7x: shares (1, 12) and (2, 19); 2·12 − 19 = 5
    shares = {1: (12).to_bytes(SHARE_BYTES, "big"), 2: (19).to_bytes(SHARE_BYTES, "big")}
    assert combine(shares, 2) == (5).to_bytes(32, "big")
    # f(x) = 1 + 2x + 3x²: f(1) = 6, f(2) = 17, f(3) = 34
    shares = {x: (1 + 2 * x + 3 * x * x).to_bytes(SHARE_BYTES, "big") for x in (1, 2, 3)}
    assert combine(shares, 3) == (1).to_bytes(32, "big")


def test_shamir_round_trip_and_threshold():
    secret = bytes(range(32))
    shares = split(secret, [1, 2, 3, 4, 5], 3)
    assert all(len(s) == SHARE_BYTES for s in shares.values())
    for subset in ([1, 2, 3], [5, 3, 1], [2, 4, 5], [1, 2, 3, 4, 5]):
        assert combine({x: shares[x] for x in subset}, 3) == secret
    with pytest.raises(ValueError, match="cannot reconstruct"):
        combine({1: shares[1], 2: shares[2]}, 3)
    assert split(secret, [1, 2, 3], 3) != split(secret, [1, 2, 3], 3)  # fresh coefficients
    with pytest.raises(ValueError):
        share_value(bytes(SHARE_BYTES - 1))
    with pytest.raises(ValueError):
        share_value(PRIME.to_bytes(SHARE_BYTES, "big"))


def test_fewer_than_t_shares_fit_any_secret():
    t = 4
    real = split(b"\x11" * 32, [1, 2, 3, 4, 5, 6], t)
    seen = {x: share_value(real[x]) for x in (2, 4, 6)}  # t − 1 shares
    for candidate in (b"\x00" * 32, b"\xff" * 32, b"\x11" * 32):
        # the polynomial of degree t − 1 through (0, candidate) and the t − 1 seen shares exists...
        points = {0: int.from_bytes(candidate, "big"), **seen}
        fourth = lagrange_at(points, 5).to_bytes(SHARE_BYTES, "big")
        # ...so the seen shares plus one more point of it reconstruct the candidate
        forged = {x: y.to_bytes(SHARE_BYTES, "big") for x, y in seen.items()} | {5: fourth}
        assert combine(forged, t) == candidate


# --- graph and generator --------------------------------------------------------------------------

def test_neighbour_graph():
    ids = [3, 13, 23, 33, 43, 53, 63]
    ring = neighbour_graph(ids, 0, 2)
    assert all(len(ring[u]) == 2 for u in ids)
    assert all(u in ring[v] for u in ids for v in ring[u])  # symmetric
    assert ring == neighbour_graph(list(reversed(ids)), 0, 2)  # from the ids, not their order
    assert any(neighbour_graph(ids, r, 2) != ring for r in range(1, 6))  # changes with the round
    assert all(len(neighbour_graph(ids, 0, 4)[u]) == 4 for u in ids)
    assert neighbour_graph(ids, 0, None) == neighbour_graph(ids, 0, 6) == {u: tuple(v for v in ids if v != u)
                                                                            for u in ids}
    assert evaluation_points([43, 3, 13]) == {3: 1, 13: 2, 43: 3}


def test_prg_is_chacha20():
    # RFC 8439 appendix A.1, test vector 1 (zero key, nonce and counter): 76 b8 e0 ad a0 f1 3d 90
    assert crypto.prg_words(bytes(32), 2).tolist() == [0xADE0B876, 0x903DF1A0]
    assert crypto.prg_words(b"\x01" * 32, 1000).dtype == np.uint32


def test_config_refuses():
    with pytest.raises(ConfigError):
        SecAggConfig(threshold=1)
    with pytest.raises(ConfigError):
        SecAggConfig(threshold=2, neighbours=3)
    with pytest.raises(ConfigError):
        SecAggConfig(threshold=4, neighbours=2)
    with pytest.raises(ConfigError):
        SecAggConfig(threshold=2, max_clients=1024)


# --- the protocol ---------------------------------------------------------------------------------

@pytest.mark.parametrize("neighbours", [None, 4])
@pytest.mark.parametrize("dropped", [(), (23,), (3, 43)])
def test_sum_is_exact_with_dropouts(neighbours, dropped):
    n = 7
    config = SecAggConfig(threshold=3 if neighbours else n - 2, neighbours=neighbours)
    quantised = inputs(n)
    run = run_protocol(quantised, config, dropouts_after_share=dropped)
    survivors = [u for u in quantised if u not in dropped]
    assert run.survivors == tuple(survivors)
    np.testing.assert_array_equal(run.total, exact_sum(quantised, survivors))


def test_sum_with_dropouts_before_sharing_and_after_masking():
    quantised = inputs(6)
    config = SecAggConfig(threshold=3)
    run = run_protocol(quantised, config, dropouts_after_advertise=[13], dropouts_after_share=[33],
                       dropouts_after_masking=[53])
    assert run.survivors == (3, 23, 43, 53)  # 53 masked its input: it counts, its holders unmask it
    np.testing.assert_array_equal(run.total, exact_sum(quantised, run.survivors))


def test_too_few_survivors_abort():
    config = SecAggConfig(threshold=4)
    with pytest.raises(SecAggAbort, match="only 3 clients sent masked inputs, fewer than the threshold 4"):
        run_protocol(inputs(5), config, dropouts_after_share=[3, 13])
    # on a ring each client's secrets have k + 1 = 3 holders: a survivor with a dropped neighbour
    # that also lost a holder after masking cannot be unmasked
    config = SecAggConfig(threshold=3, neighbours=2)
    quantised = inputs(7)
    ids = list(quantised)
    ring = neighbour_graph(ids, 0, 2)
    u = ids[0]
    with pytest.raises(SecAggAbort, match="fewer than the threshold 3; the sum cannot be unmasked"):
        run_protocol(quantised, config, dropouts_after_share=[ring[u][0]], dropouts_after_masking=[ring[u][1]])


def test_secure_sum_of_floats():
    rng = np.random.default_rng(1)
    vectors = [rng.uniform(-2, 2, 100) for _ in range(6)]
    config = SecAggConfig(threshold=3)
    step = 16.0 / LEVELS
    for dropped in ((), (2,), (0, 5)):
        expected = sum(v for u, v in enumerate(vectors) if u not in dropped)
        got = secure_sum(vectors, config, dropouts_after_share=dropped)
        assert np.abs(got - expected).max() <= 6 * step
    grid = [np.array([-8.0, 0.0, 8.0]), np.array([8.0, 8.0, -8.0]), np.array([0.0, 0.0, 0.0])]
    exact = dataclasses.replace(config, stochastic_rounding=False)
    assert secure_sum(grid, exact).tolist() == [0.0, 8.0, 0.0]


class Stages:
    """A round driven by hand, to reach between the stages."""

    def __init__(self, quantised: dict[int, np.ndarray], config: SecAggConfig) -> None:
        self.quantised, self.config = quantised, config
        length = len(next(iter(quantised.values())))
        self.server = SecAggServer(length, config)
        self.clients = {u: SecAggClient(u, length, config) for u in quantised}
        for client in self.clients.values():
            self.server.receive_advertisement(client.advertise())
        self.roster = self.server.roster()
        for u, client in self.clients.items():
            self.server.receive_shares(u, client.share_keys(self.roster))

    def mask(self, dropped=()) -> None:
        for u, client in self.clients.items():
            if u not in dropped:
                self.server.receive_masked_input(client.masked_input(self.quantised[u], self.server.shares_for(u)))


def recover_input(server: SecAggServer, u: int, seed_shares: dict, key_shares: dict, t: int) -> np.ndarray:
    """What a server holding shares of both secrets of client u computes: its input."""
    length = server.vector_length
    x = server.masked[u].masked - crypto.prg_words(combine(seed_shares, t), length)
    key = crypto.private_key_from(combine(key_shares, t))
    for v in neighbour_graph(server.advertisements, 0, server.config.neighbours)[u]:
        mask = crypto.prg_words(crypto.mask_seed(key, server.advertisements[v].masking_key, 0, u, v), length)
        x = x - mask if v > u else x + mask
    return x


def test_server_view_of_a_masked_input():
    quantised = inputs(5, length=10000)
    quantised[3][:] = 0  # a constant input: its masked vector must still look uniform
    config = SecAggConfig(threshold=3)
    stages = Stages(quantised, config)
    stages.mask()
    held = {v: dict(c._held) for v, c in stages.clients.items()}  # the clients' shares, before stage 3
    y = stages.server.masked[3].masked
    assert np.mean(y != quantised[3]) > 0.999
    counts = np.bincount(y >> np.uint32(28), minlength=16)  # the top 4 bits: 16 equally likely bins
    assert ((counts - 625.0) ** 2 / 625.0).sum() < 50  # χ² with 15 degrees of freedom; p ≈ 1e-5
    request = stages.server.unmask_request()
    for client in stages.clients.values():
        stages.server.receive_unmasking(client.unmask(request.survivors, request.dropped))
    points = evaluation_points(quantised)
    seeds = {points[v]: m.seed_shares[3] for v, m in stages.server.unmasking.items()}
    assert not any(3 in m.key_shares for m in stages.server.unmasking.values())  # no share of its key
    # the server's messages unmask the self mask; the pairwise masks remain
    unmasked = y - crypto.prg_words(combine(seeds, 3), 10000)
    assert np.mean(unmasked != quantised[3]) > 0.999
    # positive control: t shares of the key too (held by the clients, never sent) give the input back
    keys = {points[v]: held[v][3][1] for v in list(quantised)[:3]}
    np.testing.assert_array_equal(recover_input(stages.server, 3, seeds, keys, 3), quantised[3])
    # with t − 1 key shares the key is not recovered
    two = dict(list(keys.items())[:2])
    with pytest.raises(ValueError, match="cannot reconstruct"):
        recover_input(stages.server, 3, seeds, two, 3)
    with pytest.raises(ValueError):  # forcing it interpolates a wrong key, not the client's
        recover_input(stages.server, 3, seeds, two, 2)
    np.testing.assert_array_equal(stages.server.result(), exact_sum(quantised, quantised))


def test_client_refuses_to_unmask_a_client_both_ways():
    stages = Stages(inputs(5), SecAggConfig(threshold=3))
    stages.mask(dropped=[43])
    client = stages.clients[3]
    with pytest.raises(ProtocolError, match=r"refuses to unmask clients \[13\] both ways"):
        client.unmask([3, 13, 23, 33], [13, 43])
    other = stages.clients[13]
    with pytest.raises(ProtocolError, match="counts it as dropped"):
        other.unmask([3, 23, 33], [13, 43])
    with pytest.raises(ProtocolError, match="out of turn"):
        other.unmask([3, 13, 23, 33], [43])  # one request only: no second chance at the other share
    reply = stages.clients[23].unmask([3, 13, 23, 33], [43])
    assert set(reply.seed_shares) == {3, 13, 23, 33} and set(reply.key_shares) == {43}


def test_tampered_share_fails_authentication():
    stages = Stages(inputs(4), SecAggConfig(threshold=3))
    routed = stages.server.shares_for(3)
    bad = bytearray(routed[0].ciphertext)
    bad[20] ^= 1
    tampered = [dataclasses.replace(routed[0], ciphertext=bytes(bad)), *routed[1:]]
    with pytest.raises(ProtocolError, match=f"client {routed[0].sender}: its share for client 3 failed authentication"):
        stages.clients[3].masked_input(stages.quantised[3], tampered)
    # a share re-labelled as coming from another neighbour fails too (the sender is authenticated)
    stages = Stages(inputs(4), SecAggConfig(threshold=3))
    routed = stages.server.shares_for(3)
    swapped = [dataclasses.replace(routed[0], nonce=routed[1].nonce, ciphertext=routed[1].ciphertext), routed[1]]
    with pytest.raises(ProtocolError, match="failed authentication"):
        stages.clients[3].masked_input(stages.quantised[3], swapped)


@pytest.mark.parametrize("forged", ["garbage", "another key"])
def test_wrong_unmasking_share_is_detected(forged):
    stages = Stages(inputs(5), SecAggConfig(threshold=3))
    stages.mask(dropped=[43])
    request = stages.server.unmask_request()
    replies = {u: stages.clients[u].unmask(request.survivors, request.dropped) for u in request.survivors}
    points = evaluation_points(stages.quantised)
    if forged == "garbage":  # interpolates to no 32-byte secret at all
        share = (1).to_bytes(SHARE_BYTES, "big")
    else:  # consistent with the other two shares the server combines, but for the key 0x07 … 07
        others = {points[v]: share_value(replies[v].key_shares[43]) for v in (13, 23)}
        share = lagrange_at({0: int.from_bytes(b"\x07" * 32, "big"), **others}, points[3]).to_bytes(SHARE_BYTES, "big")
    replies[3] = UnmaskingShares(3, replies[3].seed_shares, {43: share})
    for reply in replies.values():
        stages.server.receive_unmasking(reply)
    message = "key shares are inconsistent" if forged == "garbage" else "reconstructed masking key does not match"
    with pytest.raises(ProtocolError, match=f"client 43: its {message}"):
        stages.server.result()


def self_mask_seed(run, u: int) -> bytes:
    """Client u's self-mask seed, as the server reconstructs it from the unmasking shares."""
    points = evaluation_points(run.server.advertisements)
    shares = {points[v]: m.seed_shares[u] for v, m in run.server.unmasking.items() if u in m.seed_shares}
    return combine(shares, run.server.config.threshold)


def test_masks_and_keys_are_fresh_per_run():
    quantised = inputs(5)
    config = SecAggConfig(threshold=3)
    runs = []
    for _ in range(2):
        random.seed(0)
        np.random.seed(0)
        runs.append(run_protocol(quantised, config, dropouts_after_share=[13]))
    a, b = runs
    assert all(np.mean(a.masked[u].masked != b.masked[u].masked) > 0.99 for u in a.masked)
    for u in quantised:
        assert a.server.advertisements[u].masking_key != b.server.advertisements[u].masking_key
        assert a.server.advertisements[u].encryption_key != b.server.advertisements[u].encryption_key
    seeds = [self_mask_seed(run, u) for run in runs for u in run.survivors]
    assert len(set(seeds)) == len(seeds)  # no self-mask seed repeats, across clients or runs
    np.testing.assert_array_equal(a.total, b.total)
    np.testing.assert_array_equal(a.total, exact_sum(quantised, a.survivors))


def test_shares_are_bound_to_round_sender_and_receiver():
    key = b"\x05" * 32
    nonce, ciphertext = crypto.encrypt(key, b"share", 7, 1, 2)
    assert crypto.decrypt(key, nonce, ciphertext, 7, 1, 2) == b"share"
    for round_index, sender, receiver in ((8, 1, 2), (7, 2, 1), (7, 1, 3)):
        with pytest.raises(crypto.DecryptionFailed):
            crypto.decrypt(key, nonce, ciphertext, round_index, sender, receiver)
    # the server reflects client 13's share for client 3 back to 13 as if 3 had sent it
    stages = Stages(inputs(4), SecAggConfig(threshold=3))
    to_3 = next(s for s in stages.server.shares_for(3) if s.sender == 13)
    routed = [s for s in stages.server.shares_for(13) if s.sender != 3]
    reflected = dataclasses.replace(to_3, sender=3, receiver=13)
    with pytest.raises(ProtocolError, match="client 3: its share for client 13 failed authentication"):
        stages.clients[13].masked_input(stages.quantised[13], [reflected, *routed])


def test_messages_are_bounded_by_the_config():
    config = SecAggConfig(threshold=3, max_clients=4)
    stages = Stages(inputs(4), config)
    with pytest.raises(ProtocolError, match=r"client 3 sent a vector .*expected uint32 of 64"):
        stages.server.receive_masked_input(MaskedInput(3, np.zeros(65, np.uint32)))
    with pytest.raises(ProtocolError, match=r"client 3 sent a vector .*expected uint32 of 64"):
        stages.server.receive_masked_input(MaskedInput(3, np.zeros(64, np.int64)))
    routed = stages.server.shares_for(3)
    short = dataclasses.replace(routed[0], ciphertext=routed[0].ciphertext[:-1])
    sender = routed[0].sender  # two 66-byte shares and a 16-byte tag: 148 bytes
    with pytest.raises(ProtocolError, match=f"client {sender} sent an encrypted share of 147 bytes, expected 148"):
        stages.clients[3].masked_input(stages.quantised[3], [short])
    with pytest.raises(ProtocolError, match="more shares than it has neighbours"):
        stages.clients[13].masked_input(stages.quantised[13], routed + routed[:1])
    stages = Stages(inputs(4), config)
    stages.mask()
    request = stages.server.unmask_request()
    reply = stages.clients[23].unmask(request.survivors, request.dropped)
    bad = UnmaskingShares(23, {**reply.seed_shares, 3: PRIME.to_bytes(SHARE_BYTES, "big")}, {})
    with pytest.raises(ProtocolError, match="client 23 sent a seed share of client 3 that is not a field element"):
        stages.server.receive_unmasking(bad)
    with pytest.raises(ProtocolError, match="client 23 sent a key share of client 3 it does not hold or was not asked"):
        stages.server.receive_unmasking(UnmaskingShares(23, reply.seed_shares, {3: reply.seed_shares[3]}))
    with pytest.raises(ProtocolError, match="more than 4"):
        stages.clients[3].unmask(list(range(5)), [])
    server = SecAggServer(8, config)
    client = SecAggClient(1, 8, config)
    ad = client.advertise()
    with pytest.raises(ProtocolError, match="client 1 sent a masking key of 31 bytes"):
        server.receive_advertisement(dataclasses.replace(ad, masking_key=ad.masking_key[:31]))
    others = [SecAggClient(u, 8, config).advertise() for u in (2, 3, 4, 5)]
    with pytest.raises(ProtocolError, match="at most 4 clients"):
        client.share_keys([ad, *others])


def test_low_order_key_and_order_of_stages():
    config = SecAggConfig(threshold=2)
    client = SecAggClient(1, 8, config)
    with pytest.raises(ProtocolError, match="out of turn"):
        client.masked_input(np.zeros(8, np.uint32), [])
    bad = dataclasses.replace(SecAggClient(2, 8, config).advertise(), encryption_key=bytes(32))
    with pytest.raises(ProtocolError, match="client 2 advertised a low-order public key"):
        client.share_keys([client.advertise(), bad])
