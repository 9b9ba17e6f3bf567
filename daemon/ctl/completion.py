"""`poolctl completion bash|zsh|fish`: TAB completion scripts, made from poolctl's own parser so
they offer exactly the commands and options there are: one `Table` of what to offer where, and a
small renderer per shell.

What only the pool knows (job ids, queue names) the scripts ask poolctl for on each TAB:
`poolctl completion --words jobs|cancellable|queues|pools` prints one word a line (`cancel` is
offered only the user's own jobs that have not ended; `--pool`, the pools named in pools.toml).
It is hidden from --help, gives the pool two seconds, and prints nothing and exits 0 when there is
no pool or anything fails: a TAB must never write errors into the terminal. One place asks, so the
three scripts cannot drift.

Install: bash `source <(poolctl completion bash)` in ~/.bashrc; zsh `source <(poolctl completion
zsh)` in ~/.zshrc (after compinit); fish `poolctl completion fish >
~/.config/fish/completions/poolctl.fish`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from daemon.ctl.cli import link
from protocol import JobList, ListJobs, ListWorkers, WorkerList

ASK_SECONDS = 2.0  # a TAB waits this long at most for the pool's words
JOBS_LISTED = 1000  # the newest jobs, finished ones included: what `ls --all` shows


@dataclass(frozen=True)
class Words:
    """What to offer at one place: fixed words, or those `poolctl completion --words ASK` prints."""

    fixed: tuple[str, ...] = ()
    ask: str | None = None


JOBS, CANCELLABLE, QUEUES, POOLS = (Words(ask=a) for a in ("jobs", "cancellable", "queues", "pools"))
# argparse dests whose values only the pool (or pools.toml) knows, by command ("" for poolctl's own
# options; None for any command)
ASKED = {
    (None, "job"): JOBS,
    (None, "jobs"): JOBS,
    ("cancel", "jobs"): CANCELLABLE,  # a finished job, or another user's, cannot be cancelled
    (None, "queue"): QUEUES,
    ("", "pool"): POOLS,
}


def asked(command: str, dest: str) -> Words | None:
    """What to offer for `command`'s argument `dest`, when the pool or pools.toml knows it."""
    return ASKED.get((command, dest)) or (ASKED.get((None, dest)) if command else None)


@dataclass
class Table:
    """Everything the scripts offer, by command ("" while no command is typed yet)."""

    commands: list[str]
    options: dict[str, list[str]]  # the --options of each command; "": poolctl's own
    skip: list[str]  # poolctl's own options that take a value: the word after one is no command
    values: dict[tuple[str, str], Words] = field(default_factory=dict)  # (command, option): its value
    arguments: dict[str, Words] = field(default_factory=dict)  # a command's positional arguments


def table(parser: argparse.ArgumentParser) -> Table:
    """What to offer where, read from poolctl's parser."""
    sub = _commands(parser)
    own = _shown(parser)
    t = Table(
        commands=list(sub.choices),
        options={"": _long(own)},
        skip=[s for a in own if a.nargs != 0 for s in a.option_strings],
    )
    for a in own:  # the value of poolctl's own option: never a command (a file's name, maybe)
        if a.nargs != 0 and a.option_strings:
            t.values.update({("", s): asked("", a.dest) or Words() for s in a.option_strings})
    for name, command in sub.choices.items():
        actions = _shown(command)
        t.options[name] = _long(actions)
        for a in actions:
            if a.option_strings and (w := asked(name, a.dest)):
                t.values.update({(name, s): w for s in a.option_strings})
            elif not a.option_strings and name not in t.arguments:  # the first positional decides
                if a.choices:
                    t.arguments[name] = Words(fixed=tuple(a.choices))
                elif w := asked(name, a.dest):
                    t.arguments[name] = w
    return t


def _commands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _shown(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS]


