"""The layout docs are the tree itself, and neither drifts from it.

README's layout section has one line per room of daemon/, naming every module in it, so a reader finds
any concept from the README and the tree alike. docs/DESIGN.md §5 ("Every module, room by room") names
every module of protocol/, storage/, daemon/, gpupool/ and gpupool_submitit/ with one line saying what
it holds."""

from __future__ import annotations

import re

from tests.support.paths import ROOT

CODE_FOLDERS = ("protocol", "storage", "daemon", "gpupool", "gpupool_submitit", "hydra_plugins")


def readme_rooms() -> dict[str, set[str]]:
    """Each `daemon/...` line of README's layout block: the room, and the names it lists."""
    section = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    rooms = {}
    for line in section.splitlines():
        if m := re.match(r"(daemon/(?:\w+/)?)\s+(.*)", line):
            rooms[m.group(1)] = set(re.findall(r"\b\w+\b", m.group(2)))
    return rooms


def test_the_readme_names_every_room_and_every_module_in_it() -> None:
    rooms = readme_rooms()
    on_disk = {"daemon/"} | {
        f"daemon/{p.name}/" for p in (ROOT / "daemon").iterdir() if (p / "__init__.py").exists()
    }
    assert set(rooms) == on_disk
    for room, named in rooms.items():
        modules = {p.stem for p in (ROOT / room).glob("*.py") if p.stem != "__init__"}
        assert modules - named == set(), f"README's line for {room} does not name {sorted(modules - named)}"


def design_modules() -> set[str]:
    """Every module DESIGN.md §5's list names, as a path: each `#### `room/`` heading, then its
    `- `module`: what it holds` lines."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text.split("\n## 5. ", 1)[1].split("\n## ", 1)[0]
    heading = "\n### Every module, room by room\n"
    assert heading in section, "DESIGN.md §5 has no list of every module (### Every module, room by room)"
    listing = section.split(heading, 1)[1]
    named, room = set(), None
    for line in listing.splitlines():
        if m := re.match(r"#### `([\w/]+/)`", line):
            room = m.group(1)
        elif m := re.match(r"- `(\w+)`: \S", line):
            assert room is not None, f"DESIGN.md §5 names {m.group(1)} before any room"
            named.add(f"{room}{m.group(1)}.py")
    return named


def modules_on_disk() -> set[str]:
    """Every module of the code folders' packages (a folder with an __init__.py), at any depth."""
    return {
        p.relative_to(ROOT).as_posix()
        for folder in CODE_FOLDERS
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "__init__.py" and (p.parent / "__init__.py").exists()
    }


def test_design_names_every_module_and_no_other() -> None:
    """issue 46: DESIGN.md §5 had missed some 30 modules; now every module added, moved or removed
    must change its line there too, and a line for a module that is gone fails as well."""
    named, on_disk = design_modules(), modules_on_disk()
    assert sorted(on_disk - named) == [], "DESIGN.md §5's list does not name these modules"
    assert sorted(named - on_disk) == [], "DESIGN.md §5's list names modules that do not exist"
