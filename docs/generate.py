"""Writes the generated reference pages: docs/reference/cli.md from the command line's own definitions, and
docs/reference/configuration.md from the settings' declarations. A test holds the files equal to what this
renders, so the pages cannot drift from the code.

    python docs/generate.py          # rewrite both pages
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAGES = {"cli": HERE / "reference" / "cli.md", "configuration": HERE / "reference" / "configuration.md"}


def _cell(text: object) -> str:
    """A Markdown table cell: one line, pipes escaped, rich's escaped brackets shown as written."""
    return " ".join(str(text).replace("\\[", "[").replace("|", "\\|").split())


def _default(param) -> str:
    if param.required:
        return "required"
    if getattr(param, "is_flag", False):
        return "off"
    value = param.default
    if value is None or value == () or value == []:
        return ""
    return f"`{value}`"


def _click(command):
    """The click module `command`'s classes come from: click itself, or the copy a typer release vendors."""
    import importlib

    return importlib.import_module(next(c.__module__ for c in type(command).__mro__ if c.__name__ == "Command"))


def _command_section(name: str, command) -> list[str]:
    click = _click(command)
    lines = [f"## `{name}`", ""]
    doc = (command.help or "").replace("\\[", "[").strip()
    if doc:
        lines += [doc, ""]
    ctx = click.Context(command, info_name=name)
    lines += ["```text", " ".join(command.collect_usage_pieces(ctx)).join([f"{name} ", ""]).rstrip(), "```", ""]
    rows = []
    for p in command.params:
        if getattr(p, "hidden", False) or p.name == "help":
            continue
        if p.param_type_name == "argument":
            rows.append((f"`{p.name.upper()}`", _cell(getattr(p, "help", "") or ""), _default(p)))
        else:
            names = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
            rows.append((names, _cell(p.help or ""), _default(p)))
    if rows:
        lines += ["| argument or option | what | default |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
        lines.append("")
    return lines


def render_cli() -> str:
    import typer

    from embedfleet.cli import app

    root = typer.main.get_command(app)
    click = _click(root)
    out = ["# CLI reference", "",
           "Generated from the command line's own definitions (`python docs/generate.py`); every command also "
           "answers `--help`. With `--json`, stdout carries exactly one JSON document; errors a user can act on "
           "are one line on stderr with a non-zero exit code.", ""]

    def walk(prefix: str, group) -> None:
        ctx = click.Context(group, info_name=prefix)
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            full = f"{prefix} {name}"
            if hasattr(command, "list_commands"):
                out.extend([f"## `{full}`", "", (command.help or "").strip(), ""])
                walk(full, command)
            else:
                out.extend(_command_section(full, command))

    walk("embedfleet", root)
    return "\n".join(out).rstrip() + "\n"


def render_configuration() -> str:
    from embedfleet.settings import Settings

    out = ["# Configuration", "",
           "Every `EMBEDFLEET_*` variable, declared once in `embedfleet.settings.Settings` and generated from there "
           "(`python docs/generate.py`). A command reads them once, when it starts; a flag given on the command "
           "line wins over its variable. A launcher hands its settings to the workers it starts as an argument, "
           "never through their environment. A value that does not parse is a one-line error naming the variable.",
           "", "| variable | default | what |", "|---|---|---|"]
    for f in dataclasses.fields(Settings):
        shown = f.metadata.get("shown_default")
        if shown is None:
            value = int(f.default) if isinstance(f.default, bool) else f.default  # as the variable is written
            shown = "" if value is None else f"`{value}`"
        out.append(f"| `{f.metadata['env']}` | {_cell(shown)} | {_cell(f.metadata['doc'])} |")
    return "\n".join(out) + "\n"


def render() -> dict[str, str]:
    return {"cli": render_cli(), "configuration": render_configuration()}


if __name__ == "__main__":
    for key, text in render().items():
        PAGES[key].parent.mkdir(parents=True, exist_ok=True)
        PAGES[key].write_text(text)
        print(f"wrote {PAGES[key]}", file=sys.stderr)
