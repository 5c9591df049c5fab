"""The pure cores of the sharded embedding: routing plans, per-key initial rows, the hash index."""

from __future__ import annotations

import pytest
import torch

from trainer.sparse.hashing import KeyIndex, SparseError
from trainer.sparse.keys import init_rows, restore, route


def test_routing_groups_keys_by_owner_in_input_order_and_restores_it() -> None:
    keys = torch.tensor([5, 0, 3, 1, 6, 4, -1])
    plan = route(keys, 3)
    assert plan.splits == [3, 2, 2]  # owners 2 0 0 1 0 1 2
    assert keys[plan.order].tolist() == [0, 3, 6, 1, 4, 5, -1]
    assert torch.equal(restore(plan.order, keys[plan.order]), keys)


def test_a_keys_initial_row_depends_on_key_and_seed_only() -> None:
    rows = init_rows(torch.tensor([7, 2**40 + 7, -7, 7]), 64, seed=1, scale=0.5)
    assert torch.equal(rows[0], rows[3])
    assert not torch.equal(rows[0], rows[1]) and not torch.equal(rows[0], rows[2])
    assert rows.abs().max() <= 0.5 and rows.std() > 0.2  # uniform in [-0.5, 0.5): std 0.29
    assert not torch.equal(rows, init_rows(torch.tensor([7, 2**40 + 7, -7, 7]), 64, seed=2,
                                           scale=0.5))


def test_the_hash_index_inserts_each_new_key_once_and_finds_it_again() -> None:
    index = KeyIndex(8, where="test")
    rows, new = index.rows(torch.tensor([10, 99, 10, -5, 99]), insert=True)
    assert rows[0] == rows[2] and rows[1] == rows[4] and len(set(rows.tolist())) == 3
    assert sorted(new.tolist()) == sorted(set(rows.tolist()))
    again, new_again = index.rows(torch.tensor([-5, 10, 99]), insert=True)
    assert again.tolist() == [int(rows[3]), int(rows[0]), int(rows[1])] and len(new_again) == 0


def test_get_only_lookups_of_absent_keys_give_minus_one_and_insert_nothing() -> None:
    index = KeyIndex(4, where="test")
    index.rows(torch.tensor([1]), insert=True)
    rows, _ = index.rows(torch.tensor([1, 2]), insert=False)
    assert rows[1] == -1 and rows[0] >= 0 and index.size == 1


def test_colliding_keys_fill_a_full_table_deterministically() -> None:
    keys = torch.arange(0, 64, 4)  # more keys than slots of a probe: collisions guaranteed
    layouts = []
    for _ in range(2):
        index = KeyIndex(16, where="test")
        rows, _ = index.rows(keys, insert=True)
        assert sorted(rows.tolist()) == list(range(16))
        layouts.append(index.slot_keys.clone())
    assert torch.equal(*layouts)


def test_inserting_beyond_the_capacity_says_so_and_writes_nothing() -> None:
    index = KeyIndex(4, where="DLRM embedding, rank 1")
    index.rows(torch.tensor([1, 2, 3]), insert=True)
    with pytest.raises(SparseError, match=r"embedding hash table is full \[DLRM embedding, "
                                          r"rank 1\]: 3 keys held, 2 new keys .* capacity 4 "
                                          r"rows per rank\. Raise the hash capacity"):
        index.rows(torch.tensor([4, 5, 1]), insert=True)
    assert index.size == 3
