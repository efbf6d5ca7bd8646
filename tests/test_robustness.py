"""Robustness (issue 10): request lifetime under abort and failing steps, inputs read as written, checkpoints checked
against their config, a content-keyed conversion cache, 64-bit seeds, one-line CLI errors.

The randomized test drives the real engine (scheduler, block and slot pools, request lifetime, ZOS) with a fake
runner whose token at output position p of a request is a function of (seed, p) only, so every request's expected
tokens are known however it was batched, preempted, aborted or failed; a smaller test does the same on the real
tiny model against a clean run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

from dijax.cli.generate import read_prompts_file
from dijax.cli.main import main
from dijax.io.safetensors import SafetensorsFile
from dijax.runtime.llm import LLM
from dijax.runtime.sampler import sampling_inputs
from dijax.runtime.sampling_params import SamplingParams
from dijax.runtime.scheduler import FROM_DEVICE
from tests.conftest import parity_path

pytestmark = pytest.mark.cost(25)  # CI seconds, a scheduling hint (tests/conftest.py)

POISON = 1 << 62  # a seed with this bit makes the fake runner (or the wrapped real one) fail to launch the step;
CRASH = 1 << 61  # with this bit the fake step launches but fails while running (its wait() raises);
# every request of these tests has an explicit seed (a drawn one could carry the bits)
EOS = 1  # the embedded tiny model's eos token


def fake_token(seed: int, position: int) -> int:
    """The fake model's token: depends on (seed, output position) only; eos about one time in fifty."""
    return 1 + zlib.crc32(f"{seed}/{position}".encode()) % 50


class FakeHandle:
    def __init__(self, sampled: dict[str, tuple[int, int]], delay: float, crash: bool):
        self.sampled, self.delay, self.crash, self.logits = sampled, delay, crash, {}

    def wait(self) -> dict[str, tuple[int, int]]:
        time.sleep(self.delay)
        if self.crash:
            raise RuntimeError("the step failed while running")
        return self.sampled


