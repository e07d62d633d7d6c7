"""``docs/cli.md`` is the parser's own account of every ``chorus`` flag: it must equal what
``engine/cli_reference.py`` renders now, and that rendering must name every flag."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.cli import build_parser
from engine.cli_reference import REFRESH_COMMAND, render_cli_reference

CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_docs_cli_md_is_current():
    assert CLI_DOC.exists(), f"docs/cli.md is missing; write it with `{REFRESH_COMMAND}`."
    assert CLI_DOC.read_text() == render_cli_reference(), (
        f"docs/cli.md is stale: a flag, help text, default or choice changed; refresh it with `{REFRESH_COMMAND}`.")


def test_every_flag_of_every_subcommand_is_rendered():
    text = render_cli_reference()
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, parser in subcommands.choices.items():
        assert f"## `chorus {name}`" in text
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            names = action.option_strings or [action.metavar or action.dest]
            missing += [f"chorus {name} {n}" for n in names if f"`{n}" not in text]
            if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
                missing += [f"chorus {name} {names[0]} choice {c}" for c in action.choices if f"`{c}`" not in text]
    assert missing == []


def test_groups_follow_the_parser():
    text = render_cli_reference()
    for title in ("HTTP server", "Engine", "LoRA", "Images (vision models: LLaVA, Qwen2-VL, Qwen2.5-VL)"):
        assert f"### {title}\n" in text
    serve = text.index("## `chorus serve`")
    assert serve < text.index("### HTTP server") < text.index("`--port PORT`") < text.index("### Engine")
    assert "*Default:* `8000`." in text
