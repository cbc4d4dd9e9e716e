"""One module per `ftbundle` command: what the command does, once cli.py has parsed its flags.

Each ``cmd_*`` takes the parsed arguments and returns the exit code; a user's mistake is
raised as :class:`~ftbundle.errors.UserError` (exit 2 at the CLI edge). The flow of
``run`` reads top to bottom in run.py: job + hosts -> layout (common.load_layout) -> facts
(the check) -> plan -> launch -> report. The modules import what is below them (job,
inventory, plan, cluster, check, launch, export, ui), never cli.py or each other, except
common.py, which they all share.
"""
