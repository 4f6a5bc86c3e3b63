"""The one error path of every command-line entry point (train.py, generate.py, convert, ablate),
and the one set of checks their flags go through.

The package raises ValueError (bad input: a flag, a file's content) and OSError (a missing
file, a full disk) with messages written for users: the file, the problem and the fix.
run_main prints such a message as one line, `error: ...`, and exits with code 2; Ctrl-C
exits with 130. Anything else is a bug and keeps its traceback.

Every number a flag takes is checked as soon as it is parsed, before any work, by check_number
(finite, within its range) or check_context (a context length): one line that names the flag.
"""

import math
import sys

# --kernels: auto runs llama_mini's CPU kernels where they build, off the plain model.py code.
KERNELS = ("auto", "off")

# RoPE positions are float32, exact integers up to 2**24; a context beyond that (Llama-3.1's
# is 131,072 tokens) is a typo, not a wish.
MAX_CONTEXT = 1 << 24


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


def check_number(name: str, value, low=None, high=None, low_open=False, high_open=False, note="") -> None:
    """Refuse value unless it is a finite number within [low, high] (an open end where asked;
    None: unbounded), in one line naming it: `--top-p must be in (0, 1] (1 keeps every token),
    got 1.5`. name is a flag (--top-p) or, for library calls, an argument's name (top_p).
    None (a flag left unset) passes."""
    if value is None:
        return
    fits = (low is None or (value > low if low_open else value >= low)) and \
           (high is None or (value < high if high_open else value <= high))
    finite = isinstance(value, int) or math.isfinite(value)  # an int may be too large for a float
    if fits and finite:
        return
    low_text, high_text = _shown(low), _shown(high)
    if low is not None and high is not None:
        bounds = [f"in {'(' if low_open else '['}{low_text}, {high_text}{')' if high_open else ']'}"]
    elif low is not None:
        bounds = [f"{'>' if low_open else '>='} {low_text}"]
    else:
        bounds = [f"{'<' if high_open else '<='} {high_text}"] if high is not None else []
    kind = [] if finite else ["a finite number"]
    raise ValueError(f"{name} must be {' '.join(kind + bounds)}{note}, got {value}")


def _shown(bound) -> str:
    """A bound as a user reads it: 2**64, not 18446744073709551616."""
    if isinstance(bound, int) and bound > 2**32 and bound & (bound - 1) == 0:
        return f"2**{bound.bit_length() - 1}"
    return str(bound)


def check_context(name: str, value) -> None:
    """Refuse a context length (or a number of positions) no model can have."""
    check_number(name, value, 1, MAX_CONTEXT, note=" tokens")



def utf8_text(raw, source: str) -> str:
    """raw as text, or one line naming source. raw is bytes, or a str as Python reads argv and
    stdin, where bytes that are not UTF-8 become lone surrogates that no tokenizer can encode,
    and no printed line, plot or JSON record can hold."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{source} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); pass UTF-8") from None
