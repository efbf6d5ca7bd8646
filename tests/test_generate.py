"""`dijax generate` on the embedded tiny default: prints generations, rejects bad input with a clear message."""

from __future__ import annotations

import pytest

from dijax.cli.main import main

pytestmark = pytest.mark.cost(45)  # CI seconds, a scheduling hint (tests/conftest.py)


def test_generate_on_the_embedded_default(capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Copyright"}\n\n{"prompt": "{not a record, a prompt"}\n')
    assert main(["generate", "--max-tokens", "5", "--prompts-file", str(prompts), "--temperature", "0.8",
                 "--top-k", "20", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert "random weights" in captured.err
    assert captured.out.count("output: ") == 2 and "prompt: 'Copyright'" in captured.out
    assert main(["generate", "--max-tokens", "5", "--prompts-file", str(prompts), "--temperature", "0.8",
                 "--top-k", "20", "--seed", "3"]) == 0
    assert capsys.readouterr().out == captured.out  # same seed, same text


def test_generate_rejects_bad_sampling_parameters(capsys):
    assert main(["generate", "--top-p", "1.5", "x"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "--max-tokens", "0", "x"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "--temperature", "-1", "x"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_generate_rejects_an_empty_compile_cache_directory(capsys):
    assert main(["generate", "--compile-cache", "", "x"]) == 2
    assert "compile_cache_dir" in capsys.readouterr().err
