"""Several pools by name (daemon/pools.py): pools.toml, `poolctl --pool`, GPUPOOL_POOL, and the
local pool registering itself. Which pool is chosen is a table over real files; using one is
poolctl run against real servers, one of them over TLS with its certificate pinned in the file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from daemon import pools
from daemon.pools import LOCAL, Pool, PoolsError, choose, register_local
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.server.certificate import certificate_fingerprint
from tests.daemon.test_poold import redis_pid
from tests.support.paths import ROOT
from tests.support.pool import Pool as RunningPool
from tests.support.pool import running_pool
from tests.support.poolctl import poolctl
from tests.support.workers import JOBS_AS_ROOT

LAB = """\
# my pools
default = "lab"

[pools.lab]  # the GPU servers
server = "gpu-head:7420"
token_file = "~/lab.token"
user = "alice2"
tls_pin = "SHA256:abc"

[pools.cloud]
server = "10.0.0.9:7420"
"""


def env_with(tmp_path: Path, text: str | None, **values: str) -> dict[str, str]:
    xdg = tmp_path / "xdg"
    if text is not None:
        (xdg / "gpupool").mkdir(parents=True, exist_ok=True)
        (xdg / "gpupool" / "pools.toml").write_text(text)
    return {"XDG_CONFIG_HOME": str(xdg), "HOME": str(tmp_path), **values}


@pytest.mark.parametrize(
    ("flags", "values", "text", "server"),
    [
        (("a:1", None), {"GPUPOOL_SERVER": "b:2", "GPUPOOL_POOL": "cloud"}, LAB, "a:1"),
        ((None, "cloud"), {"GPUPOOL_SERVER": "b:2"}, LAB, "10.0.0.9:7420"),
        ((None, None), {"GPUPOOL_SERVER": "b:2", "GPUPOOL_POOL": "cloud"}, LAB, "b:2"),
        ((None, None), {"GPUPOOL_POOL": "cloud"}, LAB, "10.0.0.9:7420"),
        ((None, None), {}, LAB, "gpu-head:7420"),  # the file's default
        ((None, None), {}, '[pools.local]\nserver = "127.0.0.1:9"\n', "127.0.0.1:9"),
        ((None, None), {}, None, "127.0.0.1:7420"),  # no file at all
        ((None, None), {}, '[pools.cloud]\nserver = "x:1"\n', "127.0.0.1:7420"),  # none is the default
    ],
)
def test_which_pool_a_command_talks_to(
    tmp_path: Path,
    flags: tuple[str | None, str | None],
    values: dict[str, str],
    text: str | None,
    server: str,
) -> None:
    assert choose(*flags, env_with(tmp_path, text, **values)).server == server


def test_a_named_pool_brings_its_token_file_user_and_pin(tmp_path: Path) -> None:
    assert choose(None, "lab", env_with(tmp_path, LAB)) == Pool(
        server="gpu-head:7420",
        name="lab",
        token_file=os.path.expanduser("~/lab.token"),
        user="alice2",
        tls_pin="SHA256:abc",
    )


@pytest.mark.parametrize(
    ("flags", "text", "message"),
    [
        (("a:1", "lab"), LAB, "--server a:1 and --pool lab each name a pool: give one of them"),
        ((None, "nope"), LAB, "no pool 'nope' (--pool) in {path}; the pools there: cloud, lab. "),
        ((None, "nope"), None, "no pool 'nope' (--pool) in {path}; the pools there: none yet."),
        ((None, None), 'default = "gone"\n', "no pool 'gone' ({path}'s default) in {path}"),
        ((None, None), "[pools.lab\n", "{path} is not valid TOML: "),
        (
            (None, "x"),
            '[pools.x]\nserver = "a:1"\ntsl_pin = "y"\n',
            "[pools.x] has no key 'tsl_pin'; its keys",
        ),
        ((None, "x"), "[pools.x]\nserver = 7420\n", "[pools.x] server must be a non-empty string"),
        ((None, "x"), '[pools.x]\nuser = "a"\n', '[pools.x] needs server = "HOST:PORT"'),
        ((None, None), "default = 3\n", "default must be a pool's name"),
    ],
)
def test_a_mistake_in_choosing_or_in_the_file_is_one_sentence(
    tmp_path: Path, flags: tuple[str | None, str | None], text: str | None, message: str
) -> None:
    env = env_with(tmp_path, text)
    with pytest.raises(PoolsError) as caught:
        choose(*flags, env)
    assert message.format(path=pools.pools_file(env)) in str(caught.value)


def test_the_local_pool_registers_itself_and_keeps_the_rest_of_the_file(tmp_path: Path) -> None:
    env = env_with(tmp_path, LAB)
    path = pools.pools_file(env)
    register_local("127.0.0.1:7420", tmp_path / "token", env=env)
    text = path.read_text()
    assert text.startswith(LAB)  # comments, order and every other pool as the user wrote them
    assert choose(None, "local", env) == Pool("127.0.0.1:7420", LOCAL, str(tmp_path / "token"))
    assert path.stat().st_mode & 0o777 == 0o600

    inode = path.stat().st_ino
    register_local("127.0.0.1:7420", tmp_path / "token", env=env)  # unchanged: not rewritten
    assert path.stat().st_ino == inode
    fresh = env_with(tmp_path / "fresh", None)
    assert register_local("127.0.0.1:1", tmp_path / "token", env=fresh) == (
        f"registered as pool 'local' in {pools.pools_file(fresh)}"
    )
    assert choose(None, None, fresh).server == "127.0.0.1:1"  # no file before: local is the default
    # restarted on another port, now with TLS: nothing answers at the old address, so it is taken
    said = register_local("127.0.0.1:9", tmp_path / "token", "SHA256:ff", env=fresh)
    assert "'local' in" in said
    assert "was registered at 127.0.0.1:1, which runs no more" in said
    assert choose(None, "local", fresh) == Pool(
        "127.0.0.1:9", LOCAL, str(tmp_path / "token"), tls_pin="SHA256:ff"
    )
    assert pools.pools_file(fresh).read_text().count("[pools.local]") == 1
    # its user renamed it (and gave a key of theirs): it keeps that name, and their key
    renamed = pools.pools_file(fresh).read_text().replace("[pools.local]", '[pools.mine]\nuser = "al"')
    pools.pools_file(fresh).write_text(renamed)
    said = register_local("127.0.0.1:9", tmp_path / "token", env=fresh)  # and no longer TLS
    assert said == f"registered as pool 'mine' in {pools.pools_file(fresh)}"
    assert choose(None, "mine", fresh) == Pool("127.0.0.1:9", "mine", str(tmp_path / "token"), "al")
    assert "[pools.local]" not in pools.pools_file(fresh).read_text()

    broken = env_with(tmp_path / "broken", "[pools\n")
    with pytest.raises(PoolsError, match="could not register this pool in"):
        register_local("127.0.0.1:1", tmp_path / "token", env=broken)
    assert pools.pools_file(broken).read_text() == "[pools\n"  # a file it cannot read is left alone
    not_tables = env_with(tmp_path / "not_tables", "pools = 3\n")
    with pytest.raises(PoolsError, match=r"its pools must be \[pools.NAME\] tables"):
        register_local("127.0.0.1:1", tmp_path / "token", env=not_tables)


def pool_env(pool: RunningPool, **extra: str) -> dict[str, str]:
    """A user with pools.toml alone: no GPUPOOL_SERVER, no GPUPOOL_TOKEN, no default token."""
    env = pool.env("alice", **extra)
    del env["GPUPOOL_SERVER"], env["GPUPOOL_TOKEN"]
    return env


def write_pools(env: dict[str, str], text: str) -> None:
    path = Path(env["XDG_CONFIG_HOME"]) / "gpupool" / "pools.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


async def test_poolctl_reaches_a_pool_by_name_with_its_own_token(pool: RunningPool, tmp_path: Path) -> None:
    env = pool_env(pool)
    token = tmp_path / "lab.token"
    token.write_text(pool.tokens["alice"] + "\n")
    token.chmod(0o600)
    wrong = tmp_path / "wrong.token"
    wrong.write_text(pool.tokens["bob"])
    wrong.chmod(0o600)
    write_pools(
        env,
        f'[pools.lab]\nserver = "{pool.address}"\ntoken_file = "{token}"\n'
        f'[pools.other]\nserver = "{pool.address}"\ntoken_file = "{wrong}"\n'
        f'[pools.down]\nserver = "127.0.0.1:9"\ntoken_file = "{token}"\n'
        f'[pools.lost]\nserver = "{pool.address}"\ntoken_file = "{tmp_path / "nothing"}"\n',
    )
    code, out, err = await poolctl(env, "--pool", "lab", "enqueue", "--", "true")
    assert code == 0, err
    job_id = out.strip()
    code, out, _ = await poolctl({**env, "GPUPOOL_POOL": "lab"}, "ls", "--format", "id,user", "--no-header")
    assert (code, out.split()) == (0, [job_id, "alice"])

    # bob's token, presented as alice (the login given by GPUPOOL_USER): refused
    code, _, err = await poolctl(env, "--pool", "other", "ls")
    assert code == 4
    assert "refused user 'alice'" in err
    code, _, err = await poolctl(env, "--pool", "down", "ls")
    assert code == 3
    assert "127.0.0.1:9" in err
    code, _, err = await poolctl(env, "--pool", "lost", "ls")
    assert code == 4
    assert f"{tmp_path / 'nothing'}, this pool's token_file in pools.toml, does not exist" in err
    code, _, err = await poolctl(env, "--pool", "nope", "ls")
    assert code == 2
    assert "no pool 'nope' (--pool)" in err
    assert "the pools there: down, lab, lost, other" in err
    wrong.chmod(0o644)
    code, _, err = await poolctl(env, "--pool", "other", "ls")
    assert code == 4
    assert "readable by others" in err


async def test_a_pinned_tls_pool_is_trusted_by_its_pin_alone(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with running_pool(redis_server, tmp_path, tls="on") as pool:
        env = pool_env(pool)
        token = tmp_path / "lab.token"
        token.write_text(pool.tokens["alice"])
        token.chmod(0o600)
        pin = certificate_fingerprint(tmp_path / "data" / "tls" / "cert.pem")
        known = Path(env["XDG_CONFIG_HOME"]) / "gpupool" / "known_servers"
        entry = f'server = "{pool.address}"\ntoken_file = "{token}"\n'
        write_pools(
            env,
            f'[pools.lab]\n{entry}tls_pin = "{pin}"\n[pools.evil]\n{entry}tls_pin = "SHA256:{"0" * 64}"\n',
        )
        code, _, err = await poolctl(env, "--pool", "lab", "ls")
        assert code == 0, err
        assert not known.exists()  # the pin is the file's; nothing learnt on first use
        code, _, err = await poolctl(env, "--pool", "evil", "ls")
        assert code == 1
        assert "not the SHA256:000" in err
        assert "nothing was sent" in err


def start_poold(home: Path, data_dir: Path) -> subprocess.Popen[str]:
    """`make run` in `data_dir` by a user whose home is `home` (their pools.toml there)."""
    argv = [sys.executable, "-m", "daemon.main", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0"]
    argv += ["--metrics-listen", "127.0.0.1:0", "--web-listen", "off", "--worker-local-processors", "1"]
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg"), **JOBS_AS_ROOT}
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)


def registered(proc: subprocess.Popen[str]) -> str:
    """What poold logged about its entry in pools.toml, read until it said it was ready."""
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # poold logs ready, or exits (and the suite's timeout bounds it)
        lines.append(line)
        if "server ready on" in line:
            return "".join(line for line in lines if "pools.toml" in line)
    raise AssertionError("poold exited before it was ready:\n" + "".join(lines))


def plain_poolctl(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`poolctl ARGS` with no --pool, --server or GPUPOOL_*: the pool is pools.toml's to choose."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")}
    done = subprocess.run(
        [sys.executable, "-m", "daemon.ctl.cli", *args],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd="/",
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_two_single_machine_pools_have_a_name_each_and_a_killed_one_is_said_stale(tmp_path: Path) -> None:
    """issue 47 item 1: a second `make run` on the same machine took over the name `local` in
    pools.toml without a word, so plain poolctl talked to it; once it stopped, plain poolctl said
    "cannot reach" while the first still ran. Proves, with real poold processes on one HOME: the
    second registers as local-2 and says so, leaving the first's entry; plain poolctl still talks
    to the first and says which, and how to choose; a pool killed (SIGKILL: it could clean up
    nothing) is said to be registered but not running, with the pool that runs; and the next
    pool to start takes its stale name, saying so."""
    path = tmp_path / "xdg" / "gpupool" / "pools.toml"
    user = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}  # choose() as poolctl reads that file
    first = start_poold(tmp_path, tmp_path / "a")
    second = third = None
    try:
        said = registered(first)
        second = start_poold(tmp_path, tmp_path / "b")
        said += registered(second)
        a, b = (choose(None, name, user).server for name in ("local", "local-2"))
        assert (a, b) == (f"unix:{tmp_path / 'a' / 'pool.sock'}", f"unix:{tmp_path / 'b' / 'pool.sock'}")
        assert f"registered as pool 'local' in {path}\n" in said
        assert f"registered as pool 'local-2' in {path}: local is another pool, still running" in said
        assert "poolctl --pool local-2 reaches this one" in said

        listed = plain_poolctl(tmp_path, "workers")
        assert listed.returncode == 0, listed.stderr
        assert (
            f"poolctl: talking to pool 'local' ({a}); local-2 in {path} runs too: choose with --pool NAME"
            in listed.stderr
        )

        first.kill()
        first.wait(10)
        stale = plain_poolctl(tmp_path, "ls")
        assert stale.returncode == 3, stale.stderr
        assert (
            f"poolctl: pool 'local' is registered in {path} but not running (nothing answers at {a}). "
            "Start it again (`make run` in its directory), or choose one that runs: --pool local-2"
        ) in stale.stderr

        third = start_poold(tmp_path, tmp_path / "c")
        assert (
            f"pool 'local' in {path} was registered at {a}, which runs no more: registered this pool as"
            in registered(third)
        )
        assert choose(None, None, user).server == f"unix:{tmp_path / 'c' / 'pool.sock'}"
    finally:  # each pool stopped, and the killed one's Redis, which it could not stop
        for proc in (first, second, third):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (first, second, third):
            if proc is not None and proc.stderr is not None:
                proc.wait(30)
                proc.stderr.close()
        if first.returncode == -signal.SIGKILL:
            os.kill(redis_pid(tmp_path / "a"), signal.SIGKILL)
