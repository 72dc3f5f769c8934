"""engine.runner.warm_up._batch: the scratch batch the CPU kernels compile on at load is a valid paged
batch at every block size (the native kernels check that each context fits its block table; block_size=4
once gave a 5-token decode a one-block table, and the load failed)."""

from __future__ import annotations

import pytest

from engine.runner.warm_up import _batch


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("max_len", [8, 40, 4096])
def test_every_context_fits_its_block_table(block_size, max_len):
    seqs = _batch(block_size, max_len)
    for length, new_tokens, table in seqs:
        assert 0 < new_tokens <= length <= max_len
        assert len(table) * block_size >= length
        assert 0 not in table  # block 0 stays unused
    first, second = seqs[0][2], seqs[1][2]
    assert first[:2] == second[:2] == [1, 2]  # two decodes share their first two blocks
    own = [block for _, _, table in seqs[2:] for block in table] + first[2:] + second[2:]
    assert len(own) == len(set(own)) and not set(own) & {1, 2}  # every other block belongs to one sequence


def test_the_kinds_of_rows_are_all_there():
    seqs = _batch(16, 4096)
    decodes = [s for s in seqs if s[1] == 1]
    assert len(decodes) == 3  # two sharing a prefix, one alone
    assert any(1 < q < length for length, q, _ in seqs)  # a chunk after a cached prefix
    assert any(q == length > 64 for length, q, _ in seqs)  # a long prompt
