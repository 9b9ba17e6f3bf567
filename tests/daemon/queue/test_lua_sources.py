"""scripts.source: each script holds the helpers of lua/lib/ it calls, each once, and no other."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from daemon.queue import scripts

LUA = resources.files("daemon.queue") / "lua"
# Comments and strings, which name helpers without calling them.
NOT_CODE = re.compile(r"--[^\n]*|'(?:\\.|[^'\\\n])*'|\"(?:\\.|[^\"\\\n])*\"")


def helpers() -> dict[str, str]:
    """Each top-level name lib/ defines, and the lib/ file that defines it."""
    out = {}
    for part in (LUA / "lib").iterdir():
        for name in re.findall(r"^local (?:function )?([A-Za-z_]\w*)", part.read_text(), re.M):
            out[name] = part.name
    return out


def called(text: str) -> set[str]:
    code = NOT_CODE.sub(" ", text)
    return set(re.findall(r"(?<![.:\w])([A-Za-z_]\w*)", code))


@pytest.mark.parametrize("name", scripts.NAMES)
def test_a_script_holds_each_helper_it_calls_once_and_no_other(name: str) -> None:
    """issue 46: a script carried every helper of lib/, and Redis builds all of a script's
    functions at every call; each now includes those it calls. One it calls but lacks would fail
    only where a call reaches it ('attempted to access nonexistent global variable')."""
    text = scripts.source(name)
    defined = helpers()
    needed = {defined[n] for n in called(text) if n in defined}
    for part in sorted({*defined.values()}):
        count = text.count(f"\n-- lib/{part}: ")  # each part's first line says its name
        assert count == (1 if part in needed else 0), f"{name}.lua holds lib/{part} {count} times"
