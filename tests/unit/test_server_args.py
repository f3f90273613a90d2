"""The server's settings in parts: flat settings reach the part that holds them, the command line and
``ServerArgs.of`` build the same settings, ``--cache-dir`` is one setting, and ``--help`` groups the flags by part."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.server_args import PARTS, GrammarArgs, ModelArgs, ServerArgs, parse_server_args


def test_flat_settings_reach_their_parts() -> None:
    args = ServerArgs.of(
        max_seq_len=256, grammar_backend="llguidance", speculative_num_draft_tokens=4, port=30000, dp_size=2
    )
    assert args.model.max_seq_len == 256
    assert args.grammar.grammar_backend == "llguidance"
    assert args.speculation.speculative_num_draft_tokens == 4
    assert args.serving.port == 30000
    assert args.parallel.dp_size == 2
    assert args.settings()["max_seq_len"] == 256, "/get_server_info reports every setting by its flat name"


def test_an_unknown_setting_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="'max_seq_length'"):
        ServerArgs.of(max_seq_length=256)


def test_the_command_line_builds_what_of_builds() -> None:
    argv = [
        "--max-seq-len=256",
        "--grammar-backend-order",
        "llguidance, outlines",
        "--no-grammar-auto-allow-narrowing",
        "--disable-radix-cache",
        "--import-module",
        "json",
        "--router",
        "sglang",
        "--port",
        "30000",
        "--zmq-port",
        "30011",
        "--worker-urls",
        "http://a:1",
        "http://b:2",
    ]
    assert parse_server_args(argv) == ServerArgs.of(
        max_seq_len=256,
        grammar_backend_order=("llguidance", "outlines"),
        grammar_auto_allow_narrowing=False,
        disable_radix_cache=True,
        import_modules=("json",),
        router="sglang",
        port=30000,
        zmq_port=30011,
        worker_urls=("http://a:1", "http://b:2"),
    )


def test_one_cache_dir_holds_the_models_files_and_the_grammars(tmp_path: Path) -> None:
    args = parse_server_args(["--cache-dir", str(tmp_path)])
    assert args.model.kernel_build_path == tmp_path / "kernels"
    assert args.grammar.vocabulary_cache_path == tmp_path / "vocabularies"
    assert args.grammar.grammar_disk_cache_path == tmp_path / "grammars"
    with pytest.raises(ValueError, match="--cache-dir is one setting"):
        ServerArgs(model=ModelArgs(cache_dir=str(tmp_path)), grammar=GrammarArgs())


def test_help_shows_each_flag_once_in_its_parts_group(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_server_args(["--help"])
    _, _, groups = capsys.readouterr().out.partition("\noptions:\n")
    assert [line for line in groups.splitlines() if line.endswith(":") and not line.startswith(" ")] == [
        f"{part}:" for part in PARTS
    ]
    model_group = groups.split("\nmodel:\n")[1].split("\ngrammar:\n")[0]
    assert "--model-runner" in model_group and "--cache-dir" in model_group
    assert groups.count("--cache-dir CACHE_DIR") == 1
