"""``--config FILE`` on every pdserve command: keys are long flag names,
later files win over earlier ones, the command line wins over every file,
and anything a file cannot set is an error naming the file and the key."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from pdserve.cli import BENCH, SUBCOMMANDS, build_parser, main
from pdserve.cli.config_file import with_config_files


def _write(tmp_path: Path, name: str, settings) -> str:
    path = tmp_path / name
    path.write_text(settings if isinstance(settings, str) else yaml.safe_dump(settings))
    return str(path)


def _parse(argv: list[str]) -> argparse.Namespace:
    command = argv[0] if argv[0] != "bench" else "bench"
    only_bench = argv[1] if command == "bench" else None
    parser = build_parser(command, only_bench)
    return parser.parse_args(with_config_files(parser, argv))


def _subparser(argv: list[str]) -> argparse.ArgumentParser:
    parser = build_parser(argv[0], argv[1] if argv[0] == "bench" else None)
    for name in argv:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
        if not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            return parser
    return parser


def _some_setting(parser: argparse.ArgumentParser) -> tuple[str, object]:
    """A flag of ``parser`` that takes one value, and a valid value for it
    that differs from its default."""
    for action in parser._actions:
        flag = max(action.option_strings, key=len, default="")
        if not flag.startswith("--") or flag == "--config" or action.nargs is not None:
            continue
        if type(action) is not argparse._StoreAction:
            continue
        if action.choices:
            return flag[2:], next(c for c in action.choices if c != action.default)
        if action.type is int:
            return flag[2:], (action.default or 0) + 7
        if action.type is float:
            return flag[2:], (action.default or 0.0) + 0.25
        if action.type is None and action.default in (None, ""):
            return flag[2:], "from-config"
    raise AssertionError(f"no settable flag in {parser.prog}")


COMMANDS = [[name] for name in SUBCOMMANDS] + [["bench", name] for name in BENCH]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_reads_config_files(tmp_path, command):
    key, value = _some_setting(_subparser(command))
    path = _write(tmp_path, "c.yaml", {key: value})
    args = _parse([*command, "--config", path])
    assert getattr(args, key.replace("-", "_")) == value
    assert args.config == [path]


def test_later_files_win_and_the_command_line_wins_over_all(tmp_path):
    shared = _write(tmp_path, "shared.yaml", {"max-model-len": 1024, "http-port": 9000, "redis-url": "redis://r:1/0"})
    mine = _write(tmp_path, "gateway.yaml", {"http-port": 9100, "decode": "d:1"})
    args = _parse(["gateway", "--config", shared, f"--config={mine}", "--max-model-len", "2048"])
    assert (args.max_model_len, args.http_port, args.redis_url, args.decode) == (2048, 9100, "redis://r:1/0", "d:1")
    # The flag order on the command line does not matter: typed flags always win.
    args = _parse(["gateway", "--max-model-len", "2048", "--config", shared])
    assert args.max_model_len == 2048
    # argparse's abbreviation of --config counts too.
    assert _parse(["gateway", "--conf", mine]).http_port == 9100
    # No file: the defaults.
    assert _parse(["gateway"]).http_port == 8000


def test_switches_lists_and_nulls(tmp_path):
    engine = _write(tmp_path, "engine.yaml", {"enable-prefix-caching": False, "enforce-eager": True,
                                              "max-num-seqs": None, "kv-cache-memory": "64MiB"})
    args = _parse(["decode", "--config", engine])
    assert args.enable_prefix_caching is False and args.enforce_eager is True
    assert args.max_num_seqs == _parse(["decode"]).max_num_seqs  # null: the default
    assert args.kv_cache_memory == "64MiB"
    assert _parse(["decode", "--config", engine, "--enable-prefix-caching"]).enable_prefix_caching is True
    gateway = _write(tmp_path, "gateway.yaml", {"decode": ["dns:decode.svc:50071", "10.0.0.7:50071"],
                                                "disable-log-requests": True})
    args = _parse(["gateway", "--config", gateway])
    assert args.decode == "dns:decode.svc:50071,10.0.0.7:50071" and args.disable_log_requests is True
    off = _write(tmp_path, "off.yaml", {"disable-log-requests": False})
    assert _parse(["gateway", "--config", gateway, "--config", off]).disable_log_requests is False
    # Underscores and leading dashes in keys name the same flag.
    assert _parse(["gateway", "--config", _write(tmp_path, "u.yaml", {"max_model_len": 64})]).max_model_len == 64


@pytest.mark.parametrize("content, fragment", [
    ({"http-port": 1}, "unknown setting 'http-port': 'prefill' has no --http-port flag"),
    ({"config": "other.yaml"}, "unknown setting 'config'"),
    ({"help": True}, "unknown setting 'help'"),
    ("- a\n- b\n", "expected a mapping"),
    ("max-model-len: [1\n", "not valid YAML"),
    ({"enable-prefix-caching": "no"}, "enable-prefix-caching: expected true or false"),
    ({"max-model-len": True}, "max-model-len: expected a value"),
    ({"max-model-len": {"a": 1}}, "expected a value or a list"),
])
def test_what_a_file_cannot_set_is_an_error_naming_it(tmp_path, content, fragment):
    path = _write(tmp_path, "bad.yaml", content)
    with pytest.raises(ValueError, match="bad.yaml") as e:
        _parse(["prefill", "--config", path])
    assert fragment in str(e.value)


def test_the_cli_reports_config_errors_like_flag_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["prefill", "--config", str(tmp_path / "missing.yaml")])
    assert e.value.code == 2
    assert "missing.yaml: cannot read it" in capsys.readouterr().err
    # A value of the wrong type is argparse's own error, naming the flag.
    bad = _write(tmp_path, "bad.yaml", {"max-model-len": "long"})
    with pytest.raises(SystemExit) as e:
        main(["prefill", "--config", bad])
    assert e.value.code == 2 and "--max-model-len: invalid int value: 'long'" in capsys.readouterr().err
