"""Which core code each kernel layer was written for: the record its layers are checked against.

A kernel layer stands in for functions of the core (model.py) or of the quantized layers'
definition (quant/layers.py), and names them in its class, `computes`. It is written for those
functions as they are here, so a reader who edits one (SwiGLU to GELU, no RoPE, a scaled
residual) must get the edited function, not the kernel's copy of the old one. FINGERPRINTS holds
a fingerprint of each function's code as the kernels were written for it; when a layer is
applied (operators.swap_classes), each function it computes is fingerprinted as it is loaded,
and a layer any of whose functions differs stays on the core's code, with one line naming it.

A fingerprint is a hash of the function's source with its docstring, comments and blank lines
left out: rewording a comment leaves the kernels on, any change to the code turns them off.
After changing a function and its kernel together, record the new fingerprint here
(`python -m llama_mini.kernels.fingerprints` prints the record as the code is now).
"""

import ast
import functools
import hashlib
import importlib
import inspect
import linecache
import logging
import textwrap
from typing import Optional

log = logging.getLogger(__name__)

FINGERPRINTS = {
    "model:RMSNorm.forward": "08e8868b5ae38af3",
    "model:RMSNorm._norm": "efa79eab8c54bc4c",
    "model:apply_rotary_emb": "9dfefa780cf8fc10",
    "model:Attention.rotate": "75421c314f9c0197",
    "model:Attention.forward": "fe6b8e5170da8d8f",
    "model:KVCache.__init__": "26f0eaa55528d4c1",
    "model:KVCache.update": "333cb64528a026b4",
    "model:FeedForward.gate": "9f72290dab103bae",
    "model:FeedForward.forward": "8b17d35bc1014d7b",
    "model:TransformerBlock.forward": "0df41cbf9a907634",
    "quant.layers:quantized_activations": "030c5e6c68562840",
    "quant.layers:quantized_linear": "892f6a41bdcb1e39",
    "quant.layers:float32_linear": "f8582cd4566c76e0",
    "quant.layers:Int8Linear.forward": "207fbc6f4f6086ac",
    "quant.layers:Int8Linear.dequantize": "2cf075cc773a867b",
    "quant.layers:Int8Linear.codes": "8a9722846a6d43bc",
    "quant.layers:Int8Linear.block_scales": "f5bb88187f9dd161",
    "quant.mapped_q8_0:q8_0_codes_and_scales": "d88db42356e12c0a",
    "quant.mapped_q8_0:MappedQ8_0Linear.codes": "6a495c4d3bb7f0d7",
    "quant.mapped_q8_0:MappedQ8_0Linear.block_scales": "b1fcceb76c338621",
    "quant.layers:Int4Linear.__init__": "ed9e32c9ed7c1331",
    "quant.layers:Int4Linear.forward": "207fbc6f4f6086ac",
    "quant.layers:Int4Linear.dequantize": "7aa01d0d5aeffaf2",
    "quant.layers:Int4Linear.codes": "de8c10939a988929",
    "quant.layers:Int4Linear.group_scales_and_offsets": "0af9b18ac9889396",
    "quant.layers:Int4Linear.symmetric_offsets": "3905db3d8a4cb1a6",
    "quant.layers:Int4Linear.factored": "dd9a55d55579b8a1",
    "quant.gguf_blocks:_q5_0": "d1a6c0dde1a71ada",
    "quant.gguf_blocks:_q4_0": "4839bdf4ba50500a",
    "quant.gguf_blocks:_q4_1": "47ceecdeab75b1fe",
    "quant.gguf_blocks:_q4_k": "5c43a0ee8cb88c8b",
    "quant.gguf_blocks:_blocks": "b5fe3dd3fc941a9b",
    "quant.layout:pack_int8": "ad498c5ca64251b0",
    "quant.layout:pack_int4": "5045c25f3a6d4c86",
    "quant.layout:_int4_runs": "3e93e3054650c6d3",
    "quant.layout:as_words": "b5ae9a9c144c1da0",
    "quant.layout:_bytes": "50a7eeeeb7304c52",
    "quant.layout:interleave_rows": "97f39044b5f7341f",
    "quant.layers:Int8Linear.store_rows": "008d8ffd5adf3992",
    "quant.layers:Int4Linear.store_rows": "33196f1f2f5934cd",
    "quant.k_quants:KQuantLinear.forward": "207fbc6f4f6086ac",
    "quant.k_quants:KQuantLinear.dequantize": "3fae4efd80a518af",
    "quant.k_quants:half": "770445abc161b587",
    "quant.k_quants:nibbles": "7ee96069641f6264",
    "quant.k_quants:Q5_KLinear.weights": "fff4f19cca2da2c6",
    "quant.k_quants:q5_k_codes_and_factors": "fb2c49b8e4301194",
    "quant.k_quants:scales_and_mins": "9446839f637c0607",
    "quant.k_quants:Q6_KLinear.weights": "8ffc5b5a1a6747b1",
    "quant.k_quants:q6_k_codes_and_scales": "2093da85eb2da4b0",
}


