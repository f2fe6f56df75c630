"""Click groups whose heavier subcommands are imported only when used, so `cbq submit` never imports torch.

Owns command discovery. `LazyGroup` takes subcommands as import strings ("module:attribute"). `PluginGroup`,
the `cbq` root, finds them through the `cbq.commands` entry points (pyproject.toml's
`[project.entry-points."cbq.commands"]` table), so the producer names no module of the packages that
plug in: they import the producer, never the reverse.
"""

from __future__ import annotations

import importlib
from functools import cached_property
from importlib.metadata import entry_points

import click

ENTRY_POINT_GROUP = "cbq.commands"


class LazyGroup(click.Group):
    """`lazy_commands` maps a subcommand name to "module:attribute", imported when the subcommand runs (or when
    --help lists it, for its help line)."""

    def __init__(self, *args, lazy_commands: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._given_lazy_commands = dict(lazy_commands or {})

    @property
    def lazy_commands(self) -> dict[str, str]:
        return self._given_lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None and name in self.lazy_commands:
            command = _load(name, self.lazy_commands[name])
        return command


class PluginGroup(LazyGroup):
    """A LazyGroup that also mounts every command registered under the `cbq.commands` entry point group."""

    @cached_property
    def lazy_commands(self) -> dict[str, str]:
        found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
        return {**found, **self._given_lazy_commands}

    def resolve_command(self, ctx: click.Context, args: list[str]):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            if self.lazy_commands:
                raise
            raise click.UsageError(
                f"{exc.message} No {ENTRY_POINT_GROUP!r} entry points are registered: install cbq "
                "(`pip install -e .`) so the commands of pyproject.toml's entry-point table are found.",
                ctx,
            ) from None


def _load(name: str, target: str) -> click.Command:
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return _unavailable(name, f"importing {module_name} failed: {exc}")
    command = getattr(module, attribute, None)
    if not isinstance(command, click.Command):
        return _unavailable(name, f"{module_name} has no click command {attribute!r}")
    return command


def _unavailable(name: str, why: str) -> click.Command:
    @click.command(
        name,
        help=f"(unavailable: {why})",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    )
    def unavailable():
        raise click.ClickException(f"`{name}` is not available: {why}")

    return unavailable
