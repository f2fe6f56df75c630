"""A click group whose heavier subcommands are imported only when run, so `cbq submit` never imports torch."""

from __future__ import annotations

import importlib
import importlib.util

import click


class LazyGroup(click.Group):
    """`lazy_commands` maps a name to ("module:attribute", short help shown by --help without importing)."""

    def __init__(self, *args, lazy_commands: dict[str, tuple[str, str]] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands or {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy_commands])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_commands:
            return _load(name, self.lazy_commands[name][0])
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(name) for name in self.list_commands(ctx))
        rows = []
        for name in self.list_commands(ctx):
            if name in self.lazy_commands:
                rows.append((name, self.lazy_commands[name][1]))
            else:
                rows.append((name, super().get_command(ctx, name).get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _load(name: str, target: str) -> click.Command:
    module_name, _, attribute = target.partition(":")
    if importlib.util.find_spec(module_name) is None:
        return _unavailable(name, f"module {module_name} is not installed")
    command = getattr(importlib.import_module(module_name), attribute, None)
    if not isinstance(command, click.Command):
        return _unavailable(name, f"{module_name} has no click command {attribute!r}")
    return command


def _unavailable(name: str, why: str) -> click.Command:
    @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def unavailable():
        raise click.ClickException(f"`cbq {name}` is not available: {why}")

    return unavailable
