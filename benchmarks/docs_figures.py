"""Every figure in README.md and docs/ from a results JSON: checked, and rewritten from it.

```
python benchmarks/docs_figures.py          # check: exits 1 naming each figure without a source or off its JSON
python benchmarks/docs_figures.py --fix    # rewrite each sourced figure from its JSON, at the precision shown
```

NOTE [ sourced figures ]
A figure is a number with a unit (`6.7x`, `165 MB`, `2500 MiB`, `1.32 s`, `18%`, `37 minutes`)
or a number that opens a table cell, anywhere in README.md or docs/*.md outside code. Each one
carries its source right after it, in an HTML comment that Markdown does not show:

    fits **6.7x**<!--= max_batch_bert4keras_base: methods.full.batch / methods.none.batch --> the batch

`file: expression`. The file is a JSON under `benchmarks/results/` (`.json` may be left out),
written by the benchmark that measured it, with the command, device, dtype, date and commit in
it. The expression is arithmetic (`+ - * /`, `min`, `max`, `abs`, `round`, `len`, `log`) over dotted
paths into that JSON (`results.none.points["4"].step_peak_bytes`; a key that is not a name goes
in brackets; `pick(results.rows, method="ours", mode="function")` is the one row of a list with
those fields; `column(results.rows, "step", label="full")` the list of that field in the rows with
those), and the constants `KB MB GB` (powers of 10) and `KiB MiB GiB` (powers of 2). A
range (`1.32-1.68x`, `1.10 to 1.15x`) takes an expression that gives two values, `a, b`.
`<!--= : expression -->` uses the file named by the latest `<!-- source: file -->` above it in
the same section (a heading ends it); `<!-- source: file prefix -->` also puts `prefix.` before
every path of those expressions.

The figure agrees with its source when the expression's value rounds to it at the precision it
is written with (`6.7` for 6.714, `47` for 47). `--fix` writes that rounding in place, so a
benchmark run again updates the docs with one command, and the check then shows what moved.

A figure that is not a measurement (a budget chosen for a run, a size in a plan, a test's
threshold) says so with `<!--given-->`. A figure measured once and kept as history (what a
defect did, why a design was chosen), with no results file, names the commit it was measured at,
`<!--at 960f857-->`: the check only makes sure that commit exists. A fenced `python` block is a program: its numbers are its arguments. Other
fenced blocks are commands and their output: a figure there needs a command in the same block,
and is not compared (the command prints it). The check runs in the
suite (`tests/test_docs.py`), so a figure edited by hand, or a result measured again without
`--fix`, fails it.
"""

import argparse
import ast
import glob
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
CONSTANTS = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30}
FUNCTIONS = {"min": min, "max": max, "abs": abs, "round": round, "len": len, "log": math.log}

_NUMBER = r"[+\-]?\d+(?:\.\d+)?(?:e-?\d+)?"
_UNIT = r"(?:x(?![\w])|\s?(?:%|KB|MB|MiB|GB|GiB|ms|us|s|min|minutes|seconds|hours)(?![\w]))"
# A figure: a number, or a range of two, then a unit.
FIGURE = re.compile(r"(?<![\w.^/\-+])(%s)(?:(\s?(?:-|to)\s?)(%s))?(%s)" % (_NUMBER, _NUMBER, _UNIT))
# The figure right before a source comment: its numbers, then the comment.
SOURCED = re.compile(
    r"(?<![\w.^/\-+])(%s)(?:(\s?(?:-|to)\s?)(%s))?(%s)?(\**\)?)<!--=\s*([^:>]*?)\s*:\s*(.*?)\s*-->" % (_NUMBER, _NUMBER, _UNIT)
)
GIVEN = re.compile(r"(%s)(%s)?(\**\)?)<!--given-->" % (_NUMBER, _UNIT))
SOURCE = re.compile(r"<!--\s*source:\s*([^\s>]+)(?:\s+([^\s>]+))?\s*-->")
# A table cell that is a figure: a number alone, or before a unit, a parenthesis or its source.
CELL_NUMBER = re.compile(r"^\s*\**(%s)(?=\**\s*$|\**\s*\(|%s|\**<!--)" % (_NUMBER, _UNIT))
AT = re.compile(r"(%s)(%s)?(\**\)?)<!--at ([0-9a-f]{7,40})-->" % (_NUMBER, _UNIT))
CODE_SPAN = re.compile(r"`[^`]*`")


class FigureError(Exception):
    pass


def documents():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def load(name):
    path = os.path.join(RESULTS, name if name.endswith(".json") else name + ".json")
    if not os.path.exists(path):
        raise FigureError("no results file %s" % os.path.relpath(path, ROOT))
    with open(path) as source:
        return json.load(source)