class FakeRunner:
    """``ModelRunner.execute`` without a model: checks that in-flight inputs come from the previous step (as the
    device gather does), refuses steps holding a poisoned request, and samples ``fake_token``."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.launches = 0

    def execute(self, output, previous, record=None):
        for c in output.chunks:
            if c.token_ids[0] == FROM_DEVICE:
                assert previous is not None and previous.sampled[c.request_id][0] == c.epoch, c
            if c.seed & POISON:
                raise RuntimeError(f"cannot launch {c.request_id}")
        self.launches += 1
        return FakeHandle({c.request_id: (c.epoch, fake_token(c.seed, c.output_position))
                           for c in output.chunks if c.sample}, self.delay, any(c.seed & CRASH for c in output.chunks))


def _check_output(out, params: SamplingParams, prompt_len: int, max_model_len: int, aborted: set) -> None:
    """What a finished request must look like: its tokens the (seed, position) reference, its reason justified."""
    want = [fake_token(params.seed, p) for p in range(len(out.token_ids))]
    assert out.token_ids == want, f"{out.request_id}: tokens differ from the reference"
    assert (out.finish_reason == "abort") == (out.request_id in aborted), out
    if out.finish_reason == "length":
        assert len(out.token_ids) == params.max_tokens or prompt_len + len(out.token_ids) >= max_model_len
    elif out.finish_reason == "stop":
        assert out.token_ids[-1] == EOS and not params.ignore_eos
    elif out.finish_reason == "error":
        assert out.error and ("cannot launch" in out.error or "failed while running" in out.error), out
    else:
        assert out.finish_reason == "abort" and out.error is None


@pytest.fixture(scope="module")
def fake_llm():
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_blocks=20, max_model_len=64)
    llm.engine.runner = FakeRunner()
    return llm


def test_randomized_abort_and_failure_interleaving(fake_llm):
    """2,000+ engine calls: adds, steps, aborts of live / finished / unknown / future ids, steps failing at launch
    or while running, ZOS toggled; after every call the pools hold exactly what live requests own and no request's tokens changed."""
    engine, rng = fake_llm.engine, random.Random(10)
    max_model_len = engine.scheduler.max_model_len
    requests: dict[str, tuple[SamplingParams, int]] = {}
    finished: dict[str, object] = {}
    aborted: set[str] = set()
    counts = dict.fromkeys(("add", "step", "abort live", "abort finished", "abort unknown", "poison", "crash",
                            "error"), 0)

    def check(outputs):
        for out in outputs:
            assert out.request_id not in finished, f"{out.request_id} returned twice"
            finished[out.request_id] = out
            params, prompt_len = requests[out.request_id]
            _check_output(out, params, prompt_len, max_model_len, aborted)
            counts["error"] += out.finish_reason == "error"
        engine.scheduler.check_invariants()
        for rid, (params, _) in requests.items():  # live requests' tokens so far are the reference's too
            seq = engine.scheduler.get(rid)
            if seq is not None:
                assert seq.output_token_ids == [fake_token(params.seed, p) for p in range(len(seq.output_token_ids))]

    ops = 0
    while ops < 2200 or engine.has_unfinished():
        ops += 1
        live = [rid for rid in requests if rid not in finished and engine.is_live(rid)]
        op = rng.random()
        if op < 0.22 and len(requests) - len(finished) < 12:
            rid = f"q{len(requests)}"
            poison = rng.choice([0] * 46 + [POISON, CRASH])
            params = SamplingParams(max_tokens=rng.randint(1, 14), ignore_eos=rng.random() < 0.5, temperature=0.7,
                                    seed=rng.getrandbits(61) | poison)
            prompt = [rng.randrange(2, 500) for _ in range(rng.randint(1, 30))]
            engine.add_request(rid, prompt, params)
            requests[rid] = (params, len(prompt))
            counts[{0: "add", POISON: "poison", CRASH: "crash"}[poison]] += 1
        elif op < 0.32 and live:
            rid = rng.choice(live)
            assert engine.abort(rid) is True
            aborted.add(rid)
            counts["abort live"] += 1
        elif op < 0.37 and finished:
            assert engine.abort(rng.choice(list(finished))) is False
            counts["abort finished"] += 1
        elif op < 0.42:
            unknown = rng.choice([f"q{len(requests) + rng.randint(0, 3)}", "nobody", ""])
            assert engine.abort(unknown) is False  # a future id too: the request that gets it is not touched
            counts["abort unknown"] += 1
        else:
            if rng.random() < 0.02:
                engine.zos = not engine.zos
            check(engine.step())
            counts["step"] += 1
            continue
        check([])
    assert set(finished) == set(requests) and engine.scheduler.all_free()
    assert ops >= 2200 and all(counts.values()), counts
    engine.zos = True


def test_abort_from_another_thread_during_generate(fake_llm):
    """A second thread aborts live, finished and not-yet-existing ids while ``generate`` runs; a request finishes
    with 'abort' exactly when an abort of it returned True, and poisoned batches come back as errors."""
    llm, rng = fake_llm, random.Random(11)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # hand the GIL to the aborter thread often, whatever the machine's load
    llm.engine.runner.delay = 0.003  # a step long enough (GIL released while it sleeps) for the aborter to act
    done_ids: list[str] = []
    calls = aborted_live = 0
    try:
        for batch in range(60):
            first = llm._counter
            params = [SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, temperature=1.0,
                                     seed=rng.getrandbits(61) | (POISON if rng.random() < 0.05 else 0))
                      for _ in range(6)]
            prompts = [[rng.randrange(2, 500) for _ in range(rng.randint(1, 20))] for _ in range(6)]
            returned_true: set[str] = set()
            stop = threading.Event()

            def aborter():
                nonlocal calls
                while not stop.is_set():
                    pool = [f"req-{first + i}" for i in range(6)] + done_ids[-5:] + [f"req-{first + 6 + rng.randint(0, 2)}"]
                    rid = rng.choice(pool)
                    if llm.abort(rid):
                        returned_true.add(rid)
                    calls += 1
                    time.sleep(0.0003)

            thread = threading.Thread(target=aborter)
            thread.start()
            try:
                outs = llm.generate(prompts, params, use_tqdm=False)
            finally:
                stop.set()
                thread.join()
            for out, sp, prompt in zip(outs, params, prompts):
                _check_output(out, sp, len(prompt), llm.engine.scheduler.max_model_len, returned_true)
            assert not returned_true - {o.request_id for o in outs}  # no id outside the batch was ever aborted
            done_ids += [o.request_id for o in outs]
            aborted_live += len(returned_true)
            llm.engine.scheduler.check_invariants()
            assert not llm.engine.has_unfinished() and llm.engine.scheduler.all_free()
    finally:
        llm.engine.runner.delay = 0.0
        sys.setswitchinterval(switch)
    assert calls > 60 and aborted_live > 3, (calls, aborted_live)  # the thread really raced generate


