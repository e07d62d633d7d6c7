"""The ``chorus`` flag reference (``docs/cli.md``), rendered from the argument parser itself so that it
cannot drift from ``--help``.

Refresh it with ``python -m engine.cli_reference > docs/cli.md``;
``tests/unit/test_cli_reference.py`` fails while the committed file differs from what this renders.
"""

from __future__ import annotations

import argparse
import re
import sys

from engine.cli import build_parser

REFRESH_COMMAND = ".venv/bin/python -m engine.cli_reference > docs/cli.md"
"""The command that rewrites ``docs/cli.md``; the staleness test names it."""
_MARKDOWN_SPECIALS = re.compile(r"([\\`*_\[\]<>|])")
"""Characters that Markdown would read as markup in a help text, escaped with a backslash."""


def _escape(text: str) -> str:
    return _MARKDOWN_SPECIALS.sub(r"\\\1", " ".join(text.split()))


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the order ``chorus --help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def _flag_names(action: argparse.Action) -> str:
    """A flag's spellings as ``--help`` shows them (``--port PORT``; ``--quantization``, ``-q``: choices are
    listed apart), or a positional's metavar."""
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    metavar = action.metavar or action.dest.upper()
    suffix = {"?": f" [{metavar}]", "*": f" [{metavar} ...]", "+": f" {metavar} [{metavar} ...]"}.get(
        action.nargs, f" {metavar}")
    if action.choices is not None and action.metavar is None:
        suffix = ""
    return ", ".join(f"`{o}{suffix}`" for o in action.option_strings)


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None:
        return "unset"
    if isinstance(value, list):
        return " ".join(f"`{v}`" for v in value) or "empty"
    return f"`{value}`"


def _render_action(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    help_text = formatter._expand_help(action) if action.help else ""
    parts = [f"- {_flag_names(action)}:"]
    if help_text:
        text = _escape(help_text)
        parts.append(text if text.endswith((".", ")", "!", "?")) else text + ".")
    if action.required:
        parts.append("*Required.*")
    elif action.option_strings:
        parts.append(f"*Default:* {_default(action)}.")
    if action.choices is not None:
        parts.append("*Choices:* " + ", ".join(f"`{c}`" for c in action.choices) + ".")
    return " ".join(parts)


def _render_subcommand(name: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## `chorus {name}`", ""]
    description = parser.description or summary
    if description:
        lines += [_escape(description), ""]
    if parser.epilog:
        lines += [_escape(parser.epilog), ""]
    formatter = parser._get_formatter()
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        lines += [f"### {group.title[:1].upper()}{group.title[1:]}", ""]
        lines += [_render_action(a, formatter) for a in actions]
        lines.append("")
    return lines


def render_cli_reference() -> str:
    """The Markdown text of ``docs/cli.md``: every subcommand of ``chorus``, its flags grouped as the
    parser groups them, each with its help text, default and choices."""
    parser = build_parser()
    lines = [
        "# `chorus` flag reference",
        "",
        ("Generated from the argument parser (`engine/cli.py`, `engine/server/args.py`) by "
         f"`{REFRESH_COMMAND}`; do not edit by hand. `chorus <command> --help` prints the same text."),
        "",
    ]
    for name, summary, sub in _subcommands(parser):
        lines += _render_subcommand(name, summary, sub)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_cli_reference())
