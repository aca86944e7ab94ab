"""Varlen packing for teacher forcing: the one packer of the codebase (vime's trainer engines and the
reference rollout's re-scoring through `vime.trainer.grpo`, and `Qwen3Reference.sequence_logprobs`).

Sequences are concatenated into one token stream `ids` [T] with `cu_seqlens` [B+1]; row t predicts
the token at t + 1 (`targets[t]`, 0 where the next token is in another sequence or past the end), so
the response tokens j >= prompt_len of sequence i are predicted by the rows `start_i + j - 1`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    ids: torch.Tensor  # [T] int64 token ids, sequences back to back
    cu_seqlens: torch.Tensor  # [B+1] int64: 0, len_0, len_0 + len_1, ..., T
    targets: torch.Tensor  # [T] int64: the token row t predicts (0 at the end of the stream)
    rows: torch.Tensor  # [R] int64: rows whose prediction is a response token, sequence by sequence
    counts: list[int]  # response tokens per sequence (sum = R)
    positions: list[list[int]]  # per sequence, the positions of its response tokens (prompt_len + j)

    def per_row(self, values: list[float], fill: float = 1.0) -> torch.Tensor:
        """[T] fp64: every row of sequence i holds values[i] (e.g. its temperature)."""
        if len(values) != len(self.counts):
            raise ValueError(f"{len(self.counts)} sequences but {len(values)} values")
        out = torch.full((self.ids.numel(),), float(fill), dtype=torch.float64)
        cu = self.cu_seqlens.tolist()
        for i, v in enumerate(values):
            out[cu[i] : cu[i + 1]] = float(v)
        return out

    def on_rows(self, per_sequence: list[torch.Tensor | float]) -> torch.Tensor:
        """[T] fp32 with sequence i's response values (a tensor of counts[i] values, or one scalar
        repeated) on its response rows and 0 elsewhere."""
        out = torch.zeros(self.ids.numel(), dtype=torch.float32)
        for i, (rows, v) in enumerate(zip(self.rows.split(self.counts), per_sequence)):
            if isinstance(v, torch.Tensor) and v.numel() != rows.numel():
                raise ValueError(f"sequence {i}: {v.numel()} values for {rows.numel()} response tokens")
            out[rows] = v.float() if isinstance(v, torch.Tensor) else float(v)
        return out


def pack(sequences: list[list[int]], prompt_lens: list[int]) -> Packed:
    """Pack `sequences` (token ids; the first prompt_lens[i] of sequence i are its prompt)."""
    if not sequences or len(sequences) != len(prompt_lens):
        raise ValueError(
            f"need one prompt_len per sequence and at least one sequence; got {len(sequences)} "
            f"sequences, {len(prompt_lens)} prompt_lens"
        )
    for s, p in zip(sequences, prompt_lens):
        if not 1 <= p <= len(s):
            raise ValueError(f"prompt_len {p} must be in [1, len(sequence)={len(s)}]")
    lens = [len(s) for s in sequences]
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)
    targets = torch.zeros_like(ids)
    targets[:-1] = ids[1:]
    rows = [torch.arange(a + p - 1, a + n - 1) for a, p, n in zip(cu.tolist(), prompt_lens, lens)]
    return Packed(
        ids,
        cu,
        targets,
        torch.cat(rows),
        [n - p for n, p in zip(lens, prompt_lens)],
        [list(range(p, n)) for p, n in zip(prompt_lens, lens)],
    )
