"""``--config FILE``: settings for any pdserve command from YAML files.

A config file is a YAML mapping whose keys are the command's long flag
names, without the dashes::

    max-model-len: 4096
    decode: [dns:pdserve-decode:50071, 10.0.0.7:50071]   # a list becomes "a,b"
    enable-prefix-caching: false                         # --no-enable-prefix-caching
    disable-log-requests: true                           # a plain switch: true sets it

``--config`` may be given more than once: the files are merged in order, a
later file's key replacing an earlier one's (a Kubernetes ConfigMap's
shared file, then the role's own). Flags on the command line win over every
file. A key the command has no flag for is an error that names the file, so
a typo never passes silently; ``null`` leaves the flag at its default.

How: the merged settings become flags placed right after the command's
name, before the ones actually typed, and argparse does the rest (types,
choices and error messages are the flag's own; for a flag given twice the
later one counts). A list-valued flag (``action="append"``) set on the
command line replaces the file's values instead of adding to them.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

CONFIG_FLAG = "--config"


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the ``--config FILE`` flag (this module applies it)."""
    parser.add_argument(CONFIG_FLAG, action="append", default=[], metavar="FILE",
                        help="YAML file of settings keyed by long flag names (e.g. 'max-model-len: 4096'); "
                             "repeat to layer files (later ones win); flags on the command line win over files")


def read_yaml(path: str) -> Any:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{CONFIG_FLAG} {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{CONFIG_FLAG} {path}: not valid YAML ({exc})") from None


def with_config_files(parser: argparse.ArgumentParser, argv: list[str],
                      read: Callable[[str], Any] = read_yaml) -> list[str]:
    """``argv`` with the settings of its ``--config`` files inserted as flags
    after the (sub)command names. Raises ValueError naming the file and key
    for anything a file cannot set."""
    command, at = command_parser(parser, argv)
    options = command._option_string_actions
    typed = _typed_flags(argv[at:], options)
    files = [value for flag, value in typed if flag == CONFIG_FLAG]
    if not files:
        return argv
    settings: dict[str, tuple[str, Any]] = {}  # key -> (file, value); later files replace earlier ones
    for path in files:
        data = read(path)
        if data is None:
            continue
        if not isinstance(data, dict):
            raise ValueError(f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values, "
                             f"got {type(data).__name__}")
        for key, value in data.items():
            settings[_flag_name(key, path)] = (path, value)
    on_command_line = {flag for flag, _ in typed}
    name = command.prog.split(" ", 1)[-1]
    tokens: list[str] = []
    for key, (path, value) in settings.items():
        flag = "--" + key
        action = options.get(flag)
        if action is None or flag == CONFIG_FLAG or action.dest == "help":
            raise ValueError(f"{CONFIG_FLAG} {path}: unknown setting {key!r}: '{name}' has no {flag} flag")
        if isinstance(action, argparse._AppendAction) and action.dest in {options[f].dest for f in on_command_line}:
            continue  # the command line's list replaces the file's
        tokens += _as_flags(action, flag, value, path)
    return argv[:at] + tokens + argv[at:]


def command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser, int]:
    """The innermost subcommand's parser named by ``argv`` and the index just
    after its name (``pdserve bench serve ...`` -> the ``serve`` parser, 3)."""
    at = 0
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            return parser, at
        i = next((j for j in range(at, len(argv)) if not argv[j].startswith("-")), None)
        if i is None or argv[i] not in sub.choices:
            return parser, at  # argparse reports the missing or unknown command itself
        parser, at = sub.choices[argv[i]], i + 1


def _typed_flags(argv: list[str], options: dict[str, argparse.Action]) -> list[tuple[str, str]]:
    """(canonical flag, value or "") for each option typed in ``argv``, with
    argparse's unambiguous abbreviations resolved (``--conf x`` is --config)."""
    out = []
    for i, token in enumerate(argv):
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        text, eq, value = token.partition("=")
        matches = [text] if text in options else [o for o in options if o.startswith(text)]
        if len(matches) != 1:
            continue
        flag = max(options[matches[0]].option_strings, key=len)
        if flag == CONFIG_FLAG and not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        out.append((flag, value))
    return out


def _flag_name(key: Any, path: str) -> str:
    if not isinstance(key, str) or not key.strip("-"):
        raise ValueError(f"{CONFIG_FLAG} {path}: keys are flag names such as 'max-model-len', got {key!r}")
    return key.lstrip("-").replace("_", "-")


def _as_flags(action: argparse.Action, flag: str, value: Any, path: str) -> list[str]:
    """The command-line form of one setting."""
    if value is None:
        return []
    where = f"{CONFIG_FLAG} {path}: {flag[2:]}"
    if isinstance(action, argparse.BooleanOptionalAction):
        _expect_bool(value, where)
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        _expect_bool(value, where)
        return [flag] if value else []  # a switch named in the file with true is given
    if action.nargs == 0:
        raise ValueError(f"{where}: this flag cannot be set from a config file")
    if isinstance(value, dict):
        raise ValueError(f"{where}: expected a value or a list, got a mapping")
    if isinstance(action, argparse._AppendAction):
        return [f"{flag}={_text(v, where)}" for v in (value if isinstance(value, list) else [value])]
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        return [flag, *(_text(v, where) for v in (value if isinstance(value, list) else [value]))]
    if isinstance(value, list):
        return [f"{flag}={','.join(_text(v, where) for v in value)}"]
    return [f"{flag}={_text(value, where)}"]


def _expect_bool(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: expected true or false, got {value!r}")


def _text(value: Any, where: str) -> str:
    if isinstance(value, (dict, list)):
        raise ValueError(f"{where}: expected a plain value, got {value!r}")
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected a value, got {value!r} (this flag is not a switch)")
    return str(value)
