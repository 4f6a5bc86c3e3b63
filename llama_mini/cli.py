"""The one error path of every command-line entry point (train.py, generate.py, convert, ablate).

The package raises ValueError (bad input: a flag, a file's content) and OSError (a missing
file, a full disk) with messages written for users: the file, the problem and the fix.
run_main prints such a message as one line, `error: ...`, and exits with code 2; Ctrl-C
exits with 130. Anything else is a bug and keeps its traceback.
"""

import sys


def run_main(main, argv=None) -> int:
    """Call main(argv); turn the package's own errors into one line on stderr and an exit code."""
    try:
        main(argv)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def flag(field: str) -> str:
    """The command-line flag of a setting: max_steps -> --max-steps."""
    return "--" + field.replace("_", "-")
