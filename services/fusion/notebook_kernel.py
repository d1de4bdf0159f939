"""The notebook kernel of `/run_jupyter`: the program a call runs *inside* its sandbox with the
python layer's own `python3`, as `/run_code` runs the request's code. It has no privilege the
request's code lacks, and nothing outside trusts what it writes: the endpoint decodes its
results file as hostile input (typed, size-bounded; services/fusion/jupyter.py).

Usage: python3 notebook_kernel.py CELLS RESULTS CELL_TIMEOUT. CELLS is a JSON list of source
strings; each is run in one shared namespace, as a notebook's cells share their kernel. A
cell's last statement, if an expression whose value is not None, is its display
(`text/plain`, its repr), as IPython shows it. What the cell prints to sys.stdout and
sys.stderr is its output; an exception is its error (ename, evalue, traceback), and the next
cell still runs, as in a notebook run cell by cell. A cell past CELL_TIMEOUT seconds (0: no
limit) is interrupted with a TimeoutError and no cell after it runs. One JSON line per cell
is appended to RESULTS as the cell ends, so a run cut short still tells what it did.

Standard library only: it runs on whatever python3 the layer has.
"""

import ast
import contextlib
import io
import json
import signal
import sys
import traceback


class CellTimeout(BaseException):
    """Raised in a cell past its time (BaseException: `except Exception` in the cell cannot eat it)."""


def _on_alarm(signum, frame):
    raise CellTimeout()


def run_cell(source, scope):
    """Run `source` in `scope`; the value of its last statement if that is an expression."""
    tree = ast.parse(source, "<cell>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), scope)
    return eval(compile(last, "<cell>", "eval"), scope) if last is not None else None


def error_of(exc, timeout):
    if isinstance(exc, CellTimeout):
        return {"ename": "TimeoutError", "evalue": f"cell timed out after {timeout:g}s", "traceback": []}
    tb = exc.__traceback__  # from the cell's own frames on, as a notebook shows it
    while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc, tb)
    return {"ename": type(exc).__name__, "evalue": str(exc), "traceback": lines}


def main(cells_path, results_path, cell_timeout):
    with open(cells_path) as f:
        cells = json.load(f)
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    signal.signal(signal.SIGALRM, _on_alarm)
    with open(results_path, "a") as results:
        for source in cells:
            stdout, stderr = io.StringIO(), io.StringIO()
            display, error, stop = [], [], False
            try:
                with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                    sys.stdin = io.StringIO()  # a cell reads no input, as a notebook without a frontend
                    if cell_timeout > 0:
                        signal.setitimer(signal.ITIMER_REAL, cell_timeout)
                    try:
                        value = run_cell(source, scope)
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                if value is not None:
                    display.append({"text/plain": repr(value)})
            except CellTimeout as exc:
                error.append(error_of(exc, cell_timeout))
                stop = True
            except BaseException as exc:  # SystemExit and KeyboardInterrupt end the cell, not the kernel
                error.append(error_of(exc, cell_timeout))
            results.write(json.dumps({"stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
                                      "display": display, "error": error}) + "\n")
            results.flush()
            if stop:
                return


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
