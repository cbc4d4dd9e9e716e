"""`ftbundle completion bash|zsh`: a completion script made from the argument parser itself,
so it always knows every subcommand and flag. Pure text; zsh uses bash's through bashcompinit."""

from __future__ import annotations

import argparse


def _commands(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sorted(opt for action in sub._actions for opt in action.option_strings)
            for name, sub in subs.choices.items()}


def script(shell: str, parser: argparse.ArgumentParser) -> str:
    commands = _commands(parser)
    cases = "\n".join(f'        {name}) opts="{" ".join(opts)}" ;;' for name, opts in commands.items())
    body = f"""# ftbundle completion ({shell}): source <(ftbundle completion {shell})
_ftbundle() {{
    local cur cmd opts
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    if [ "$COMP_CWORD" -eq 1 ]; then
        COMPREPLY=( $(compgen -W "{" ".join(commands)} --help --version" -- "$cur") )
        return
    fi
    cmd="${{COMP_WORDS[1]}}"
    case "$cmd" in
{cases}
        *) opts="" ;;
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=( $(compgen -W "$opts" -- "$cur") )
    else
        COMPREPLY=( $(compgen -f -X '!*.y*ml' -- "$cur") $(compgen -d -- "$cur") )
    fi
}}
complete -o filenames -F _ftbundle ftbundle
"""
    if shell == "zsh":
        body = "autoload -U +X bashcompinit && bashcompinit\n" + body
    return body
