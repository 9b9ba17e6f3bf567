"""The tokens file: who the server accepts, and who of them is a pool admin. A bad file says what is
wrong with it and never prints a token."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.tokens import TokenError, read_users

TOKEN = "t0ken-of-sixteen-chars-or-more"


def tokens_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_users_and_admins(tmp_path: Path) -> None:
    users = read_users(
        tokens_file(tmp_path, f'alice = "{TOKEN}"\nroot = {{ token = "{TOKEN}x", admin = true }}\n')
    )
    assert users.tokens == {"alice": TOKEN.encode(), "root": (TOKEN + "x").encode()}
    assert users.admins == {"root"}
    assert users.max_priority == ()
    text = f'alice = {{ token = "{TOKEN}", max_priority = 10 }}\nbob = "{TOKEN}y"\n'
    assert read_users(tokens_file(tmp_path, text)).max_priority == (("alice", 10),)
    text = f'alice = {{ token = "{TOKEN}", fairshare_weight = 2.5 }}\nbob = "{TOKEN}y"\n'
    assert read_users(tokens_file(tmp_path, text)).weights == (("alice", 2.5),)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('alice = "short"', "16 or more characters"),
        (f'alice = {{ token = "{TOKEN}", admin = "yes" }}', "admin = true"),
        (f'alice = {{ token = "{TOKEN}", role = "admin" }}', "not a table of ['role', 'token']"),
        (f'alice = {{ token = "{TOKEN}", max_priority = 101 }}', "max_priority = 0..100"),
        (f'alice = {{ token = "{TOKEN}", max_priority = "high" }}', "max_priority = 0..100"),
        (f'alice = {{ token = "{TOKEN}", fairshare_weight = 0 }}', "fairshare_weight = a number above 0"),
        (f'alice = {{ token = "{TOKEN}", fairshare_weight = "x" }}', "fairshare_weight = a number above 0"),
        ("alice = { admin = true }", "16 or more characters"),
        ("alice = ", "not valid TOML"),
    ],
)
def test_a_bad_tokens_file_says_what_is_wrong_and_never_shows_a_token(
    tmp_path: Path, text: str, says: str
) -> None:
    with pytest.raises(TokenError) as err:
        read_users(tokens_file(tmp_path, text + "\n"))
    assert says in str(err.value)
    assert TOKEN not in str(err.value)


def test_a_tokens_file_others_can_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match="readable by others"):
        read_users(tokens_file(tmp_path, f'alice = "{TOKEN}"\n', mode=0o644))
