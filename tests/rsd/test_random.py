"""rsd.random: Philox4x32-10 against its published answers, draws as a pure function of their key
(layout, dtype and device free), no collisions, and uniform, independent streams."""

import pytest
import torch

from rsd.random import Draw, StepRandom, Stream, _philox_ints, philox4x32
from rsd.sampling import gumbel_top_k, without_replacement
from tests.fixtures.toy import chi_square_pvalue

# Random123's kat_vectors for philox4x32-10: (counter, key, output)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "out"), KAT)
def test_philox_matches_random123(counter, key, out):
    words = philox4x32(torch.tensor(counter, dtype=torch.int64)[:, None], key)  # [4, 1]
    assert words.flatten().tolist() == list(out)
    assert _philox_ints(*counter, *key) == out


def test_few_and_many_counters_give_the_same_bits():
    """uniform() takes Python ints for a few counters and tensors for many: the same function."""
    rng = StepRandom(2**64 - 3, Stream.VERIFY, 2**32 - 1)
    nodes = torch.tensor([0, 1, 2**31, 2**32 - 1])[:, None]  # [4, 1]
    columns = torch.tensor([0, 1, 2, 3, 151_935, 2**32 - 1])  # [6]
    many = rng.uniform(Draw.ACCEPT, nodes.expand(-1, 100).flatten()[:, None], columns)  # 2,400 counters
    few = torch.stack([rng.uniform(Draw.ACCEPT, int(n), columns) for n in nodes.expand(-1, 100).flatten()])
    assert torch.equal(many, few)


def test_a_draw_depends_on_its_key_alone():
    """The same (node, column) gets the same bits whatever else is drawn with it, in any layout."""
    rng = StepRandom(7, Stream.DRAFT, 123)
    nodes, vocab = torch.tensor([3, 0, 9]), 1001
    rows = rng.uniform_rows(Draw.GUMBEL, nodes, vocab)  # [3, V]
    assert torch.equal(rows, rng.uniform(Draw.GUMBEL, nodes[:, None], torch.arange(vocab)))
    ids = torch.tensor([[5, 1000, 0], [2, 3, 4], [999, 7, 8]])
    assert torch.equal(rng.uniform(Draw.GUMBEL, nodes[:, None], ids), rows.gather(-1, ids))
    assert torch.equal(rng.uniform(Draw.GUMBEL, nodes[1:, None], ids[1:, :1]), rows[1:].gather(-1, ids[1:, :1]))
    assert torch.equal(rng.gumbel(nodes, ids), rng.gumbel(nodes, None, vocab).gather(-1, ids))
    # A law's dtype and its support cut do not change the draws: a top-k law picks the same children
    # from its float32, float64 and bfloat16 forms and from the dense or the sparse search.
    law = torch.zeros(2, 40_000)
    law[:, torch.arange(0, 40_000, 157)] = torch.rand(2, 255, generator=torch.Generator().manual_seed(0)) + 0.5
    law = law / law.sum(-1, keepdim=True)
    for sampler in (gumbel_top_k, without_replacement):
        picks = {
            str(dtype): sampler(law.to(dtype), 4, rng, nodes[:2])[0].tolist()
            for dtype in (torch.float32, torch.float64, torch.bfloat16)
        }
        assert len(set(map(str, picks.values()))) <= 2  # bfloat16 rounds the law itself; the draws are shared
        assert picks["torch.float32"] == picks["torch.float64"]
        narrow = law[:, :4_000] / law[:, :4_000].sum(-1, keepdim=True)  # denser: no block search
        wide = torch.zeros(2, 40_000)
        wide[:, :4_000] = narrow
        assert sampler(narrow, 4, rng, nodes[:2])[0].tolist() == sampler(wide, 4, rng, nodes[:2])[0].tolist()


def test_uniforms_are_exact_in_float64_and_inside_the_open_interval():
    u = StepRandom(0, Stream.DRAFT, 0).uniform_rows(Draw.GUMBEL, torch.arange(4), 50_000)  # [4, 50000]
    k = u * 2.0**52 - 0.5  # the 52-bit integer each uniform was made from
    assert torch.equal(k, k.round()) and float(u.min()) > 0 and float(u.max()) < 1


def test_no_two_keys_share_a_draw():
    """(stream, position, node) keys, 5 * 10^5 per stream: all 64 output bits distinct. (The generator this replaced
    kept 32 bits of its seed: seed 0's verify stream at 3293 repeated its draft stream at 24540.)"""
    words = []
    for stream in Stream:
        for position in (0, 1, 3293, 24540, 2**31):
            rng = StepRandom(0, stream, position)
            w = rng._words(Draw.ACCEPT, torch.arange(100_000)[:, None], torch.zeros(1, dtype=torch.int64))  # [4, n, 1]
            words.append(w[0].flatten() << 32 | w[1].flatten())
    words = torch.cat(words)  # [len(Stream) * 5 * 10^5]
    assert words.numel() == len(Stream) * 5 * 10**5 and torch.unique(words).numel() == words.numel()


def _binned(u, bins):
    return (u * bins).long().clamp_max(bins - 1)


def test_uniform_and_independent_across_positions_and_streams():
    """Chi-square of one draw (a step's first acceptance test) per position: its marginal, pairs of
    adjacent positions, and pairs of the two streams at one position."""
    n, bins = 20_000, 5
    zero = torch.zeros(1, dtype=torch.int64)

    def draws(stream):
        return torch.cat([StepRandom(5, stream, t).uniform(Draw.ACCEPT, 0, zero) for t in range(n + 1)])

    draft, verify = draws(Stream.DRAFT), draws(Stream.VERIFY)
    marginal = torch.bincount(_binned(draft[:n], bins), minlength=bins)
    assert chi_square_pvalue(dict(enumerate(marginal.tolist())), {i: 1 / bins for i in range(bins)}, n) > 1e-4
    law = {(i, j): 1 / bins**2 for i in range(bins) for j in range(bins)}
    for x, y in ((draft[:n], draft[1:]), (draft[:n], verify[:n]), (verify[:n], verify[1:])):
        cells = torch.bincount(_binned(x, bins) * bins + _binned(y, bins), minlength=bins**2)
        counts = {(i // bins, i % bins): int(v) for i, v in enumerate(cells)}
        assert chi_square_pvalue(counts, law, n) > 1e-4


def test_keys_are_checked():
    with pytest.raises(ValueError, match="root_position"):
        StepRandom(0, Stream.DRAFT, -1)
    with pytest.raises(ValueError, match="root_position"):
        StepRandom(0, Stream.DRAFT, 2**32)
    with pytest.raises(ValueError):
        StepRandom(0, 7, 0)
    with pytest.raises(ValueError, match="node ids"):
        StepRandom(0, Stream.DRAFT, 0).uniform(Draw.ACCEPT, -1, torch.arange(3))
