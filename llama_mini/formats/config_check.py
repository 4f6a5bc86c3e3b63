"""Checking a checkpoint's config values before any of them is used.

A config file is data from elsewhere. A size that is null, a string, zero or negative would
otherwise surface as a TypeError or ZeroDivisionError deep inside the model. Every number
a Llama config holds is a size or a positive constant, so one rule covers them all: the
field's type, and greater than zero (sizes also below 2**31, as llama2.c's int32 headers
have them, so no shape built from two of them overflows int64).
"""

import math
import typing

from ..support.files import brief
from ..model import ModelArgs

MAX_SIZE = 2**31 - 1
# Constants whose sane range is far narrower than "positive": an eps of 1e30 flattens every
# activation, a RoPE base of 1e-30 spins every frequency past float32's resolution. Llama's
# values are 1e-5 and 1e-6, and 10,000 to 500,000 (long-context variants reach a few million).
RANGES = {"norm_eps": (1e-12, 0.1), "rope_theta": (1.0, 1e12)}


def check_fields(values: dict, types: dict, source) -> None:
    """Each value whose name is in types has that type (int, float, bool, str, dict, or
    Optional of one: None allowed) and, if a number, is positive. Unnamed values are left
    to their reader; so are absent ones."""
    for name, value in values.items():
        kind = types.get(name)
        if kind is None:
            continue
        args = typing.get_args(kind)
        if typing.get_origin(kind) is typing.Union and type(None) in args:
            if value is None:
                continue
            kind = next(a for a in args if a is not type(None))
        problem = _problem(value, kind)
        if problem:
            raise ValueError(f"{source}: field {name!r} is {brief(value)}; {problem}")


def _problem(value, kind):
    """Why value is not a valid `kind`, or None if it is (or kind is not one checked here)."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int and not (is_number and isinstance(value, int) and 0 < value <= MAX_SIZE):
        return f"it must be a whole number from 1 to {MAX_SIZE}"
    if kind is float and not (is_number and math.isfinite(value) and value > 0):
        return "it must be a finite number greater than 0"
    if kind is bool and not isinstance(value, bool):
        return "it must be true or false"
    if kind in (str, dict) and not isinstance(value, kind):
        return f"it must be a {'string' if kind is str else 'JSON object'}"
    return None


def model_args(values: dict, source) -> ModelArgs:
    """ModelArgs(**values), with every value checked first; errors name source."""
    fields = typing.get_type_hints(ModelArgs)
    unknown = values.keys() - fields.keys()
    if unknown:
        raise ValueError(f"{source} has fields llama_mini does not know: {sorted(map(str, unknown))}")
    check_fields(values, fields, source)
    for name, (low, high) in RANGES.items():
        if name in values and not low <= values[name] <= high:
            raise ValueError(f"{source}: field {name!r} is {brief(values[name])}; a Llama model's is from {low:g} to {high:g}")
    try:
        args = ModelArgs(**values)
    except ValueError as e:  # a combination ModelArgs refuses, e.g. dim not divisible by n_heads
        raise ValueError(f"{source}: {e}") from None
    if args.vocab_size <= 0:  # ModelArgs' default (-1, as in Llama-2's params.json): unknown
        raise ValueError(f"{source} states no vocab_size; it must be the number of tokens, from 1 to {MAX_SIZE}")
    if args.ffn_dim > MAX_SIZE:
        raise ValueError(f"{source}: the feed-forward size comes to {args.ffn_dim}, more than {MAX_SIZE}")
    return args