def _long(actions: list[argparse.Action]) -> list[str]:
    return [s for a in actions for s in a.option_strings if s.startswith("--")]


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`poolctl completion`: the words asked for, or the script for a shell."""
    if args.words:
        return words(args, args.words)
    if args.shell is None:
        _commands(parser).choices["completion"].error(f"which shell? one of {', '.join(RENDERERS)}")
    print(RENDERERS[args.shell](table(parser), _program()), end="")
    return 0


# -- the words only the pool knows ------------------------------------------------------------------


def words(args: argparse.Namespace, kind: str) -> int:
    """Print the pool's words of `kind` (jobs, cancellable, queues, pools), one a line; nothing,
    and exit 0, when the pool cannot be asked or does not answer within ASK_SECONDS. The asking
    runs on a daemon thread so that the wait is bounded however the connection stalls
    (one_shot.call waits for a reply as long as it takes); a thread left waiting ends with the
    process."""
    found: list[str] = []

    def ask() -> None:
        with contextlib.suppress(Exception):  # no pool, no token, a refusal: nothing to offer
            found.extend(_ask(args, kind))

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(ASK_SECONDS)
    if not thread.is_alive() and found:
        print("\n".join(found))
    return 0


def _ask(args: argparse.Namespace, kind: str) -> list[str]:
    """The words, asked of the pool that every other command would ask, as it would ask it (the
    pools' names, of pools.toml: no pool is asked)."""
    if kind == "pools":
        from daemon import pools

        return sorted(pools.read(os.environ).get("pools") or {})
    to = link(args)
    jobs = to.call(ListJobs(None, None, kind != "cancellable", JOBS_LISTED), JobList).jobs
    if kind == "jobs":
        return [str(j["id"]) for j in jobs]
    if kind == "cancellable":  # not ended (ListJobs without the finished), and the user's own
        return [str(j["id"]) for j in jobs if j["spec"]["user"] == to.user]
    served = {str(q) for w in to.call(ListWorkers(), WorkerList).workers for q in w.get("queues") or ()}
    return sorted(served | {str(j["spec"]["queue"]) for j in jobs})


# -- the scripts --------------------------------------------------------------------------------------


def _program() -> str:
    """This very poolctl (a venv's, say) when it was run as a program; else the one on PATH."""
    return os.path.abspath(sys.argv[0]) if os.access(sys.argv[0], os.X_OK) else "poolctl"


def _arms(t: Table, offer: Callable[[Words], str]) -> str:
    """bash's and zsh's `case` arms on "COMMAND:PREVIOUS WORD:CURRENT WORD", first match wins:
    an option's value, a command's options, its arguments, then poolctl's commands and options."""
    arms = [
        *_grouped((f"{c}:{o}:*", w) for (c, o), w in t.values.items()),
        *_grouped((f"{c}:*:-*", Words(fixed=tuple(o))) for c, o in t.options.items() if c),
        *_grouped((f"{c}:*:*", w) for c, w in t.arguments.items()),
        (":*:*", Words(fixed=(*t.commands, *t.options[""]))),
    ]
    return "\n".join(f"        {pattern}) offer={offer(w)} ;;" for pattern, w in arms)


def _grouped(places: Iterable[tuple[str, Words]]) -> list[tuple[str, Words]]:
    """The places that offer the same words as one arm, their patterns joined: a shorter script."""
    patterns: dict[Words, list[str]] = {}
    for pattern, w in places:
        patterns.setdefault(w, []).append(pattern)
    return [(" | ".join(p), w) for w, p in patterns.items()]


BASH = """\
# poolctl completion for bash: source <(poolctl completion bash), in ~/.bashrc
_poolctl_words() { %(program)s completion --words "$1" 2>/dev/null; }
_poolctl() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} cmd="" offer="" i
    for ((i = 1; i < COMP_CWORD; i++)); do
        case ${COMP_WORDS[i]} in
            %(skip)s) ((i++)) ;;
            -*) ;;
            *) cmd=${COMP_WORDS[i]}; break ;;
        esac
    done
    case ${cmd}:${prev}:${cur} in
%(arms)s
    esac
    COMPREPLY=($(compgen -W "$offer" -- "$cur"))
}
complete -o default -F _poolctl poolctl
"""


def bash(t: Table, program: str) -> str:
    def offer(w: Words) -> str:
        return f'"$(_poolctl_words {w.ask})"' if w.ask else f'"{" ".join(w.fixed)}"'

    return BASH % {"program": shlex.quote(program), "skip": "|".join(t.skip), "arms": _arms(t, offer)}


ZSH = """\
#compdef poolctl
# poolctl completion for zsh: source <(poolctl completion zsh), in ~/.zshrc after compinit
_poolctl_words() { %(program)s completion --words $1 2>/dev/null }
_poolctl() {
    local cmd="" i
    local -a offer
    for ((i = 2; i < CURRENT; i++)); do
        case ${words[i]} in
            %(skip)s) ((i++)) ;;
            -*) ;;
            *) cmd=${words[i]}; break ;;
        esac
    done
    case ${cmd}:${words[CURRENT-1]}:${words[CURRENT]} in
%(arms)s
        *) _files; return ;;
    esac
    compadd -- $offer
}
if [[ $funcstack[1] == _poolctl ]]; then _poolctl "$@"; else compdef _poolctl poolctl; fi
"""


def zsh(t: Table, program: str) -> str:
    def offer(w: Words) -> str:
        if not w.ask and not w.fixed:  # no words of its own: a file's name, maybe
            return "(); _files; return"
        return f'(${{(f)"$(_poolctl_words {w.ask})"}})' if w.ask else f"({' '.join(w.fixed)})"

    return ZSH % {"program": shlex.quote(program), "skip": "|".join(t.skip), "arms": _arms(t, offer)}


FISH = """\
# poolctl completion for fish: poolctl completion fish > ~/.config/fish/completions/poolctl.fish
function __poolctl_words
    %(program)s completion --words $argv 2>/dev/null
end
function __poolctl_is --description 'is the command on the line so far $argv[1] ("" for none yet)?'
    set -l line (commandline -opc)
    set -l cmd ""
    set -l i 2
    while test $i -le (count $line)
        switch $line[$i]
            case %(skip)s
                set i (math $i + 1)
            case '-*'
            case '*'
                set cmd $line[$i]
                break
        end
        set i (math $i + 1)
    end
    test "$cmd" = "$argv[1]"
end
%(lines)s
"""


def fish(t: Table, program: str) -> str:
    def offer(w: Words) -> str:
        return f"'(__poolctl_words {w.ask})'" if w.ask else f"'{' '.join(w.fixed)}'"

    def flags(options: list[str]) -> str:
        return " ".join(f"-l {o[2:]}" if o.startswith("--") else f"-s {o[1:]}" for o in options)

    def when(command: str) -> str:
        return f"complete -c poolctl -n '__poolctl_is {command or chr(34) * 2}'"

    lines = [f"{when('')} -f -a {offer(Words(fixed=tuple(t.commands)))}"]
    for command, options in t.options.items():
        asks = [o for o in options if t.values.get((command, o), Words()) != Words()]
        taking = [o for o in options if not command and o in t.skip and o not in asks]  # files, maybe
        plain = [o for o in options if o not in taking and o not in asks]
        lines.append(f"{when(command)} {flags(plain)}")
        if taking:
            lines.append(f"{when(command)} {flags(taking)} -r")
    asked: dict[tuple[str, Words], list[str]] = {}
    for (command, option), w in t.values.items():
        if w != Words():
            asked.setdefault((command, w), []).append(option)
    lines += [f"{when(c)} {flags(o)} -x -a {offer(w)}" for (c, w), o in asked.items()]
    lines += [f"{when(c)} -f -a {offer(w)}" for c, w in t.arguments.items()]
    return FISH % {"program": shlex.quote(program), "skip": " ".join(t.skip), "lines": "\n".join(lines)}


RENDERERS: dict[str, Callable[[Table, str], str]] = {"bash": bash, "zsh": zsh, "fish": fish}