# ------------------------------------------------------------------------------------------ the real tiny model

PROMPTS = ["The license", "Permission is hereby granted", [5, 6, 7, 8, 9, 10], "You may obtain"]


def _params(i: int, poison: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=30, max_tokens=4 + i % 3, ignore_eos=True,
                          seed=(2**40 + i) | (POISON if poison else 0))


@pytest.fixture(scope="module")
def real_llm():
    # the shapes of test_engine's warm-up test: in one pytest process every step bucket is compiled already
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    execute = llm.engine.runner.execute

    def failing_execute(output, previous, record=None):  # the real runner, refusing steps that hold a poisoned request
        if any(c.seed & POISON for c in output.chunks):
            raise RuntimeError("cannot launch a poisoned request")
        return execute(output, previous, record)

    llm.engine.runner.execute = failing_execute
    reference = [o.token_ids for o in llm.generate(PROMPTS, [_params(i) for i in range(4)], use_tqdm=False)]
    return llm, reference


def test_real_engine_survives_bad_aborts_and_a_failed_launch(real_llm):
    llm, reference = real_llm
    engine = llm.engine
    future = f"req-{llm._counter + 2}"
    assert not llm.abort("req-0") and not llm.abort("no-such-request") and not llm.abort(future)
    outs = llm.generate(PROMPTS, [_params(i) for i in range(4)], use_tqdm=False)
    assert [o.token_ids for o in outs] == reference and all(o.finish_reason == "length" for o in outs)
    assert future in {o.request_id for o in outs}
    # a failing launch: the requests in that step end with 'error', everything is freed, the engine goes on
    outs = llm.generate(PROMPTS + ["x"], [_params(i) for i in range(4)] + [_params(9, poison=True)],
                        use_tqdm=False)
    assert outs[-1].finish_reason == "error" and "poisoned" in outs[-1].error
    for out, want in zip(outs[:4], reference):
        assert out.token_ids == want[:len(out.token_ids)]
        assert out.finish_reason == ("error" if out.error else "length")
    engine.scheduler.check_invariants()
    assert engine.scheduler.all_free() and not engine.has_unfinished()
    again = llm.generate(PROMPTS, [_params(i) for i in range(4)], use_tqdm=False)
    assert [o.token_ids for o in again] == reference


def test_real_engine_random_interleaving_keeps_tokens(real_llm):
    """Adds, steps and aborts on the real model: every output is a prefix of the request's clean-run tokens."""
    llm, reference = real_llm
    engine, rng = llm.engine, random.Random(12)
    added: dict[str, int] = {}
    results: dict[str, object] = {}
    aborted: set[str] = set()
    for op in range(50):
        live = [rid for rid in added if engine.is_live(rid)]
        if rng.random() < 0.3 and len(live) < 6:
            i = rng.randrange(4)
            rid = f"rr{op}"
            engine.add_request(rid, PROMPTS[i], _params(i))
            added[rid] = i
        elif rng.random() < 0.2 and live:
            rid = rng.choice(live)
            assert engine.abort(rid)
            aborted.add(rid)
        else:
            assert not engine.abort(rng.choice(["rr-unknown", f"rr{op + 1}"] + list(results or ["x"])))
            results.update({o.request_id: o for o in engine.step()})
        engine.scheduler.check_invariants()
    while engine.has_unfinished():
        results.update({o.request_id: o for o in engine.step()})
    assert set(results) == set(added) and engine.scheduler.all_free()
    for rid, i in added.items():
        out = results[rid]
        assert out.token_ids == reference[i][:len(out.token_ids)]
        assert out.finish_reason == ("abort" if rid in aborted else "length")


