"""The step's block tables kept from one step to the next instead of rebuilt from Python lists.

Row i holds the table of the batch's i-th sequence. A step rewrites a row only from where it last
stopped writing, while the row still holds the same table list: the BlockManager grows a table in
place and replaces it (never edits it) when the blocks are released, and a sequence that moved to
another row is a different list there. A decode step thus writes a handful of new block ids, not
every table of the batch (DecodeGraphRunner keeps its static buffers the same way).
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTableRows:
    def __init__(self, max_rows: int, width: int):
        self._array = np.zeros((max_rows, width), dtype=np.int32)
        self._rows: list[tuple[list | None, int]] = [(None, 0)] * max_rows  # (table list, entries written)

    def tensor(self, seqs) -> torch.Tensor:
        """[len(seqs), longest table] int32, zero past each table's end (a fresh tensor)."""
        array, rows = self._array, self._rows
        if len(seqs) > len(rows):  # more sequences than max_num_seqs (a beam search's step)
            self._grow(len(seqs), self._array.shape[1])
            array, rows = self._array, self._rows
        longest = 0
        for i, seq in enumerate(seqs):
            table = seq.block_table
            held, written = rows[i]
            n = len(table)
            if held is table and n == written:  # a decode's usual step: nothing new in its row
                if n > longest:
                    longest = n
                continue
            if n > array.shape[1]:
                self._grow(len(rows), n)
                array = self._array
            if held is not table:
                array[i, n:written] = 0  # what the row's previous table left past this one's end
                written = 0
            elif n < written:  # not expected of a held table; rewritten whole to stay safe
                array[i, n:written] = 0
                written = 0
            if n > written:
                array[i, written:n] = table[written:]
            rows[i] = (table, n)
            longest = max(longest, n)
        # a copy even where the slice is contiguous (every row as wide as the buffer): the next step rewrites it
        return torch.from_numpy(array[: len(seqs), :longest].copy())

    def _grow(self, num_rows: int, width: int) -> None:
        array = np.zeros((num_rows, width), dtype=np.int32)
        old = self._array
        array[: len(old), : old.shape[1]] = old
        self._array = array
        self._rows.extend([(None, 0)] * (num_rows - len(self._rows)))
