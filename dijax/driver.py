"""A minimal driver for the ragged step: owns the cache, hands out blocks and slots, runs prefill and decode.

No scheduler: the caller says which sequences advance in each step (dijax.runtime builds the real engine on the
same step). Steps are padded to power-of-two buckets of tokens and sequences, so the number of compiled
executables stays small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from dijax.config import ModelConfig
from dijax.model.step import CacheSpec, SeqChunk, build_step, init_cache
from dijax.model.transformer import make_step_fn


def bucket(n: int, minimum: int = 8) -> int:
    """Smallest power of two >= max(n, minimum)."""
    size = minimum
    while size < n:
        size *= 2
    return size


@dataclass
class Sequence:
    """One sequence's resources: its state slot, its blocks, and how many of its tokens are cached."""

    slot: int
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0


class Driver:
    """Runs steps of ``forward_step`` over a donated cache.

    cfg: model config; params: parameter pytree; consts: Engram device constants (may be empty);
    spec: cache sizes. ``max_seq_len`` bounds every sequence (block tables are sized by it). kernel_options: the
    step's static kernel choice (dijax.kernels.kernel_options; default the jnp references).
    """

    def __init__(self, cfg: ModelConfig, params: dict, consts: dict, spec: CacheSpec, max_seq_len: int,
                 kernel_options: dict[str, str] | None = None):
        self.cfg, self.params, self.consts, self.spec = cfg, params, consts, spec
        self.max_blocks = spec.blocks_for(max_seq_len)
        self.max_seq_len = max_seq_len
        self.cache = init_cache(cfg, spec)
        self.free_blocks = list(range(spec.num_blocks))
        self.free_slots = list(range(spec.num_slots))
        self._step = make_step_fn(cfg, **(kernel_options or {}))

    def new_sequence(self) -> Sequence:
        if not self.free_slots:
            raise RuntimeError(f"all {self.spec.num_slots} state slots are in use")
        return Sequence(slot=self.free_slots.pop(0))

    def release(self, seq: Sequence) -> None:
        """Return a sequence's blocks and slot to the pools (together, in one place)."""
        self.free_blocks.extend(seq.blocks)
        self.free_slots.append(seq.slot)
        seq.blocks, seq.num_cached = [], 0

    def _reserve(self, seq: Sequence, length: int) -> None:
        if length > self.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds max_seq_len={self.max_seq_len}")
        need = self.spec.blocks_for(length) - len(seq.blocks)
        if need > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self.free_blocks)} free")
        for _ in range(max(need, 0)):
            seq.blocks.append(self.free_blocks.pop(0))

    def step(self, work: list[tuple[Sequence, list[int], str]],
             inject_topk: dict[int, np.ndarray] | None = None) -> tuple[list[np.ndarray], dict[int, list[np.ndarray]]]:
        """Advance each (sequence, new tokens, logits mode) by its tokens in one step.

        logits mode is "last", "all" or "none". inject_topk: {layer: int32 [total tokens, index_topk]} in the
        order of ``work``'s tokens. Returns per work item its logits [n, V] and, per index-source layer, its
        selected compressed positions [n_tokens, index_topk] (test seam / diagnostics).
        """
        chunks = []
        for seq, tokens, mode in work:
            self._reserve(seq, seq.num_cached + len(tokens))
            chunks.append(SeqChunk(slot=seq.slot, block_table=seq.blocks, start=seq.num_cached, tokens=tokens,
                                   logits=mode))
        total = sum(len(t) for _, t, _ in work)
        num_tokens, num_seqs = bucket(total), bucket(len(work), 1)
        rows = sum({"last": 1, "all": len(t), "none": 0}[m] for _, t, m in work)
        batch, rows_per_chunk = build_step(chunks, num_tokens, num_seqs, self.max_blocks, bucket(rows, 1))
        inject = None
        if inject_topk is not None:
            inject = {layer: jnp.asarray(np.pad(v, ((0, num_tokens - v.shape[0]), (0, 0)), constant_values=-1))
                      for layer, v in inject_topk.items()}
        logits, self.cache, topk = self._step(self.params, self.cache, batch, self.consts, inject)
        logits = np.asarray(logits)
        for seq, tokens, _ in work:
            seq.num_cached += len(tokens)
        starts = np.cumsum([0] + [len(t) for _, t, _ in work])
        per_layer = {layer: [np.asarray(v)[a:b] for a, b in zip(starts[:-1], starts[1:])]
                     for layer, v in topk.items()}
        return [logits[r] for r in rows_per_chunk], per_layer

    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int, chunk: int | None = None) -> list[list[int]]:
        """Prefill every prompt (in chunks of ``chunk`` tokens if given), then greedy-decode ``max_new_tokens``."""
        seqs = [self.new_sequence() for _ in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        pending = [list(p) for p in prompts]
        last_logits: list[np.ndarray | None] = [None] * len(prompts)
        while any(pending):
            work, owners = [], []
            for i, rest in enumerate(pending):
                if rest:
                    n = len(rest) if chunk is None else min(chunk, len(rest))
                    work.append((seqs[i], rest[:n], "last"))
                    owners.append(i)
                    pending[i] = rest[n:]
            logits, _ = self.step(work)
            for i, lg in zip(owners, logits):
                last_logits[i] = lg[-1]
        for i in range(max_new_tokens):
            tokens = [int(np.argmax(lg)) for lg in last_logits]
            for out, tok in zip(outputs, tokens):
                out.append(tok)
            if i == max_new_tokens - 1:
                break
            logits, _ = self.step([(s, [t], "last") for s, t in zip(seqs, tokens)])
            last_logits = [lg[-1] for lg in logits]
        for s in seqs:
            self.release(s)
        return outputs
