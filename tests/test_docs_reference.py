"""docs/configuration.md's settings table and docs/cli.md's flags are generated from the
code (docs/refgen.py): they must match quack.settings.FIELDS / Settings and the typer
app's --help, so a new setting or flag cannot be left undocumented."""

from __future__ import annotations

import importlib.util

import pytest
from reliability_support import ROOT


def _refgen():
    spec = importlib.util.spec_from_file_location("refgen", ROOT / "docs" / "refgen.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", ["docs/configuration.md", "docs/cli.md"])
def test_generated_reference_is_current(path):
    refgen = _refgen()
    old, new = refgen.render(path)
    if path == "docs/cli.md" and refgen.rendered_typer(old) != refgen.typer_version():
        # Another typer lays out --help differently (seen on the GPU machine's typer):
        # that is not a stale document. CI installs the same typer the docs were made with.
        pytest.skip(
            f"docs/cli.md was rendered with typer {refgen.rendered_typer(old)}, this is {refgen.typer_version()}"
        )
    assert old == new, f"{path} is stale: run `python docs/refgen.py` and commit the result"


def test_every_setting_is_in_the_configuration_table():
    from quack.settings.fields import FIELDS

    text = (ROOT / "docs" / "configuration.md").read_text()
    for name, f in FIELDS.items():
        assert f"| `{name}` |" in text, name
        assert f"`[{f.section}] {f.key}`" in text, name
        for var in f.env:
            assert f"`{var}`" in text, (name, var)


def test_a_setting_without_a_meaning_stops_the_generator(monkeypatch):
    from quack.settings import fields

    refgen = _refgen()
    monkeypatch.setitem(fields.FIELDS, "new_setting", fields.Field("cache", "new", (), str, "text"))
    with pytest.raises(SystemExit, match="missing \\['new_setting'\\]"):
        refgen.settings_table()


def test_every_command_is_in_the_cli_reference():
    text = (ROOT / "docs" / "cli.md").read_text()
    for cmd in (
        "build",
        "verify",
        "prewarm",
        "keygen",
        "bundle",
        "bundle inspect",
        "cache stats",
        "cache clean",
        "cache pull",
        "cache push",
    ):
        assert f"### `quack {cmd}`" in text, cmd
