"""README's layout section is the tree itself: one line per room of daemon/, naming every module in it,
so a reader finds any concept from the README and the tree alike, and neither drifts."""

from __future__ import annotations

import re

from tests.support.paths import ROOT


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
