"""`poolctl completion bash`: the shell completion function, made from poolctl's own parser, so
it offers exactly the commands and options there are; job ids come from the pool itself
(`poolctl ls --all --format id --no-header`, given two seconds, silent when there is no pool).

zsh uses the same function through bashcompinit (README: one line in ~/.zshrc).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

JOB_COMMANDS = ("show", "logs", "cancel", "wait", "get")  # whose arguments are job ids

BASH = """\
# poolctl completion for bash: source <(poolctl completion bash)
_poolctl() {
    local cur=${COMP_WORDS[COMP_CWORD]} cmd="" i
    for ((i = 1; i < COMP_CWORD; i++)); do
        case ${COMP_WORDS[i]} in
            --server|--tls-ca) ((i++)) ;;
            -*) ;;
            *) cmd=${COMP_WORDS[i]}; break ;;
        esac
    done
    local options
    case $cmd in
%(options)s
    esac
    if [[ -z $cmd || $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$options" -- "$cur"))
        return
    fi
    case $cmd in
        %(job_commands)s)
            local ids
            ids=$(timeout 2 %(poolctl)s ls --all --format id --no-header 2>/dev/null)
            COMPREPLY=($(compgen -W "$ids" -- "$cur")) ;;
        completion) COMPREPLY=($(compgen -W "bash" -- "$cur")) ;;
    esac
}
complete -o default -F _poolctl poolctl
"""


def bash(parser: argparse.ArgumentParser) -> str:
    """The bash completion script for `parser` (poolctl's)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cases = [f'        "") options="{" ".join([*sub.choices, *_options(parser)])}" ;;']
    for name, command in sub.choices.items():
        cases.append(f'        {name}) options="{" ".join(_options(command))}" ;;')
    # this very poolctl (a venv's, say), when it was run as a program; else the one on PATH
    program = os.path.abspath(sys.argv[0]) if os.access(sys.argv[0], os.X_OK) else "poolctl"
    return BASH % {
        "options": "\n".join(cases),
        "job_commands": "|".join(JOB_COMMANDS),
        "poolctl": shlex.quote(program),
    }


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
