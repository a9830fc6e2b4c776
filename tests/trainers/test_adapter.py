"""Group cutting and sharing across ranks (pure functions of the adapter)."""
from __future__ import annotations

from kvroll.trainers.adapter import _group_chunks, _mix_seed, _share


def test_groups_of_identical_consecutive_prompts():
    rows = [[1]] * 4 + [[2]] * 4 + [[1]] * 4
    assert _group_chunks(rows, 4) == [(0, 4), (4, 4), (8, 4)]


def test_adjacent_duplicate_groups_are_split_at_the_group_size():
    rows = [[5, 6]] * 8 + [[7]] * 4  # the same prompt drawn twice in a row
    assert _group_chunks(rows, 4) == [(0, 4), (4, 4), (8, 4)]


def test_ragged_runs_fall_back_to_smaller_chunks():
    rows = [[1]] * 3 + [[2]] * 5
    assert _group_chunks(rows, 4) == [(0, 3), (3, 4), (7, 1)]


def test_sharing_whole_groups_across_ranks():
    chunks = [(0, 4), (4, 4), (8, 4)]  # 12 rows over 2 ranks of 6: the middle group straddles them
    shares = _share(chunks, 2)
    assert sorted(i for share in shares for i in share) == [0, 1, 2]
    assert shares == [[0, 1], [2]]
    assert _share(chunks, 1) == [[0, 1, 2]]
    assert _share(chunks, 4) == [[0], [1], [2], []]  # fewer groups than ranks: some ranks idle


def test_seeds_differ_per_call_and_rank():
    seeds = {_mix_seed(0, call, rank, 4) for call in range(3) for rank in range(2)}
    assert len(seeds) == 6 and _mix_seed(1, 0, 0, 4) == _mix_seed(1, 0, 0, 4)
