"""`dijax generate` on the embedded tiny default: prints generations, rejects bad input with a clear message."""

from __future__ import annotations

import argparse

import pytest

from dijax.cli import generate
from dijax.cli.main import main

pytestmark = pytest.mark.cost(35)  # CI seconds, a scheduling hint (tests/conftest.py)


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


def _compile_cache_of(*argv: str):
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(list(argv)).compile_cache


def test_generate_keeps_its_compiled_steps_in_dijax_cache_unless_told_not_to(monkeypatch, tmp_path):
    """Default: ``compile`` in ``$DIJAX_CACHE``; ``--no-compile-cache`` keeps nothing; a JAX cache directory in the
    environment is left to JAX; the two options exclude each other."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("DIJAX_CACHE", str(tmp_path))
    assert _compile_cache_of() == str(tmp_path / "compile")
    assert _compile_cache_of("--compile-cache", "elsewhere") == "elsewhere"
    assert _compile_cache_of("--no-compile-cache") is None
    with pytest.raises(SystemExit):
        _compile_cache_of("--no-compile-cache", "--compile-cache", "elsewhere")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert _compile_cache_of() is None
