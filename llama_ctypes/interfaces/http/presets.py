"""llama-server's model presets (``--models-preset FILE.ini``): one INI section per model of the router.

The file, as llama.cpp's common/preset.cpp reads it::

    version = 1                      ; keys before any section: the "default" section (ignored when empty)

    [*]                              ; options of every model
    ctx-size = 4096

    [chat]                           ; a model named "chat"
    model = /models/qwen3-4b.gguf    ; or hf-repo = owner/name[:quant] (hf-file = ...)
    alias = gpt-4o-mini              ; more names, comma-separated
    load-on-startup = true           ; loaded when the server starts (default: on first use)
    temp = 0.7

A key is a command-line option without its dashes (long or short: ``ctx-size``, ``c``) or its llama-server
environment name (``LLAMA_ARG_CTX_SIZE``); a value is the rest of the line up to a ``;`` or ``#`` comment.
A flag takes ``true``/``false`` (``1``/``0``, ``on``/``off``, ...); a ``no-`` flag the same, meaning its
negation. Each section is read as ``serve``'s own command line: the ``[*]`` options first, then the
section's, then the options of the server's command line, which win (as llama-server overlays its own
arguments on every preset). ``stop-timeout`` and ``dedup-cache-models`` (llama-server's child-process and
Hub-cache settings) are accepted and have no effect here. A section named as a ``--models-dir`` model
adds to it (the folder's file stays the model unless the section names another).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from ...errors import ArgumentTypeError

#: The unnamed section (keys before the first header), as llama.cpp names it.
DEFAULT_SECTION = "default"
#: Preset-only keys: not command-line options.
LOAD_ON_STARTUP = "load-on-startup"
_IGNORED = frozenset({"version", "stop-timeout", "dedup-cache-models"})
_TRUE = frozenset({"1", "true", "on", "yes", "enabled"})
_FALSE = frozenset({"0", "false", "off", "no", "disabled"})
#: Options of the server's command line that never reach a preset's model: which model it is, and the router's.
_ROUTER_ONLY = frozenset({"model", "model_flag", "hub", "hf_repo", "hf_file", "alias", "tags", "mmproj", "config",
                          "models_dir", "models_preset", "models_max", "no_models_autoload", "func", "serve_parser"})

_HEADER = re.compile(r"^[ \t]*\[[ \t]*([^\]]*?)[ \t]*\][ \t]*(?:[;#].*)?$")
_PAIR = re.compile(r"^[ \t]*([A-Za-z_][A-Za-z0-9_.-]*)[ \t]*=[ \t]*(.*?)[ \t]*(?:[;#].*)?$")
_BLANK = re.compile(r"^[ \t]*(?:[;#].*)?$")
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


def read_ini(path: Path) -> dict[str, dict[str, str]]:
    """The sections of a preset file, in order: {name: {key: value}} (ArgumentTypeError naming the line)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ArgumentTypeError(f"--models-preset {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ArgumentTypeError(f"--models-preset {path}: not UTF-8 text") from None
    sections: dict[str, dict[str, str]] = {DEFAULT_SECTION: {}}
    current = DEFAULT_SECTION
    for number, line in enumerate(text.splitlines(), 1):
        header = _HEADER.match(line)
        if header is not None:
            current = _canonical(header.group(1))
            sections[current] = {}  # (a section named twice starts over, as llama.cpp's reader does)
            continue
        pair = _PAIR.match(line)
        if pair is not None:
            sections[current][pair.group(1)] = pair.group(2)
        elif not _BLANK.match(line):
            raise ArgumentTypeError(f"--models-preset {path}, line {number}: expected [section], key = value, "
                                    f"a ; or # comment, or a blank line: {line.strip()[:80]!r}")
    if not set(sections[DEFAULT_SECTION]) - _IGNORED:  # (version = 1 up there is fine, as in llama.cpp)
        del sections[DEFAULT_SECTION]
    return sections


def _canonical(name: str) -> str:
    """A section name as llama.cpp keys it: the quantization tag of ``owner/name:tag`` in capitals."""
    if name in ("*", DEFAULT_SECTION) or ":" not in name:
        return name
    head, _, tag = name.rpartition(":")
    match = _TAG.search(tag)
    return f"{head}:{(match.group(1) if match else tag).upper()}"


def _option(parser: argparse.ArgumentParser, key: str) -> tuple[str, argparse.Action]:
    """The command-line option a preset key names (``ctx-size``, ``c``, ``LLAMA_ARG_CTX_SIZE``)."""
    names = [f"--{key}", f"-{key}"]
    if key.startswith("LLAMA_ARG_"):
        names.insert(0, "--" + key[len("LLAMA_ARG_"):].lower().replace("_", "-"))
    names.append(f"--{key.replace('_', '-')}")
    for name in names:
        action = parser._option_string_actions.get(name)
        if action is not None and name not in ("-h", "--help"):
            return name, action
    raise ArgumentTypeError(f"option {key!r} is not an option of llama-ctypes serve")


def section_argv(parser: argparse.ArgumentParser, options: Mapping[str, str], where: str) -> list[str]:
    """A section's options as ``serve``'s command line (its preset-only keys left out)."""
    argv: list[str] = []
    for key, value in options.items():
        if key in _IGNORED or key == LOAD_ON_STARTUP:
            continue
        try:
            name, action = _option(parser, key)
        except ArgumentTypeError as exc:
            raise ArgumentTypeError(f"{where}: {exc}") from None
        if action.nargs == 0:  # (a flag: true sets it; false leaves it unset, as llama.cpp skips it)
            flag = value.strip().lower()
            if flag not in _TRUE | _FALSE:
                raise ArgumentTypeError(f"{where}: {key} = {value!r}: expected true or false")
            if flag in _TRUE:
                argv.append(name)
            continue
        argv += [name, *value.split()] if isinstance(action.nargs, int) and action.nargs > 1 else [name, value]
    return argv


def is_true(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _TRUE


def preset_specs(path: Path | None, args: argparse.Namespace, parser: argparse.ArgumentParser,
                 model_specs: Callable[[argparse.Namespace], tuple[Any, list[dict[str, Any]]]],
                 dir_models: Mapping[str, str]) -> list[dict[str, Any]]:
    """One model spec per ``--models-dir`` model (``dir_models``: id → file) and per section of the preset
    file, each made by ``model_specs`` from the section read as a command line (see the module's docstring)."""
    sections = read_ini(path) if path is not None else {}
    if DEFAULT_SECTION in sections:
        raise ArgumentTypeError(f"--models-preset {path}: options before the first [section] (only version = ... "
                                "may come there; [*] holds the options of every model)")
    common = section_argv(parser, sections.pop("*", {}), f"--models-preset {path}, [*]")
    given = {dest: value for dest, value in vars(args).items()
             if dest not in _ROUTER_ONLY and value != parser.get_default(dest)}
    out = []
    for name in [*dir_models, *(n for n in sections if n not in dir_models)]:
        options = sections.get(name, {})
        where = f"--models-preset {path}, [{name}]" if name in sections else f"--models-dir model {name!r}"
        argv = section_argv(parser, options, where)
        if name in dir_models and not any(_option(parser, k)[1].dest in ("model", "model_flag", "hf_repo", "hub")
                                          for k in options if k not in _IGNORED and k != LOAD_ON_STARTUP):
            argv = ["--model", dir_models[name], *argv]  # (the folder's file, with the section's options)
        try:
            section = parser.parse_args(common + argv)
        except SystemExit:  # (argparse printed why)
            raise ArgumentTypeError(f"{where}: its options are not a valid command line") from None
        for dest, value in given.items():
            setattr(section, dest, value)
        if not (section.model_flag or section.model or section.hf_repo or section.hub):
            raise ArgumentTypeError(f"{where}: no model (model = FILE.gguf or hf-repo = OWNER/NAME[:QUANT])")
        section.config = section.models_dir = section.models_preset = None
        _, (spec,) = model_specs(section)
        aliases = [a for a in spec.get("aliases", ()) if a != name]
        spec.update(id=name, load=is_true(options.get(LOAD_ON_STARTUP)))
        spec.pop("aliases", None)
        if aliases:
            spec["aliases"] = aliases
        out.append(spec)
    return out
