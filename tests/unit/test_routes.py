"""Who sends which samples' rows to whom across a boundary, with blocks and with post-balanced owners."""

from __future__ import annotations

from disttrain_ds.comm.routes import block_owners, owned, pair_links, pieces, routes, row_index


def test_block_owners_give_the_routes_of_contiguous_blocks():
    up, down = block_owners(8, 2), block_owners(8, 4)
    assert up == [0, 0, 0, 0, 1, 1, 1, 1] and down == [0, 0, 1, 1, 2, 2, 3, 3]
    assert pair_links([up], [down]) == {(r.up, r.down) for r in routes(8, 2, 4)}
    mine = owned(up, 1)
    assert mine == [4, 5, 6, 7] and pieces(mine, down, 4) == [[], [], [0, 1], [2, 3]]


def test_post_balanced_owners_route_each_sample_to_the_replica_holding_it():
    up = [1, 0, 0, 1, 0, 1]    # unequal counts, interleaved
    down = [0, 0, 1, 1, 1, 0]
    mine = owned(up, 1)        # positions 0, 3, 5, in slot order
    parts = pieces(mine, down, 2)
    assert parts == [[0, 2], [1]]  # position 0 and 5 go to replica 0, position 3 to replica 1
    rows = [2, 0, 3]            # rows of this replica's samples (position 3 has none)
    assert row_index(rows, parts[0]) == [0, 1, 2, 3, 4] and row_index(rows, parts[1]) == []
    # Receiving side: replica 0 of ``down`` holds positions 0, 1, 5; its rows come from up 1 (0, 5) and up 0 (1).
    theirs = owned(down, 0)
    back = pieces(theirs, up, 2)
    assert back == [[1], [0, 2]]
    assert row_index([1, 4, 2], [i for part in back for i in part]) == [1, 2, 3, 4, 0, 5, 6]
    assert pair_links([up], [down]) == {(1, 0), (0, 0), (0, 1), (1, 1)}