def live(name: str):
    """The function called name ("model:FeedForward.gate": a module of llama_mini, then the
    function's path in it), as llama_mini holds it now."""
    module, path = name.split(":")
    target = importlib.import_module(f"llama_mini.{module}")
    for attribute in path.split("."):
        target = getattr(target, attribute)
    return target


def fingerprint(function) -> Optional[str]:
    """A hash of function's code: its source less the docstring, comments and blank lines; None
    where its source cannot be read (a builtin, code made at run time)."""
    try:
        source, tree = _parsed(function)
    except (OSError, TypeError, SyntaxError):
        return None
    lines = source.splitlines()
    strings = _string_spans(tree)
    docstring = _docstring_rows(tree)
    kept = []
    for row, line in enumerate(lines, 1):
        if row in docstring:
            continue
        line = line[:_comment_start(line, strings.get(row, ()))].rstrip()
        if line.strip():
            kept.append(line)
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def _parsed(function):
    """function's source, dedented, and its syntax tree. The source is its def's lines and those
    indented under it: inspect.getsource finds the same lines by tokenizing the whole file in
    Python, most of a small model's load time, and is asked only where that cut splits a string
    or brackets at a lesser indent (it does not parse) or finds no def (a lambda)."""
    if block := _def_block(function):
        try:
            return block, ast.parse(block)
        except SyntaxError:
            pass
    source = textwrap.dedent(inspect.getsource(function))
    return source, ast.parse(source)


def _def_block(function) -> str:
    """The lines of function's def, from its first decorator, dedented ("" where not a def in a file)."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    lines = linecache.getlines(code.co_filename) if code else []
    first = code.co_firstlineno - 1 if code else 0
    if first >= len(lines) or not lines[first].lstrip().startswith(("def ", "async def ", "@")):
        return ""
    indent = len(lines[first]) - len(lines[first].lstrip())
    heading = lines[first].lstrip().startswith("@")  # decorators, then the def, at the def's indent
    end = first + 1
    for line in lines[first + 1:]:
        text = line.strip()
        if text and not text.startswith("#") and len(line) - len(line.lstrip()) <= indent:
            if not heading:
                break
            heading = text.startswith("@")
        end += 1
    while not lines[end - 1].strip() or lines[end - 1].strip().startswith("#"):
        end -= 1
    return textwrap.dedent("".join(lines[first:end]))


def _string_spans(tree) -> dict:
    """row -> the (start, end) columns its string literals cover (end None: to the line's end):
    the only places a # is not a comment. Read from the syntax tree, which parses in C, where
    tokenize reads the source character by character in Python."""
    spans = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) or isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            for row in range(node.lineno, node.end_lineno + 1):
                start = node.col_offset if row == node.lineno else 0
                end = node.end_col_offset if row == node.end_lineno else None
                spans.setdefault(row, []).append((start, end))
    return spans


def _comment_start(line: str, strings) -> int:
    """The column where line's comment starts (its length where it has none). Columns of the
    syntax tree are UTF-8 byte offsets, so the line is searched as bytes."""
    data = line.encode()
    at = data.find(b"#")
    while at != -1:
        if not any(start <= at and (end is None or at < end) for start, end in strings):
            return len(data[:at].decode())
        at = data.find(b"#", at + 1)
    return len(line)


def _docstring_rows(tree) -> set:
    """The rows of the docstring of the def or class the tree holds: a string standing alone
    as its body's first statement, on rows of its own."""
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not node.body:
        return set()
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str) \
            and first.lineno > node.lineno:
        return set(range(first.lineno, first.end_lineno + 1))
    return set()


def changed(names) -> Optional[str]:
    """The first of names (functions a layer computes) whose code is not the one FINGERPRINTS
    records, as loaded now; None where all are."""
    for name in names:
        try:
            current = fingerprint(live(name))
        except AttributeError:  # deleted or renamed
            current = None
        if current is None or current != FINGERPRINTS.get(name):
            return name
    return None


@functools.cache
def notice_changed(layer: str, name: str) -> None:
    """Say once per process that a layer steps aside for a changed core function."""
    module, path = name.split(":")
    log.warning("llama_mini: %s in llama_mini/%s.py is not the code the %s was written for (it was edited): the %s "
                "is left off, and that code runs", path, module.replace(".", "/"), layer, layer)


if __name__ == "__main__":
    for name in FINGERPRINTS:
        print(f'    "{name}": "{fingerprint(live(name))}",')