def test_real_engine_input_errors_name_the_problem(real_llm):
    llm, _ = real_llm
    with pytest.raises(TypeError, match=r"mixes token ids with a str at index 1"):
        llm.generate([5, "hello"], use_tqdm=False)
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams, a list of them.*got dict"):
        llm.generate("hi", {"temperature": 1.0}, use_tqdm=False)
    with pytest.raises(TypeError, match=r"request 1: sampling params must be a SamplingParams, got dict"):
        llm.generate(["a", "b"], [SamplingParams(), {"temperature": 1.0}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"request 0: prompt is not valid UTF-8 text"):
        llm.generate("caf\udce9", use_tqdm=False)  # how Python decodes a non-UTF-8 command-line argument
    with pytest.raises(TypeError, match=r"token-id prompt must hold only ints, got float 2.0 at index 1"):
        llm.generate([[1, 2.0]], use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, seed=0)
    numpy_ids = llm.generate([np.int64(5), np.int32(6), 7], greedy, use_tqdm=False)
    plain = llm.generate([5, 6, 7], greedy, use_tqdm=False)
    assert numpy_ids[0].token_ids == plain[0].token_ids and numpy_ids[0].prompt == [5, 6, 7]
    assert not llm.engine.has_unfinished()


def test_seeds_differing_only_above_32_bits_sample_differently(real_llm):
    llm, _ = real_llm
    params = [SamplingParams(temperature=5.0, max_tokens=8, ignore_eos=True, seed=s) for s in (1, 1 + 2**32, 1)]
    outs = llm.generate(["The license"] * 3, params, use_tqdm=False)
    assert outs[0].token_ids != outs[1].token_ids and outs[0].token_ids == outs[2].token_ids


def test_sampling_params_refuse_what_the_step_cannot_hold():
    with pytest.raises(ValueError, match=r"SamplingParams.top_k must be in \[0, 2\*\*31 - 1\]"):
        SamplingParams(top_k=2**40)
    with pytest.raises(ValueError, match=r"SamplingParams.temperature must be a float in"):
        SamplingParams(temperature=1e39)
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1


def test_sampling_inputs_carry_all_64_bits_of_the_seed():
    class Row:
        def __init__(self, seed):
            self.params, self.seed, self.output_position = SamplingParams(top_k=7), seed, 3

    seed = (0xDEADBEEF << 31) | 12345
    columns = sampling_inputs([Row(1), Row(1 + 2**32), Row(seed)], 4)
    hi, lo = columns[3], columns[4]
    assert hi.dtype == lo.dtype == np.uint32 and [int(h) << 32 | int(l) for h, l in zip(hi, lo)] == [
        1, 1 + 2**32, seed, 0]
    assert columns[1].tolist() == [7, 7, 7, 0] and columns[0][3] == 0.0  # the padding row is greedy


def test_engine_arguments_are_checked_by_name():
    for kwargs, match in (({"block_size": 0}, "block_size must be an int >= 1, got 0"),
                          ({"max_num_seqs": 0}, "max_num_seqs must be an int >= 1, got 0"),
                          ({"num_blocks": -2}, "num_blocks must be an int >= 1"),
                          ({"max_model_len": 4096}, r"max_model_len must be <= the model's max_seq_len \(512\)"),
                          ({"small_token_buckets": (1, 8)}, r"small_token_buckets must be distinct values from "
                                                            r"\[1, 2, 4\]"),
                          ({"small_token_buckets": (2, 2)}, "small_token_buckets must be distinct"),
                          ({"small_token_buckets": 1}, r"small_token_buckets .* got 1$")):
        with pytest.raises(ValueError, match=match):
            LLM(**kwargs)
    with pytest.raises(TypeError, match="max_num_batched_tokens must be an int"):
        LLM(max_num_batched_tokens=16.0)
    for flag in ("zos", "trace_steps", "warmup"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool, got str 'yes'"):
            LLM(**{flag: "yes"})
    # the small token buckets reach the runner's plan: the steps of 2-4 tokens at their size, no 1-token bucket
    runner = LLM(small_token_buckets=[4, 2], max_num_batched_tokens=16).engine.runner
    assert sorted({t for t, _, _ in runner.buckets()}) == [2, 4, 8, 16]


# ------------------------------------------------------------------------------------------------ prompts file

def test_prompts_files_are_read_as_written(tmp_path):
    plain = tmp_path / "prompts.txt"
    plain.write_text('{"prompt": 1}\n\n  spaced  \nlast', encoding="utf-8")
    assert read_prompts_file(str(plain)) == ['{"prompt": 1}', "  spaced  ", "last"]
    records = tmp_path / "records.jsonl"
    records.write_text('{"prompt": "a"}\n{"prompt": [5, 7]}\n')
    assert read_prompts_file(str(records)) == ["a", [5, 7]]
    cases = {"int.jsonl": ('{"prompt": 123}\n', r"int.jsonl:1: 'prompt' must be a non-empty string or a list"),
             "two.jsonl": ('{"prompt": "ok"}\n{"prompt": 7}\n', r"two.jsonl:2: 'prompt' must be"),
             "bad.jsonl": ('{"prompt": "a"\n', r"bad.jsonl:1: not valid JSON"),
             "nofield.jsonl": ('{"text": "a"}\n', r"nofield.jsonl:1: each JSONL record must be an object"),
             "empty.txt": ("\n  \n", r"empty.txt: the file holds no prompts")}
    for name, (text, match) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=match):
            read_prompts_file(str(tmp_path / name))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: not UTF-8 text"):
        read_prompts_file(str(tmp_path / "latin1.txt"))


def test_cli_errors_are_one_line_with_the_path(tmp_path, capsys):
    def error_of(*argv) -> str:
        assert main(list(argv)) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err, err
        return err

    assert "Is a directory: " + str(tmp_path) in error_of("generate", "--prompts-file", str(tmp_path))
    assert "No such file or directory: " + str(tmp_path / "nope.txt") in error_of(
        "generate", "--prompts-file", str(tmp_path / "nope.txt"))
    (tmp_path / "two.jsonl").write_text('{"prompt": 5}\n{"prompt": 7}\n')
    assert "two.jsonl:1: 'prompt' must be" in error_of("generate", "--prompts-file", str(tmp_path / "two.jsonl"))
    (tmp_path / "empty.txt").write_text("")
    assert "holds no prompts" in error_of("generate", "--prompts-file", str(tmp_path / "empty.txt"))
    missing = tmp_path / "no" / "such" / "model"
    assert f"model path {missing} does not exist" in error_of("generate", "--model", str(missing), "x")
    (tmp_path / "file").write_text("")
    assert "cannot create the output directory" in error_of("convert", parity_path("tiny", "hf"),
                                                           str(tmp_path / "file" / "out"))
    assert "is not a directory" in error_of("convert", str(tmp_path / "nowhere"), str(tmp_path / "out"))


# --------------------------------------------------------------------------------------------- checkpoints

def _model_dir(tmp_path, edit_config=None, drop: str | None = None) -> str:
    """A loadable checkpoint folder: the tiny reference weights (optionally without one tensor), config, tokenizer."""
    from dijax.io.convert import Output, write_shard

    folder = tmp_path / "model"
    folder.mkdir()
    config = json.load(open(parity_path("tiny", "config.json")))
    if edit_config:
        edit_config(config["text_config"])
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(parity_path("tiny", "tokenizer.json"), folder / "tokenizer.json")
    weights = parity_path("tiny", "reference", "model.safetensors")
    if drop is None:
        shutil.copy(weights, folder / "model.safetensors")
    else:
        st = SafetensorsFile(weights)
        outs = [Output(n, st.header[n]["dtype"], tuple(st.header[n]["shape"]), len(st.get(n).tobytes()),
                       lambda n=n: st.get(n).tobytes()) for n in st.names() if n != drop]
        write_shard(str(folder / "model.safetensors"), outs)
    return str(folder)


@pytest.mark.parametrize("edit, drop, match", [
    (lambda c: c.update(vocab_size=c["vocab_size"] // 2), None,
     r"tensor 'embed.weight' \(bf16 tensor\) has shape \[512, 256\], expected \[256, 256\]"),
    (lambda c: c.update(hidden_size=512), None, r"has shape \[512, 256\], expected \[512, 512\]"),
    (None, "layers.4.attn.wq_b.scale", r"missing, e\.g\. \['layers\.4\.attn\.wq_b\.scale'\]"),
])
def test_model_checkpoints_are_checked_against_their_config(tmp_path, capsys, edit, drop, match):
    folder = _model_dir(tmp_path, edit, drop)
    assert main(["generate", "--model", folder, "x"]) == 2
    err = capsys.readouterr().err
    assert "does not match its config" in err and folder in err
    assert len(err.strip().splitlines()) == 1
    from dijax.io.loader import load
    from dijax.io.tensor_spec import CheckpointError

    with pytest.raises(CheckpointError, match=match):
        load(folder)


def test_config_errors_name_the_file(tmp_path, capsys):
    folder = _model_dir(tmp_path, lambda c: c.update(hidden_size=-1))
    config = os.path.join(folder, "config.json")
    assert main(["generate", "--model", folder, "x"]) == 2
    assert f"{config}: config field 'dim': must be a positive integer" in capsys.readouterr().err
    open(config, "w").write('{"text_config": ')
    assert main(["generate", "--model", folder, "x"]) == 2
    assert f"{config}: not a valid JSON config" in capsys.readouterr().err


def test_a_truncated_loadable_checkpoint_fails_before_reading(tmp_path):
    from dijax.io.loader import load

    folder = _model_dir(tmp_path)
    path = os.path.join(folder, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-100])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        load(folder)


def test_conversion_cache_is_keyed_on_content(tmp_path, capsys):
    from dijax.io.checkpoint import resolve_checkpoint
    from dijax.io.convert import ConversionError, MARKER

    hf = tmp_path / "hf"
    shutil.copytree(parity_path("tiny", "hf"), hf)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(parity_path("tiny", name), tmp_path / name)
    os.chmod(hf, 0o755)
    for f in hf.iterdir():
        os.chmod(f, 0o644)
    cache = str(tmp_path / "cache")
    first = resolve_checkpoint(str(hf), cache_dir=cache, progress=False)
    assert resolve_checkpoint(str(hf), cache_dir=cache, progress=False) == first
    assert json.load(open(os.path.join(first, MARKER)))["source_fingerprint"].startswith(os.path.basename(first))
    # the same content elsewhere reuses the conversion; a changed config does not
    moved = tmp_path / "moved"
    shutil.copytree(hf, moved / "hf")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tmp_path / name, moved / name)
    assert resolve_checkpoint(str(moved / "hf"), cache_dir=cache, progress=False) == first
    config = json.load(open(tmp_path / "config.json"))
    config["text_config"]["rms_norm_eps"] = 1e-5
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_checkpoint(str(hf), cache_dir=cache, progress=False) != first
    # a truncated shard (the index json untouched) is noticed: converting it again fails, naming the shard
    shard = hf / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(ConversionError, match=r"model-00002-of-00002\.safetensors is truncated"):
        resolve_checkpoint(str(hf), cache_dir=cache, progress=False)
    capsys.readouterr()


# ------------------------------------------------------------------------------------------------- convert

_SIGTERM_CHILD = """
import os, signal, sys, time
import dijax.io.convert as c
write = c.write_shard
def write_then_die(*args, **kwargs):
    write(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
c.write_shard = write_then_die
c.convert(sys.argv[1], sys.argv[2], max_shard_bytes=1 << 20, progress=False)
"""


def test_sigterm_during_convert_leaves_nothing_behind(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", _SIGTERM_CHILD, parity_path("tiny", "hf"), str(out)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 128 + signal.SIGTERM, run.stderr
    assert not out.exists() and not os.listdir(tmp_path)


def test_converted_files_get_ordinary_permissions(tmp_path):
    from dijax.io.convert import convert

    umask = os.umask(0o022)
    try:
        out = convert(parity_path("tiny", "hf"), str(tmp_path / "out"), progress=False)
    finally:
        os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o755
    for name in os.listdir(out):
        assert os.stat(os.path.join(out, name)).st_mode & 0o777 == 0o644, name