def pick(rows, **fields):
    """The one row of a list of dicts whose fields equal `fields` (`pick(results.rows, method="ours")`)."""
    found = _matching(rows, fields)
    if len(found) != 1:
        raise FigureError("%d rows have %s" % (len(found), ", ".join("%s=%r" % item for item in fields.items())))
    return found[0]


def column(rows, name, **fields):
    """The values of field `name` in the rows of a list of dicts whose fields equal `fields`, at least one
    (`min(column(results.rows, "step", label="full"))`)."""
    found = [row[name] for row in _matching(rows, fields) if name in row]
    if not found:
        raise FigureError("no row has %s and %s" % (name, ", ".join("%s=%r" % item for item in fields.items())))
    return found


def _matching(rows, fields):
    return [row for row in rows if all(row.get(key) == wanted for key, wanted in fields.items())]


FUNCTIONS["pick"] = pick
FUNCTIONS["column"] = column


def evaluate(expression, data, prefix=None):
    """The value of `expression` over the JSON `data` (paths under `prefix` when given)."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise FigureError("cannot read the expression %r: %s" % (expression, error.msg))
    root = _walk(data, prefix) if prefix else data
    operators = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                 ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a**b}

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Tuple):
            return tuple(value(element) for element in node.elts)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in operators:
            return operators[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
            keywords = {keyword.arg: value(keyword.value) for keyword in node.keywords}
            return FUNCTIONS[node.func.id](*[value(argument) for argument in node.args], **keywords)
        if isinstance(node, ast.Name):
            return CONSTANTS[node.id] if node.id in CONSTANTS else _step(root, node.id, node.id)
        if isinstance(node, ast.Attribute):
            return _step(value(node.value), node.attr, ast.unparse(node))
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            return _step(value(node.value), node.slice.value, ast.unparse(node))
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) and node.slice.step is None:
            bounds = [None if bound is None else value(bound) for bound in (node.slice.lower, node.slice.upper)]
            return value(node.value)[slice(*bounds)]
        raise FigureError("%r: only arithmetic over paths into the JSON is allowed" % expression)

    return value(tree)


def _step(here, key, where):
    try:
        return here[int(key)] if isinstance(here, list) else here[key]
    except (KeyError, IndexError, ValueError, TypeError):
        raise FigureError("the JSON has no %s" % where)


def _walk(data, path):
    here = data
    for key in path.split("."):
        here = _step(here, key, path)
    return here


def _decimals(text):
    mantissa = text.split("e")[0]
    return len(mantissa.split(".")[1]) if "." in mantissa else 0


def _agrees(shown, value):
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        return False
    if "e" in shown:
        digits = _decimals(shown)
        return float("%.*e" % (digits, value)) == float(shown)
    half = 0.5 * 10 ** -_decimals(shown)
    return abs(float(shown) - value) <= half * (1 + 1e-9) + 1e-12


def _format(shown, value):
    digits = _decimals(shown)
    text = "%.*e" % (digits, value) if "e" in shown else "%.*f" % (digits, value)
    return "+" + text if shown.startswith("+") and not text.startswith("-") else text


def _code_free(line):
    """The line with inline code blanked (same length, so positions hold)."""
    return CODE_SPAN.sub(lambda match: " " * len(match.group()), line)


def check_file(path, fix=False):
    """(problems, new text): each problem is 'file:line: what'."""
    problems = []
    relative = os.path.relpath(path, ROOT)
    with open(path) as source:
        lines = source.read().split("\n")
    fenced, code, block_has_command, block_figures = False, False, False, []
    default = (None, None)
    for number, line in enumerate(lines, 1):
        where = "%s:%d" % (relative, number)
        if line.lstrip().startswith("```"):
            if fenced and block_figures and not block_has_command:
                problems.append("%s: a code block with figures (%s) and no command that prints them" % (
                    "%s:%d" % (relative, block_figures[0][0]), ", ".join(text for _, text in block_figures[:3])))
            fenced, block_has_command, block_figures = not fenced, False, []
            code = fenced and line.strip()[3:].strip() in ("python", "py")
            continue
        if fenced and code:
            continue  # a program: its numbers are arguments, not measurements
        if fenced:
            stripped = line.strip()
            if stripped.startswith(("$ ", "python ", "PYTHONPATH=", "KERAS_BACKEND=", "PY=")):
                block_has_command = True
            block_figures += [(number, match.group(0)) for match in FIGURE.finditer(line)]
            continue
        if line.startswith("#"):
            default = (None, None)
        for match in SOURCE.finditer(line):
            default = (match.group(1), match.group(2))
        visible = _code_free(line)
        covered = []

        def replace(match):
            covered.append(match.span())
            first, separator, second, unit, close, name, expression = match.groups()
            file_name, prefix = (name, None) if name else default
            if not file_name:
                problems.append("%s: %s has no file and no `<!-- source: ... -->` above it" % (where, match.group(0)))
                return match.group(0)
            try:
                value = evaluate(expression, load(file_name), prefix if not name else None)
            except FigureError as error:
                problems.append("%s: %s%s: %s" % (where, first, unit or "", error))
                return match.group(0)
            shown = [first] + ([second] if second else [])
            values = list(value) if isinstance(value, (tuple, list)) else [value]
            if len(values) != len(shown):
                problems.append("%s: %s shows %d numbers, its expression gives %d" % (where, match.group(0), len(shown), len(values)))
                return match.group(0)
            wrong = [(text, got) for text, got in zip(shown, values) if not _agrees(text, got)]
            if wrong and not fix:
                for text, got in wrong:
                    problems.append("%s: %s%s is %s in %s (%s)" % (where, text, (unit or "").strip(), _show(got), file_name, expression))
                return match.group(0)
            if not wrong:
                return match.group(0)
            new = [_format(text, got) if (text, got) in wrong else text for text, got in zip(shown, values)]
            figure = new[0] + ((separator + new[1]) if second else "")
            return figure + (unit or "") + close + match.group(0)[match.group(0).index("<!--="):]

        masked = visible
        new_line = SOURCED.sub(replace, line) if "<!--=" in line else line
        if line.count("<!--=") != len(covered):
            problems.append("%s: a `<!--=` that does not follow a figure or does not end on its line" % where)
        if new_line != line:
            lines[number - 1] = new_line
        spans = covered + [m.span() for m in GIVEN.finditer(line)]
        for match in AT.finditer(line):
            spans.append(match.span())
            if not _is_commit(match.group(4)):
                problems.append("%s: %s is marked as measured at %s, which is no commit of this repository" % (
                    where, match.group(1), match.group(4)))
        for match in FIGURE.finditer(masked):
            if not any(start <= match.start() < end for start, end in spans):
                problems.append("%s: %s has no source (`<!--= file: expression -->` after it, or `<!--given-->`)" % (where, match.group(0).strip()))
        if line.startswith("|") and not re.match(r"^\|[\s:|-]+\|?$", line) and number < len(lines):
            previous = lines[number - 2] if number >= 2 else ""
            if previous.startswith("|"):  # a body row (the header row is followed by the separator)
                problems += _cell_problems(where, line, masked, spans)
    return problems, "\n".join(lines)


_COMMITS = {}


def _is_commit(name):
    """Whether `name` is a commit here; True where git cannot tell (no history, no git)."""
    if name not in _COMMITS:
        import subprocess

        try:
            done = subprocess.run(["git", "cat-file", "-e", name + "^{commit}"], cwd=ROOT, capture_output=True)
            history = subprocess.run(["git", "rev-parse", "--verify", "HEAD~1"], cwd=ROOT, capture_output=True)
            _COMMITS[name] = done.returncode == 0 or history.returncode != 0
        except OSError:
            _COMMITS[name] = True
    return _COMMITS[name]


def _cell_problems(where, line, masked, spans):
    problems = []
    position = 0
    cells = masked.split("|")
    for index, cell in enumerate(cells):
        start = position
        position += len(cell) + 1
        if index <= 1 or index == len(cells) - 1:
            continue  # before the first bar, the row's label, after the last bar
        match = CELL_NUMBER.match(cell)
        if not match:
            continue
        at = start + match.start(1)
        if not any(begin <= at < end for begin, end in spans):
            problems.append("%s: the cell '%s' opens with a figure that has no source" % (where, cell.strip()[:40]))
    return problems


def _show(value):
    return "%.6g" % value if isinstance(value, float) else repr(value)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="rewrite each sourced figure from its JSON")
    parser.add_argument("files", nargs="*", help="Markdown files (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    problems = []
    for path in args.files or documents():
        found, text = check_file(path, fix=args.fix)
        problems += found
        if args.fix:
            with open(path) as source:
                if source.read() != text:
                    with open(path, "w") as out:
                        out.write(text)
                    print("rewrote %s" % os.path.relpath(path, ROOT))
    for problem in problems:
        print(problem)
    print("%d figure problem%s" % (len(problems), "" if len(problems) == 1 else "s"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
