"""The ragged step: a sequence's results do not depend on what else shares the step, and greedy generation with
chunked prefill follows the one-shot prefill (through ``ModelRunner.forward``)."""

from __future__ import annotations

import numpy as np

from dijax.model.step import SeqChunk
from dijax.runtime.model_runner import ModelRunner

BLOCK_SIZE, BLOCKS_PER_SEQ = 16, 4  # every sequence here stays below 64 tokens


def _runner(fixture, params, consts, num_seqs):
    return ModelRunner(fixture.cfg, params, consts, num_blocks=BLOCKS_PER_SEQ * num_seqs, num_slots=num_seqs,
                       block_size=BLOCK_SIZE, max_model_len=BLOCK_SIZE * BLOCKS_PER_SEQ, max_num_seqs=num_seqs,
                       max_num_batched_tokens=64 * num_seqs)


def _chunk(i: int, start: int, tokens: list[int], logits: str) -> SeqChunk:
    """Sequence i's chunk: slot i, its own blocks up to the chunk's last position."""
    blocks = range(i * BLOCKS_PER_SEQ, i * BLOCKS_PER_SEQ + -(-(start + len(tokens)) // BLOCK_SIZE))
    return SeqChunk(slot=i, block_table=list(blocks), start=start, tokens=tokens, logits=logits)


def _generate_greedy(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
                     chunk: int | None = None) -> list[list[int]]:
    """Prefill every prompt (in chunks of ``chunk`` tokens if given), then greedy-decode ``max_new_tokens``; prompt i
    is sequence i."""
    cached = [0] * len(prompts)
    last_V: list[np.ndarray | None] = [None] * len(prompts)
    while any(c < len(p) for c, p in zip(cached, prompts)):
        owners = [i for i, p in enumerate(prompts) if cached[i] < len(p)]
        ends = [len(prompts[i]) if chunk is None else min(cached[i] + chunk, len(prompts[i])) for i in owners]
        logits, _ = runner.forward([_chunk(i, cached[i], prompts[i][cached[i]:end], "last")
                                    for i, end in zip(owners, ends)])
        for i, end, lg in zip(owners, ends, logits):
            cached[i], last_V[i] = end, lg[-1]
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        tokens = [int(np.argmax(lg)) for lg in last_V]
        for out, tok in zip(outputs, tokens):
            out.append(tok)
        if step == max_new_tokens - 1:
            break
        logits, _ = runner.forward([_chunk(i, cached[i], [t], "last") for i, t in enumerate(tokens)])
        cached = [c + 1 for c in cached]
        last_V = [lg[-1] for lg in logits]
    return outputs


def test_batch_composition_does_not_change_a_sequence(tiny_nodrop):
    """Prefill three prompts of different lengths together, then each alone (different slots, blocks and padding):
    every token's logits agree to fp32 summation-order noise, and exactly in the argmax where margins are large."""
    fixture, params, consts = tiny_nodrop
    ids = fixture.tensor("case_L23", "input_ids")
    prompts = [list(map(int, ids[0][:23])), list(map(int, ids[1][:9])), list(map(int, ids[2][:16]))]
    joint, _ = _runner(fixture, params, consts, 3).forward([_chunk(i, 0, p, "all") for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        (solo,), _ = _runner(fixture, params, consts, 1).forward([_chunk(0, 0, prompt, "all")])
        r = np.abs(solo - joint[i]).max(-1) / np.abs(solo).max(-1)
        assert np.median(r) <= 1e-2 and r.max() <= 0.1, (i, np.median(r), r.max())
        top2 = np.sort(solo, -1)[:, -2:]
        big = top2[:, 1] - top2[:, 0] >= 0.25
        assert np.array_equal(solo.argmax(-1)[big], joint[i].argmax(-1)[big])


def test_greedy_generation_chunked(tiny_nodrop):
    fixture, params, consts = tiny_nodrop
    prompts = [list(map(int, row[:12])) for row in fixture.tensor("case_L23", "input_ids")]
    runner = _runner(fixture, params, consts, 3)
    one_shot = _generate_greedy(runner, prompts, max_new_tokens=6)
    chunked = _generate_greedy(runner, prompts, max_new_tokens=6, chunk=5)
    assert all(len(out) == 6 for out in one_shot)
    assert all(0 <= t < fixture.cfg.vocab_size for out in one_shot for t in out)
    # the first token follows the prompt's last logits; chunking must not change it where the margin is clear
    assert [o[0] for o in one_shot] == [o[0] for o in chunked]
